"""A pool with a tenants file runs its engines with --scheduling-policy priority (so the band
the front-ends write reaches the engines' queues), the same rule in the operator and in
`pdpool up` (pdpool/command_lines.py renders both); without tenants, vLLM's default fcfs. Commands
are parsed by the real `pdpool serve` CLI; extra args still win."""

from __future__ import annotations

import pytest

from pdpool.cli import build_parser
from pdpool.operator.builders import build_children
from pdpool.operator.children import PoolRef
from pdpool.operator.spec import parse_pool_spec
from pdpool.up.topology import SIDE_BY_SIDE, Topology, TopologySpec

REF = PoolRef(name="demo", namespace="llm", uid="uid-123")
BASE = {"model": {"path": "/models/qwen3"}, "router": {"image": "r:1"}}
TENANTS = {"gateway": {"tenantsSecret": {"name": "llm-tenants"}}}


def engine_commands(spec) -> list[list[str]]:
    out = []
    for m in build_children(REF, parse_pool_spec(REF.name, spec)):
        if m["kind"] == "Deployment" and m["metadata"]["name"] in ("demo-prefill", "demo-decode"):
            pod = m["spec"]["template"]["spec"]
            out += [c["command"] for c in pod["containers"] if c["name"] == "engine"]
    assert len(out) == 2
    return out


def policy(argv: list[str]) -> str:
    """What the engine runs with: pdpool serve's parser for ours, the last flag for vLLM."""
    if argv[0] == "pdpool":
        argv = [a.replace("$(POD_IP)", "10.1.2.3") for a in argv]
        return build_parser().parse_args(argv[1:]).scheduling_policy
    flags = [argv[i + 1] for i, a in enumerate(argv) if a == "--scheduling-policy"]
    return flags[-1] if flags else "fcfs"


@pytest.mark.parametrize("kind", ["pdpool", "vllm"])
def test_the_operator_runs_priority_scheduling_when_the_pool_has_tenants(kind):
    engine = {"image": "e:1", "kind": kind}
    with_tenants = engine_commands({**BASE, **TENANTS, "engine": engine})
    assert [policy(a) for a in with_tenants] == ["priority", "priority"]
    plain = engine_commands({**BASE, "engine": engine})
    assert [policy(a) for a in plain] == ["fcfs", "fcfs"]
    overridden = {**engine, "extraArgs": ["--scheduling-policy", "fcfs"]}
    assert [policy(a) for a in engine_commands({**BASE, **TENANTS, "engine": overridden})] == [
        "fcfs",
        "fcfs",
    ]


@pytest.mark.parametrize("engine", ["pdpool", "vllm"])
def test_pdpool_up_runs_priority_scheduling_with_a_tenants_file(tmp_path, engine):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants: [{name: a, keys: ['k-0123456789abcdef'], priority: 1}]\n")

    def engines(**spec) -> list[list[str]]:
        topo = Topology(
            TopologySpec(
                model=str(tmp_path),
                engine=engine,
                vllm_bin="vllm",
                prefill=1,
                decode=1,
                **SIDE_BY_SIDE,
                log_dir=str(tmp_path / f"logs-{len(spec)}"),
                kv_connector="none",
                **spec,
            )
        )
        return [c.argv for c in topo.children if c.role in ("prefill", "decode")]

    def policies(argvs: list[list[str]]) -> list[str]:
        out = []
        for argv in argvs:
            if engine == "pdpool":
                i = argv.index("serve")
                out.append(build_parser().parse_args(argv[i:]).scheduling_policy)
            else:
                out.append(policy(argv))
        return out

    assert policies(engines(tenants_file=str(tenants))) == ["priority", "priority"]
    assert policies(engines()) == ["fcfs", "fcfs"]
