"""The pods a pool spec renders, and what the real CLIs make of their command lines: shared
by the operator tests of spec sections that add engine flags and volumes (kvOffload,
loras)."""

from __future__ import annotations

import re
from typing import Any

from pdpool.cli import build_parser
from pdpool.operator.builders import build_children
from pdpool.operator.children import PoolRef
from pdpool.operator.spec import parse_pool_spec

REF = PoolRef(name="demo", namespace="llm", uid="uid-123")
BASE = {"model": {"path": "/models/qwen3"}, "engine": {"image": "engine:1"}}
# What the kubelet substitutes for $(VAR) in a rendered command line.
POD_ENV = {"POD_IP": "10.1.2.3"}


def engine_pods(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Deployment name -> pod spec, for every Deployment running an engine (prefill,
    decode)."""
    out = {}
    for m in build_children(REF, parse_pool_spec(REF.name, spec)):
        if m["kind"] == "Deployment" and "engine" in [
            c["name"] for c in m["spec"]["template"]["spec"]["containers"]
        ]:
            out[m["metadata"]["name"]] = m["spec"]["template"]["spec"]
    return out


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod["containers"] if c["name"] == name)


def parsed_args(command: list[str], env: dict[str, str] | None = None) -> Any:
    """The `pdpool ...` command line as the real CLI parses it ($(VAR) expanded)."""
    env = {**POD_ENV, **(env or {})}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in command]
    return build_parser().parse_args(argv[1:])


def sidecar_args(spec: dict[str, Any]) -> Any:
    """The decode pod's sidecar command line as `pdpool sidecar` parses it, with the
    router ConfigMap's values where the kubelet puts them."""
    from pdpool.operator.commands import ROUTER_ENV
    from pdpool.operator.names import router_config_name

    children = build_children(REF, parse_pool_spec(REF.name, spec))
    config = next(
        m
        for m in children
        if m["kind"] == "ConfigMap" and m["metadata"]["name"] == router_config_name(REF.name)
    )
    env = {var: str(config["data"][key]) for key, var in ROUTER_ENV.items()}
    decode = engine_pods(spec)[f"{REF.name}-decode"]
    return parsed_args(container(decode, "sidecar")["command"], env)


def engine_config(pod: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(the engine config `pdpool serve` builds from the pod's command line, the engine
    container)."""
    from pdpool.engine.serve_cli import config_from_args

    engine = container(pod, "engine")
    return config_from_args(parsed_args(engine["command"])), engine
