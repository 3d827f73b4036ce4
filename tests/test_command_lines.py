"""One renderer for a pool's command lines (pdpool/command_lines.py): what the operator puts in
its containers and what `pdpool up` starts are parsed here by the real `pdpool` CLI and
agree on every setting both express; the endpoint picker takes the gateway's routing flags."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from pdpool.cli import build_parser
from pdpool.command_lines import (
    EngineLaunch,
    KVEventsPublisher,
    RouterLaunch,
    Serving,
    epp_argv,
    gateway_argv,
)
from pdpool.operator.builders import build_children
from pdpool.operator.children import PoolRef
from pdpool.operator.commands import ROUTER_ENV
from pdpool.operator.spec import parse_pool_spec
from pdpool.up.topology import SIDE_BY_SIDE, Topology, TopologySpec

REF = PoolRef(name="demo", namespace="llm", uid="uid-123")
POOL = {
    "model": {"path": "/models/qwen3"},
    "engine": {"image": "engine:1"},
    "router": {"image": "r:1", "kvEvents": {"enabled": True}},
    "gateway": {"tenantsSecret": {"name": "llm-tenants"}},
    "tracing": {"otlpTracesEndpoint": "http://collector:4317"},
}


def parse(argv: list[str], env: dict[str, str] | None = None) -> argparse.Namespace:
    """The argv as the `pdpool` CLI reads it (after the program), with `$(VAR)` expanded as
    the kubelet would (POD_IP, and `env`)."""
    at = next(i for i, a in enumerate(argv) if a in ("serve", "sidecar", "gateway", "epp"))
    concrete = _expand(argv[at:], {"POD_IP": "10.1.2.3", **(env or {})})
    assert not [a for a in concrete if "$(" in a], concrete
    return build_parser().parse_args(concrete)


def operator_commands() -> dict[str, list[str]]:
    """Each container's command, its `$(VAR)`s expanded from the router ConfigMap."""
    children = build_children(REF, parse_pool_spec(REF.name, POOL))
    config = next(m["data"] for m in children if m["kind"] == "ConfigMap" and "mode" in m["data"])
    env = {var: config[key] for key, var in ROUTER_ENV.items()}
    out = {}
    for m in children:
        if m["kind"] != "Deployment":
            continue
        for c in m["spec"]["template"]["spec"]["containers"]:
            if any(a in c["command"] for a in ("serve", "sidecar", "gateway", "epp")):
                out[f"{m['metadata']['name']}/{c['name']}"] = _expand(c["command"], env)
    return out


def _expand(argv: list[str], env: dict[str, str]) -> list[str]:
    for var, value in env.items():
        argv = [a.replace(f"$({var})", value) for a in argv]
    return argv


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> Topology:
    tenants = tmp_path_factory.mktemp("t") / "tenants.yaml"
    tenants.write_text("tenants: [{name: a, keys: [k]}]\n")
    spec = TopologySpec(
        model=str(tmp_path_factory.mktemp("model")),
        kv_events=True,
        kv_connector="nixl",
        tenants_file=str(tenants),
        otlp_traces_endpoint="http://collector:4317",
        log_dir=str(tmp_path_factory.mktemp("logs")),
        **SIDE_BY_SIDE,
    )
    return Topology(spec)  # planned, never started


def local_commands(topology: Topology) -> dict[str, list[str]]:
    return {c.name: c.argv for c in topology.children}


def test_every_command_line_parses_with_the_real_cli(local):
    commands = {**operator_commands(), **local_commands(local)}
    expected = {"demo-decode/engine", "demo-decode/sidecar", "demo-gateway/gateway"}
    assert expected <= set(commands)
    for argv in commands.values():
        parse(argv)  # argparse exits on a flag it does not know
    assert len(local_commands(local)) == 4  # prefill, decode, sidecar, gateway


def test_the_operator_and_pdpool_up_agree_on_shared_engine_settings(local):
    ours = operator_commands()
    theirs = local_commands(local)
    for role in ("prefill", "decode"):
        pod = parse(ours[f"demo-{role}/engine"])
        proc = parse(theirs[f"{role}-0"])
        for setting in ("scheduling_policy", "otlp_traces_endpoint", "kv_connector"):
            assert getattr(pod, setting) == getattr(proc, setting), (role, setting)
        assert pod.scheduling_policy == "priority"  # a pool with tenants
        pod_events, proc_events = (json.loads(a.kv_events_config) for a in (pod, proc))
        # the same publisher either way, only the address differs (pod IP / loopback)
        assert {k: v for k, v in pod_events.items() if "endpoint" not in k} == {
            k: v for k, v in proc_events.items() if "endpoint" not in k
        }
        assert pod_events["token_ids"] is False and pod_events["bind"] is True


def test_the_operator_and_pdpool_up_agree_on_the_routers(local):
    ours, theirs = operator_commands(), local_commands(local)
    pod_gw, proc_gw = parse(ours["demo-gateway/gateway"]), parse(theirs["gateway-0"])
    for setting in ("otlp_traces_endpoint", "kv_block_size"):
        assert getattr(pod_gw, setting) == getattr(proc_gw, setting), setting
    assert pod_gw.tenants_file and proc_gw.tenants_file
    pod_sc, proc_sc = parse(ours["demo-decode/sidecar"]), parse(theirs["sidecar-0"])
    assert pod_sc.otlp_traces_endpoint == proc_sc.otlp_traces_endpoint
    assert pod_sc.kv_block_size == proc_sc.kv_block_size == 16


def test_the_picker_takes_the_gateway_s_routing_flags():
    gateway = RouterLaunch(
        Serving(("pdpool",), "127.0.0.1", 8080, 9090, otlp_traces_endpoint="http://c:4317"),
        decode_urls=["a:1", "b:2"],
        kv_events=["a:1=tcp://a:5|tcp://a:6"],
        kv_block_size=16,
        kv_threshold="0.5",
        tenants_file="/t.yaml",
    )
    picker = replace(gateway, serving=replace(gateway.serving, port=9100, metrics_port=9102))
    gw, epp = parse(gateway_argv(gateway)), parse(epp_argv(picker, health_port=9101))
    assert (epp.port, epp.health_port, epp.metrics_port) == (9100, 9101, 9102)
    shared = set(vars(gw)) & set(vars(epp)) - {
        "command",
        "port",
        "metrics_port",
        "_module",
        "otlp_service_name",
    }
    assert {"decode_urls", "kv_events", "tenants_file", "otlp_traces_endpoint"} <= shared
    for setting in shared:
        assert getattr(gw, setting) == getattr(epp, setting), setting


def test_extra_engine_args_come_last_so_they_win():
    from pdpool.command_lines import pdpool_engine_argv

    launch = EngineLaunch(
        Serving(("pdpool",), "0.0.0.0", 8000),
        "/m",
        block_size=16,
        priority_scheduling=True,
        kv_events=KVEventsPublisher("10.0.0.1", 5557, 5558),
        extra_args=("--block-size", "32", "--scheduling-policy", "fcfs"),
    )
    args = parse(pdpool_engine_argv(launch))
    assert (args.block_size, args.scheduling_policy) == (32, "fcfs")
