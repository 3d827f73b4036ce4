"""Who can reach what in a pool: for representative pools (our gateway, an InferencePool with
and without the Gateway's data plane named, KV events on and off, scrapers narrowed), every
(source pod, target pod, port) is evaluated against the rendered NetworkPolicies (Kubernetes
semantics, tests/support/netpol.py; no CNI runs here) and compared with the intended table:
each cell says who must be able to connect, and so who must not. `pytest -s` prints them."""

from __future__ import annotations

import pytest

from pdpool.operator.builders import build_children
from pdpool.operator.children import PoolRef
from pdpool.operator.spec import parse_pool_spec
from tests.support import netpol
from tests.support.netpol import Pod

SPEC = {"model": {"path": "/models/qwen3"}, "engine": {"image": "engine:1"}}
KV_ON = {"router": {"kvEvents": {"enabled": True}}}
ENVOY_NS = "envoy-gateway-system"
ENVOY = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ENVOY_NS}},
    "podSelector": {"matchLabels": {"gateway.envoyproxy.io/owning-gateway-name": "inference"}},
}

NAMESPACES = {
    "llm": {"kubernetes.io/metadata.name": "llm"},
    "team-b": {"kubernetes.io/metadata.name": "team-b"},
    "monitoring": {
        "kubernetes.io/metadata.name": "monitoring",
        "pdpool.io/metrics-scraper": "true",
    },
    ENVOY_NS: {"kubernetes.io/metadata.name": ENVOY_NS},
}


def pool_pod(pool, role, ns="llm"):
    return Pod(
        f"{pool}-{role}",
        ns,
        {"pdpool.io/pool": pool, "pdpool.io/role": role, "app.kubernetes.io/name": "pdpool"},
        ip="10.1.0.1",
    )


SOURCES = [
    pool_pod("demo", "prefill"),
    pool_pod("demo", "decode"),
    pool_pod("demo", "gateway"),
    pool_pod("demo", "epp"),
    pool_pod("other", "decode"),  # another pool, same namespace
    Pod("web (same ns)", "llm", {"app": "web"}, "10.1.0.2"),
    Pod("pod in team-b", "team-b", {"app": "x"}, "10.1.0.3"),
    Pod("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"}, "10.1.0.4"),
    Pod("grafana", "monitoring", {"app.kubernetes.io/name": "grafana"}, "10.1.0.5"),
    Pod(
        "envoy (gateway)",
        ENVOY_NS,
        {"gateway.envoyproxy.io/owning-gateway-name": "inference"},
        "10.1.0.6",
    ),
    Pod("external client", None),
]
ALL = frozenset(s.name for s in SOURCES)
TARGETS = [  # (pod, what, port)
    ("demo-prefill", "http", 8000),
    ("demo-prefill", "metrics", 9090),
    ("demo-prefill", "nixl", 5600),
    ("demo-prefill", "ucx", 5601),
    ("demo-prefill", "ucx", 5664),
    ("demo-prefill", "events", 5557),
    ("demo-prefill", "replay", 5558),
    ("demo-prefill", "other", 9000),
    ("demo-decode", "http", 8000),
    ("demo-decode", "metrics", 9090),
    ("demo-decode", "nixl", 5600),
    ("demo-decode", "ucx", 5630),
    ("demo-decode", "sidecar", 8080),
    ("demo-decode", "sidecar-metrics", 9091),
    ("demo-decode", "events", 5557),
    ("demo-decode", "replay", 5558),
    ("demo-gateway", "http", 8080),
    ("demo-gateway", "metrics", 9090),
    ("demo-epp", "ext_proc", 9002),
    ("demo-epp", "metrics", 9090),
]
ENGINES = {"demo-prefill", "demo-decode"}  # the decode pod holds the sidecar
SCRAPERS = {"prometheus", "grafana"}  # the default metricsFrom: the labelled namespace


def _base():
    """Our gateway, KV events off, default scrapers: the table every scenario edits.
    Scrapers reach the metrics ports (GET /metrics alone) and no serving port."""
    table = {(t, p): set() for t, _, p in TARGETS}
    for target in ENGINES:
        for port in (8000, 5600):
            table[(target, port)] = set(ENGINES)
        table[(target, 9090)] = set(SCRAPERS)
    for port in (5601, 5664):
        table[("demo-prefill", port)] = set(ENGINES)
    table[("demo-decode", 5630)] = set(ENGINES)
    table[("demo-decode", 8080)] = {"demo-gateway"}
    table[("demo-decode", 9091)] = set(SCRAPERS)
    table[("demo-gateway", 8080)] = set(ALL)
    table[("demo-gateway", 9090)] = set(SCRAPERS)
    return table


def _kv_events(table, routers):
    for port in (5557, 5558):
        table[("demo-prefill", port)] = {"demo-decode"}  # the sidecars subscribe
        table[("demo-decode", port)] = set(routers)
    return table


def _gateway_mode():
    return _base()


def _gateway_mode_kv():
    return _kv_events(_base(), {"demo-gateway"})


def _inference_pool(data_plane=frozenset(), kv_events=True):
    table = _base()
    if kv_events:  # the EPP routes by them as the gateway does
        _kv_events(table, {"demo-gateway", "demo-epp"})
    table[("demo-decode", 8080)] |= {"demo-epp", *data_plane}
    table[("demo-epp", 9002)] = set(data_plane)
    table[("demo-epp", 9090)] = set(SCRAPERS)
    return table


def _narrowed():
    """clientsFrom team-b, metricsFrom only the Prometheus pods: grafana, in the same
    labelled namespace, no longer reaches the metrics ports; prometheus still reaches no
    serving port, the gateway's included."""
    table = _base()
    for key in (("demo-prefill", 9090), ("demo-decode", 9090), ("demo-decode", 9091)):
        table[key].discard("grafana")
    table[("demo-gateway", 9090)] = {"prometheus"}
    table[("demo-gateway", 8080)] = {"pod in team-b"}
    return table


def _stock_vllm():
    """engine.kind vllm: stock vLLM serves /metrics on its API port only, which is then the
    engines' metrics port (sidecars and the gateway keep theirs)."""
    table = _base()
    for target in ENGINES:
        table[(target, 8000)] |= SCRAPERS
        table[(target, 9090)] = set()
    return table


def _no_clients():
    """clientsFrom []: nobody calls the gateway (an empty `from` would admit anyone)."""
    table = _base()
    table[("demo-gateway", 8080)] = set()
    return table


NARROW = {
    "networkPolicy": {
        "clientsFrom": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "team-b"}}}
        ],
        "metricsFrom": [
            {
                "namespaceSelector": {"matchLabels": {"pdpool.io/metrics-scraper": "true"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
            }
        ],
    }
}
GIE = {"inferencePool": {"enabled": True}}
GIE_ENVOY = {"inferencePool": {"enabled": True, "gatewayFrom": [ENVOY]}}
SCENARIOS = {  # name -> (spec sections, intended table)
    "gateway": ({}, _gateway_mode()),
    "gateway+kvEvents": (KV_ON, _gateway_mode_kv()),
    "inferencePool+kvEvents": ({**GIE, **KV_ON}, _inference_pool()),
    "inferencePool+gatewayFrom+kvEvents": (
        {**GIE_ENVOY, **KV_ON},
        _inference_pool({"envoy (gateway)"}),
    ),
    "inferencePool+gatewayFrom": (GIE_ENVOY, _inference_pool({"envoy (gateway)"}, False)),
    "narrowed scrapers and clients": (NARROW, _narrowed()),
    "engine.kind vllm": ({"engine": {"image": "vllm:1", "kind": "vllm"}}, _stock_vllm()),
    "clientsFrom []": ({"networkPolicy": {"clientsFrom": []}}, _no_clients()),
}


def rendered_policies(spec=SPEC):
    out = []
    for pool in ("demo", "other"):
        kids = build_children(PoolRef(pool, "llm", f"uid-{pool}"), parse_pool_spec(pool, spec))
        out += [m for m in kids if m["kind"] == "NetworkPolicy"]
    return out


def allowed(policies, source, target, port):
    return netpol.allowed(policies, source, target, port, NAMESPACES)


def reachability(policies, targets=TARGETS):
    pods = {s.name: s for s in SOURCES}
    return {
        (t, port): {s.name for s in SOURCES if allowed(policies, s, pods[t], port)}
        for t, _, port in targets
    }


def format_table(table, targets=TARGETS):
    lines = [
        "from \\ to".ljust(16)
        + " ".join(f"{t.replace('demo-', '')[:3]}:{p}".ljust(8) for t, _k, p in targets)
    ]
    for s in SOURCES:
        label = s.name.replace("demo-", "").replace(" (same ns)", "").replace(" (gateway)", "")
        lines.append(
            label[:15].ljust(16)
            + " ".join(("yes" if s.name in table[(t, p)] else "-").ljust(8) for t, _, p in targets)
        )
    lines.append(
        "(pre = prefill, dec = decode, gat = gateway, epp = endpoint picker; 8000 engine "
        "HTTP, 9090 engine / gateway / EPP metrics, 9091 sidecar metrics, 5600 NIXL "
        "handshake, 5601-5664 UCX TCP, 5557/5558 KV events PUB/replay, 8080 sidecar / "
        "gateway, 9002 ext_proc)"
    )
    return "\n".join(lines)


# --- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_reachability_is_the_intended_table(scenario):
    sections, intended = SCENARIOS[scenario]
    spec = {**SPEC, **sections}
    # Without an InferencePool there is no EPP pod to reach: its columns say nothing.
    targets = [t for t in TARGETS if t[0] != "demo-epp" or "inferencePool" in sections]
    table = reachability(rendered_policies(spec), targets)
    print(f"\nreachability, {scenario} (rows: source pod, columns: target:port)")
    print(format_table(table, targets))
    for t, _, port in targets:
        assert table[(t, port)] == intended[(t, port)], (
            (t, port),
            "unexpected:",
            sorted(table[(t, port)] - intended[(t, port)]),
            "missing:",
            sorted(intended[(t, port)] - table[(t, port)]),
        )


def test_no_source_outside_the_pool_reaches_a_decode_sidecar_in_inference_pool_mode():
    """The sidecar checks no API key, tenant or limit: only the routers, the named data
    plane and the scrapers may reach it (the old rendering opened it to every source)."""
    for sections in (GIE, GIE_ENVOY):
        table = reachability(rendered_policies({**SPEC, **sections}))
        for outsider in ("web (same ns)", "pod in team-b", "other-decode", "external client"):
            assert outsider not in table[("demo-decode", 8080)], sections


def test_gateway_from_must_be_peers():
    from pdpool.operator.spec import SpecError

    for bad in ([], [{}], [{"podSelector": {}, "ports": [80]}], "envoy"):
        with pytest.raises(SpecError, match="gatewayFrom"):
            parse_pool_spec(
                "demo", {**SPEC, "inferencePool": {"enabled": True, "gatewayFrom": bad}}
            )


def test_decode_service_exposes_only_the_sidecar():
    kids = build_children(PoolRef("demo", "llm", "u"), parse_pool_spec("demo", SPEC))
    decode = next(
        m for m in kids if m["kind"] == "Service" and m["metadata"]["name"] == "demo-decode"
    )
    assert [p["port"] for p in decode["spec"]["ports"]] == [8080]


def test_engines_pin_ucx_to_the_range_the_policy_opens():
    kids = build_children(PoolRef("demo", "llm", "u"), parse_pool_spec("demo", SPEC))
    prefill = next(
        m for m in kids if m["kind"] == "Deployment" and m["metadata"]["name"] == "demo-prefill"
    )
    engine = prefill["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["UCX_TCP_PORT_RANGE"] == "5601-5664"
    policy = next(
        m for m in kids if m["kind"] == "NetworkPolicy" and m["metadata"]["name"] == "demo-engines"
    )
    assert {"protocol": "TCP", "port": 5601, "endPort": 5664} in policy["spec"]["ingress"][0][
        "ports"
    ]


def test_policies_can_be_off():
    off = build_children(
        PoolRef("demo", "llm", "u"),
        parse_pool_spec("demo", dict(SPEC, networkPolicy={"enabled": False})),
    )
    assert not [m for m in off if m["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize(
    "source", ["web (same ns)", "pod in team-b", "other-decode", "external client", "demo-gateway"]
)
def test_nobody_outside_the_pool_reaches_engine_or_kv_ports(source):
    table = reachability(rendered_policies({**SPEC, **KV_ON}))
    for (target, port), who in table.items():
        if target in ENGINES and port not in (8080, 5557, 5558):
            assert source not in who, (target, port)


def test_policies_are_applied_before_any_pod_can_exist():
    kinds = [
        m["kind"]
        for m in build_children(PoolRef("demo", "llm", "u"), parse_pool_spec("demo", SPEC))
    ]
    first_deployment = kinds.index("Deployment")
    assert all(kinds.index(k) < first_deployment for k in ("NetworkPolicy", "PodDisruptionBudget"))


@pytest.mark.parametrize("tls", [False, True])
def test_each_metrics_port_is_where_its_program_serves_metrics_alone(tls):
    """The ports the policies admit scrapers to are the containers' named metrics ports,
    and each program is told to serve its metrics there (--metrics-port)."""
    spec = (
        {**SPEC, "gateway": {"tlsSecret": "gw-tls"}, "tls": {"secretName": "pool"}} if tls else SPEC
    )
    kids = build_children(PoolRef("demo", "llm", "u"), parse_pool_spec("demo", spec))
    seen = {}
    for d in (m for m in kids if m["kind"] == "Deployment"):
        containers = d["spec"]["template"]["spec"]["containers"]
        named = [p for c in containers for p in c["ports"] if "metrics" in p["name"]]
        assert len({p["containerPort"] for p in named}) == len(named)  # one netns per pod
        for c in containers:
            argv = c["command"]
            (port,) = [p for p in c["ports"] if "metrics" in p["name"]]
            assert argv[argv.index("--metrics-port") + 1] == str(port["containerPort"])
            assert port["name"].endswith("-tls") == tls
            seen[(d["metadata"]["name"], c["name"])] = (port["name"], port["containerPort"])
    suffix = "-tls" if tls else ""
    assert seen == {
        ("demo-prefill", "engine"): (f"metrics{suffix}", 9090),
        ("demo-decode", "engine"): (f"metrics{suffix}", 9090),
        ("demo-decode", "sidecar"): (f"sc-metrics{suffix}", 9091),
        ("demo-gateway", "gateway"): (f"metrics{suffix}", 9090),
    }
