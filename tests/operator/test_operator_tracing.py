"""The operator passes a pool's OTLP endpoint to every server it runs (engines, stock vLLM
too, decode sidecars, the gateway): spec.tracing, else the operator's default from the
chart (PDPOOL_OTLP_TRACES_ENDPOINT). Rendered by the real builders, no cluster."""

from __future__ import annotations

from typing import Any

import pytest

from devtools.operator_kube import pool_manifest
from pdpool.operator.builders import build_children
from pdpool.operator.children import PoolRef
from pdpool.operator.commands import TRACES_ENDPOINT_ENV
from pdpool.operator.spec import parse_pool_spec

REF = PoolRef("qwen", "default", "uid-1")


def server_commands(spec: dict[str, Any]) -> dict[str, list[str]]:
    """container name -> command of every long-running container the pool's workloads run."""
    pool = parse_pool_spec("qwen", spec)
    out = {}
    for child in build_children(REF, pool):
        if child["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in child["spec"]["template"]["spec"]["containers"]:
            out[f"{child['metadata']['name']}/{c['name']}"] = c["command"]
    return out


def endpoint_of(command: list[str]) -> str | None:
    flag = "--otlp-traces-endpoint"
    return command[command.index(flag) + 1] if flag in command else None


@pytest.mark.parametrize("engine_kind", ["pdpool", "vllm"])
def test_spec_tracing_reaches_every_server(monkeypatch, engine_kind):
    monkeypatch.setenv(TRACES_ENDPOINT_ENV, "http://default:4317")
    spec = pool_manifest(
        "qwen",
        engine={"image": "engine:test", "kind": engine_kind},
        tracing={"otlpTracesEndpoint": "http://collector:4317"},
    )["spec"]
    commands = server_commands(spec)
    assert {name.split("/")[1] for name in commands} >= {"engine", "sidecar", "gateway"}
    assert {name: endpoint_of(c) for name, c in commands.items()} == dict.fromkeys(
        commands, "http://collector:4317"
    )


def test_the_operator_default_applies_and_no_endpoint_means_no_flag(monkeypatch):
    spec = pool_manifest("qwen")["spec"]
    monkeypatch.delenv(TRACES_ENDPOINT_ENV, raising=False)
    assert all(endpoint_of(c) is None for c in server_commands(spec).values())
    monkeypatch.setenv(TRACES_ENDPOINT_ENV, "http://default:4317")
    assert {endpoint_of(c) for c in server_commands(spec).values()} == {"http://default:4317"}
