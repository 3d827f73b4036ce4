"""`spec.router.kvEvents`: engines publish KV events, the gateway and the sidecars subscribe
through discovery. The spec's checks, the rendered commands and ports (parsed by the real
CLI), and who may reach the event ports (NetworkPolicy semantics: tests/support/netpol.py)."""

import json
import re

import pytest

from pdpool.cli import build_parser
from pdpool.kv_events import KVEventsConfig
from pdpool.operator.builders import build_children
from pdpool.operator.children import PoolRef
from pdpool.operator.spec import SpecError, parse_pool_spec
from pdpool.sidecar.proxy.cli import settings_from_args

from test_operator_netpol import SOURCES, allowed

REF = PoolRef(name="demo", namespace="llm", uid="uid-123")
BASE = {"model": {"path": "/models/qwen3"}, "engine": {"image": "engine:1"}}
ON = {"enabled": True}


def spec_with(kv_events=None, **sections):
    spec = {**BASE, **sections}
    router = dict(spec.get("router") or {})
    if kv_events is not None:
        router["kvEvents"] = kv_events
    return {**spec, "router": router}


def children(spec):
    return {
        (m["kind"], m["metadata"]["name"]): m
        for m in build_children(REF, parse_pool_spec(REF.name, spec))
    }


def container(kids, deployment, name):
    pod = kids[("Deployment", deployment)]["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == name)


def flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def parse(argv, env=None):
    """The argv as the kubelet runs it ($(VAR) expanded), through the real `pdpool` CLI."""
    env = {"POD_IP": "10.1.2.3", **(env or {})}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in argv]
    return build_parser().parse_args(argv[1:])


# --- spec --------------------------------------------------------------------------------


def test_defaults_are_off_with_vllms_usual_ports():
    events = parse_pool_spec("demo", BASE).router.kv_events
    assert (events.enabled, events.port, events.replay_port, events.load_cost_tokens) == (
        False,
        5557,
        5558,
        64.0,
    )
    on = parse_pool_spec(
        "demo", spec_with({"enabled": True, "port": 6000, "replayPort": 6001, "loadCostTokens": 64})
    )
    assert on.router.kv_events.port == 6000 and on.router.kv_events.load_cost_tokens == 64.0


@pytest.mark.parametrize(
    "kv_events, sections, fragment",
    [
        ({"enabled": "yes"}, {}, "spec.router.kvEvents.enabled must be a boolean"),
        ({"enabled": True, "port": 0}, {}, "spec.router.kvEvents.port must be >= 1"),
        ({"enabled": True, "replayPort": 70000}, {}, "spec.router.kvEvents.replayPort must be <="),
        ({"enabled": True, "loadCostTokens": -1}, {}, "loadCostTokens must be a number >= 0"),
        ({"enabled": True, "loadCostTokens": "lots"}, {}, "loadCostTokens must be a number"),
        (
            {"enabled": True, "port": 6000, "replayPort": 6000},
            {},
            "spec.router.kvEvents.port and replayPort must differ, both are 6000",
        ),
        (
            {"enabled": True, "port": 8000},
            {},
            "spec.router.kvEvents.port 8000 is already the engine's HTTP port",
        ),
        (
            {"enabled": True, "replayPort": 8080},
            {},
            "spec.router.kvEvents.replayPort 8080 is already the sidecar's port",
        ),
        (
            {"enabled": True},
            {"engine": {"image": "e", "kvPort": 5557}},
            "spec.router.kvEvents.port 5557 is already spec.engine.kvPort (NIXL)",
        ),
        (
            {"enabled": True, "replayPort": 5610},
            {},
            "spec.router.kvEvents.replayPort 5610 is in UCX's port range 5601-5664",
        ),
        ("on", {}, "spec.router.kvEvents must be an object"),
    ],
)
def test_refused_kv_events_say_why(kv_events, sections, fragment):
    with pytest.raises(SpecError) as err:
        parse_pool_spec("demo", spec_with(kv_events, **sections))
    assert fragment in str(err.value)


def test_port_clashes_only_matter_when_enabled():
    parse_pool_spec("demo", spec_with({"enabled": False, "port": 8000}))
    # UCX off: its range is free for the events.
    parse_pool_spec(
        "demo", spec_with({"enabled": True, "port": 5601}, engine={"image": "e", "ucxPortCount": 0})
    )


# --- builders ----------------------------------------------------------------------------


def test_disabled_renders_exactly_what_a_spec_without_it_renders():
    assert build_children(REF, parse_pool_spec("demo", BASE)) == build_children(
        REF, parse_pool_spec("demo", spec_with({"enabled": False, "port": 6000}))
    )


@pytest.mark.parametrize("kind", ["pdpool", "vllm"])
def test_every_engine_publishes_on_the_pool_ports(kind):
    kids = children(
        spec_with(
            {"enabled": True, "port": 6100, "replayPort": 6101}, engine={"image": "e", "kind": kind}
        )
    )
    for deployment in ("demo-prefill", "demo-decode"):
        engine = container(kids, deployment, "engine")
        config = KVEventsConfig.parse(flag(engine["command"], "--kv-events-config"))
        assert config.active  # what `pdpool serve` and vLLM read
        # The pod IP (the kubelet expands $(POD_IP) from the downward API), never every
        # interface, except stock vLLM's PUB: vLLM connects to any non-wildcard endpoint.
        pub = "tcp://*:6100" if kind == "vllm" else "tcp://$(POD_IP):6100"
        assert (config.endpoint, config.replay_endpoint) == (pub, "tcp://$(POD_IP):6101")
        assert config.bind == (kind != "vllm")
        # The router keys pdpool engines' blocks by their hashes: no token ids on the wire.
        assert config.token_ids == (kind == "vllm")
        env = {e["name"]: e.get("valueFrom") for e in engine["env"]}
        assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        ports = {p["name"]: p["containerPort"] for p in engine["ports"]}
        assert ports["kv-events"] == 6100 and ports["kv-replay"] == 6101
    assert container(kids, "demo-prefill", "engine")["command"][0] == (
        "vllm" if kind == "vllm" else "pdpool"
    )


def test_pdpool_engine_parses_the_rendered_config():
    kids = children(spec_with(ON))
    args = parse(container(kids, "demo-decode", "engine")["command"])
    config = json.loads(args.kv_events_config)
    assert config["endpoint"] == "tcp://10.1.2.3:5557" and config["bind"] is True  # the pod IP


def test_sidecar_and_gateway_subscribe_through_discovery():
    kids = children(
        spec_with({"enabled": True, "loadCostTokens": 64}, router={"cacheHitThreshold": 0.6})
    )
    sidecar = container(kids, "demo-decode", "sidecar")
    config = kids[("ConfigMap", "demo-router")]["data"]
    env = {
        "PDPOOL_ROUTER_MODE": config["mode"],
        "PDPOOL_CACHE_HIT_THRESHOLD": config["cacheHitThreshold"],
        "PDPOOL_KV_PULL_THRESHOLD": config["kvPullThreshold"],
        "PDPOOL_PREFILL_TIMEOUT": config["prefillTimeoutSeconds"],
        "PDPOOL_PREFILL_SERVICE": config["prefillService"],
        "PDPOOL_ENGINE_REJECTS": config["engineRejects"],
    }
    settings = settings_from_args(parse(sidecar["command"], env))
    assert settings.prefill_service == "demo-prefill.llm.svc:8000"
    assert (settings.prefill_kv_events_port, settings.prefill_kv_events_replay_port) == (5557, 5558)
    assert settings.kv_block_size == 16
    gateway = parse(container(kids, "demo-gateway", "gateway")["command"])
    assert gateway.decode_service == "demo-decode.llm.svc:8080"
    assert (gateway.kv_events_port, gateway.kv_events_replay_port) == (5557, 5558)
    assert (gateway.kv_block_size, gateway.kv_threshold, gateway.kv_load_cost) == (16, 0.6, 64)


def test_block_size_is_what_each_roles_engines_run_with():
    spec = spec_with(
        ON,
        engine={"image": "e", "kind": "vllm", "blockSize": 32},
        prefill={"extraArgs": ["--block-size=64"]},
    )
    kids = children(spec)
    sidecar = container(kids, "demo-decode", "sidecar")["command"]
    gateway = container(kids, "demo-gateway", "gateway")["command"]
    assert flag(sidecar, "--kv-block-size") == "64"  # the prefill engines'
    assert flag(gateway, "--kv-block-size") == "32"  # the decode engines'


def test_tls_pools_keep_their_tls_flags_and_subscribe_too():
    kids = children(spec_with(ON, tls={"secretName": "pool-tls"}))
    sidecar = container(kids, "demo-decode", "sidecar")["command"]
    assert flag(sidecar, "--decode-url") == "https://127.0.0.1:8000"
    assert flag(sidecar, "--prefill-kv-events-port") == "5557"
    gateway = container(kids, "demo-gateway", "gateway")["command"]
    assert "--tls-ca-file" in gateway and flag(gateway, "--kv-events-port") == "5557"


# --- network policies --------------------------------------------------------------------


def test_event_ports_open_to_the_subscribers_only():
    policies = [
        m
        for pool in ("demo", "other")
        for m in build_children(
            PoolRef(pool, "llm", f"uid-{pool}"), parse_pool_spec(pool, spec_with(ON))
        )
        if m["kind"] == "NetworkPolicy"
    ]
    pods = {s.name: s for s in SOURCES}

    def who(target, port):
        return {s.name for s in SOURCES if allowed(policies, s, pods[target], port)}

    for port in (5557, 5558):
        assert who("demo-decode", port) == {"demo-gateway"}
        assert who("demo-prefill", port) == {"demo-decode"}
        assert who("demo-gateway", port) == set()
    # Nothing else opened: the gateway still reaches no engine port, decode pods no
    # other decode pod's events.
    assert "demo-gateway" not in who("demo-decode", 8000) | who("demo-prefill", 5557)
    assert who("demo-decode", 5600) == {"demo-prefill", "demo-decode"}
    names = {m["metadata"]["name"] for m in policies if m["metadata"]["name"].startswith("demo")}
    assert names == {
        "demo-engines",
        "demo-decode-sidecar",
        "demo-gateway",
        "demo-prefill-kv-events",
    }
