"""The rendered pod commands parse with the real `pdpool` CLI of the other parts.

The kubelet expands `$(VAR)` from the container's env before exec; this test does the
same (downward API and ConfigMap values filled in) and feeds the result to
`pdpool.cli.build_parser()`: a renamed or removed flag fails here, not in a cluster.
"""

import re

import pytest

from pdpool.cli import build_parser
from pdpool.operator.builders import build_children
from pdpool.operator.children import PoolRef
from pdpool.operator.spec import parse_pool_spec

REF = PoolRef("demo", "llm", "uid")
POD_IP = "10.1.2.3"


def expand(argv, env):
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in argv]


def container_env(container, config):
    env = {"POD_IP": POD_IP, "POD_NAME": "demo-decode-abc"}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand([item["value"]], env)[0]
        elif "configMapKeyRef" in item.get("valueFrom", {}):
            env[item["name"]] = config[item["valueFrom"]["configMapKeyRef"]["key"]]
    return env


def rendered(spec):
    kids = build_children(REF, parse_pool_spec("demo", spec))
    config = next(m for m in kids if m["kind"] == "ConfigMap")["data"]
    out = {}
    for dep in (m for m in kids if m["kind"] == "Deployment"):
        for c in dep["spec"]["template"]["spec"]["containers"]:
            out[(dep["metadata"]["name"], c["name"])] = expand(
                c["command"], container_env(c, config)
            )
    return out


def parse(argv):
    assert argv[0] == "pdpool"
    args = build_parser().parse_args(argv[1:])
    assert args._module is not None, f"pdpool {argv[1]} is not available"
    return args


@pytest.mark.parametrize("mode", ["decode-first", "prefill-first", "aggregated"])
def test_every_pdpool_command_parses_with_the_real_cli(mode):
    spec = {
        "model": {"path": "/models/q"},
        "engine": {"image": "e", "blockSize": 32},
        "router": {
            "mode": mode,
            "cacheHitThreshold": 0.25,
            "kvPullThreshold": 64,
            "prefillTimeoutSeconds": 12.5,
        },
    }
    commands = rendered(spec)
    prefill = parse(commands[("demo-prefill", "engine")])
    assert (prefill.kv_host, prefill.kv_role, prefill.kv_connector) == (POD_IP, "producer", "nixl")
    assert prefill.block_size == 32 and prefill.host == "0.0.0.0"
    decode = parse(commands[("demo-decode", "engine")])
    assert decode.kv_role == "consumer" and decode.kv_host == POD_IP
    sidecar = parse(commands[("demo-decode", "sidecar")])
    assert sidecar.mode == mode and sidecar.cache_hit_threshold == 0.25
    assert sidecar.kv_pull_threshold == 64 and sidecar.prefill_timeout == 12.5
    assert sidecar.prefill_service == "demo-prefill.llm.svc:8000"
    assert sidecar.decode_url == "http://127.0.0.1:8000"
    gateway = parse(commands[("demo-gateway", "gateway")])
    assert gateway.decode_service == "demo-decode.llm.svc:8080" and gateway.port == 8080
