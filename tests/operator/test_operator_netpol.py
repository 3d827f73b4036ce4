"""Who can reach what in a pool: a reachability table derived from the rendered
NetworkPolicies (Kubernetes semantics, evaluated here; no CNI runs in the tests), checked
against the intended matrix and printed (`pytest -s` shows it)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

import pytest

from pdpool.operator.builders import build_children
from pdpool.operator.children import PoolRef
from pdpool.operator.spec import parse_pool_spec

SPEC = {"model": {"path": "/models/qwen3"}, "engine": {"image": "engine:1"}}


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str | None  # None: outside the cluster (an IP, no labels)
    labels: dict = field(default_factory=dict, hash=False)
    ip: str = "203.0.113.7"


NAMESPACES = {
    "llm": {"kubernetes.io/metadata.name": "llm"},
    "team-b": {"kubernetes.io/metadata.name": "team-b"},
    "monitoring": {
        "kubernetes.io/metadata.name": "monitoring",
        "pdpool.io/metrics-scraper": "true",
    },
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
    pool_pod("other", "decode"),  # another pool, same namespace
    Pod("web (same ns)", "llm", {"app": "web"}, "10.1.0.2"),
    Pod("pod in team-b", "team-b", {"app": "x"}, "10.1.0.3"),
    Pod("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"}, "10.1.0.4"),
    Pod("external client", None),
]
TARGETS = [
    ("demo-prefill", "http", 8000),
    ("demo-prefill", "nixl", 5600),
    ("demo-prefill", "ucx", 5601),
    ("demo-prefill", "ucx", 5664),
    ("demo-prefill", "other", 9000),
    ("demo-decode", "http", 8000),
    ("demo-decode", "nixl", 5600),
    ("demo-decode", "ucx", 5630),
    ("demo-decode", "sidecar", 8080),
    ("demo-gateway", "http", 8080),
]
ENGINES = {"demo-prefill", "demo-decode"}  # the decode pod holds the sidecar
INTENDED = {  # (target, port) -> the sources that may connect
    **{(t, p): ENGINES for t, _, p in TARGETS if t != "demo-gateway" and p != 8080},
    ("demo-prefill", 9000): set(),
    ("demo-prefill", 8000): ENGINES | {"prometheus"},
    ("demo-decode", 8000): ENGINES | {"prometheus"},
    ("demo-decode", 8080): {"demo-gateway", "prometheus"},
    ("demo-gateway", 8080): {s.name for s in SOURCES},
}


# --- NetworkPolicy semantics -----------------------------------------------------------------


def selector_matches(selector: dict | None, labels: dict) -> bool:
    if selector is None:
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def peer_matches(peer: dict, source: Pod, policy_ns: str) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        ip = ipaddress.ip_address(source.ip)
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(c) for c in block.get("except", [])
        )
    if source.namespace is None:
        return False  # pod/namespace selectors only ever match pods
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], NAMESPACES[source.namespace]):
            return False
    elif source.namespace != policy_ns:
        return False
    return "podSelector" not in peer or selector_matches(peer["podSelector"], source.labels)


def port_matches(rule_port: dict, port: int) -> bool:
    start = rule_port.get("port")
    if start is None:
        return True
    return start <= port <= rule_port.get("endPort", start)


def allowed(policies: list[dict], source: Pod, target: Pod, port: int) -> bool:
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == target.namespace
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and selector_matches(p["spec"]["podSelector"], target.labels)
    ]
    if not selecting:
        return True  # no policy selects the pod: everything is allowed
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            ports_ok = not rule.get("ports") or any(port_matches(p, port) for p in rule["ports"])
            peers = rule.get("from")
            from_ok = not peers or any(
                peer_matches(p, source, policy["metadata"]["namespace"]) for p in peers
            )
            if ports_ok and from_ok:
                return True
    return False


def reachability(policies):
    targets = {s.name: s for s in SOURCES}
    return {
        (t, port): {s.name for s in SOURCES if allowed(policies, s, targets[t], port)}
        for t, _, port in TARGETS
    }


def format_table(table):
    names = [s.name for s in SOURCES]
    short = [n.replace("demo-", "").replace(" (same ns)", "") for n in names]
    lines = [
        "from \\ to".ljust(16)
        + " ".join(f"{t.replace('demo-', '')[:3]}:{p}".ljust(8) for t, _k, p in TARGETS)
    ]
    for name, label in zip(names, short, strict=True):
        lines.append(
            label.ljust(16)
            + " ".join(("yes" if name in table[(t, p)] else "-").ljust(8) for t, _, p in TARGETS)
        )
    lines.append(
        "(pre = prefill, dec = decode, gat = gateway; 8000 engine HTTP+/metrics, 5600 "
        "NIXL handshake, 5601-5664 UCX TCP, 8080 sidecar / gateway)"
    )
    return "\n".join(lines)


def rendered_policies(spec=SPEC):
    out = []
    for pool in ("demo", "other"):
        kids = build_children(PoolRef(pool, "llm", f"uid-{pool}"), parse_pool_spec(pool, spec))
        out += [m for m in kids if m["kind"] == "NetworkPolicy"]
    return out


# --- tests ---------------------------------------------------------------------------------------


def test_reachability_matrix_is_the_intended_one():
    table = reachability(rendered_policies())
    print(
        "\nreachability (default policies; rows: source pod, columns: target:port)\n"
        + format_table(table)
    )
    for key, who in INTENDED.items():
        assert table[key] == who, (key, sorted(table[key] ^ who))


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


def test_clients_and_scrapers_are_configurable_and_policies_can_be_off():
    spec = dict(
        SPEC,
        networkPolicy={
            "clientsFrom": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "team-b"}}}
            ],
            "metricsFrom": [
                {
                    "namespaceSelector": {},
                    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
                }
            ],
        },
    )
    table = reachability(rendered_policies(spec))
    assert table[("demo-gateway", 8080)] == {"pod in team-b", "prometheus"}
    assert table[("demo-decode", 8000)] == ENGINES | {"prometheus"}
    off = build_children(
        PoolRef("demo", "llm", "u"),
        parse_pool_spec("demo", dict(SPEC, networkPolicy={"enabled": False})),
    )
    assert not [m for m in off if m["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize(
    "source", ["web (same ns)", "pod in team-b", "other-decode", "external client", "demo-gateway"]
)
def test_nobody_outside_the_pool_reaches_engine_or_kv_ports(source):
    table = reachability(rendered_policies())
    for (target, port), who in table.items():
        if target != "demo-gateway" and port != 8080:
            assert source not in who, (target, port)


def test_policies_are_applied_before_any_pod_can_exist():
    kinds = [
        m["kind"]
        for m in build_children(PoolRef("demo", "llm", "u"), parse_pool_spec("demo", SPEC))
    ]
    first_deployment = kinds.index("Deployment")
    assert all(kinds.index(k) < first_deployment for k in ("NetworkPolicy", "PodDisruptionBudget"))
