"""Helpers for end-to-end tests on real `pdpool serve` processes started by Topology."""

from __future__ import annotations

import re
import shutil
import time

import httpx
import pytest

from pdpool.up.topology import SIDE_BY_SIDE, Topology, TopologySpec, ensure_tiny_model


def engine_available() -> bool:
    try:
        import pdpool.engine.serve_cli  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def start_topology(
    tmp_path_factory, arch: str = "qwen3", extra_engine_args: tuple[str, ...] = (), **spec
) -> Topology:
    if not engine_available():
        pytest.skip("pdpool engine (torch) is not installed")
    try:
        model = ensure_tiny_model(arch)
    except RuntimeError as exc:
        if "ModuleNotFoundError" in str(exc):  # the engine does not support this arch yet
            pytest.skip(f"engine cannot build a tiny {arch} model yet: {str(exc)[-120:]}")
        raise
    log_dir = str(tmp_path_factory.mktemp(f"up-{arch}"))
    # Small KV pools keep start-up and memory low on a 2-core CI machine.
    engine_args = ["--max-model-len", "2048", "--num-kv-blocks", "512", *extra_engine_args]
    topo = Topology(
        TopologySpec(
            model=model, log_dir=log_dir, engine_args=engine_args, **{**SIDE_BY_SIDE, **spec}
        )
    )
    topo.start(timeout_s=240)
    return topo


def metric(url: str, name: str, labels: str = "") -> float:
    """Sum of a Prometheus sample (optionally filtered by a label substring)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if m and m.group(1) == name and labels in (m.group(2) or ""):
            total += float(m.group(3))
    return total


def blocks_known(routers, name: str) -> dict[tuple[int, str], float]:
    """{(router's port, engine): blocks its KV index knows the engine holds}, from each
    router's gauge `name` (pdpool_gateway_kv_blocks, pdpool_sidecar_prefill_kv_blocks)."""
    out = {}
    for r in routers:
        text = httpx.get(r.url + "/metrics", timeout=5).text
        for m in re.finditer(rf'^{name}{{\w+="([^"]+)"}} (\S+)$', text, re.M):
            out[(r.port, m.group(1))] = float(m.group(2))
    return out


def settled_blocks(routers, name: str, quiet_s: float = 0.5, timeout_s: float = 15) -> dict:
    """`blocks_known` once it has not changed for `quiet_s`: the events of earlier requests
    indexed, so that they cannot pass for the ones a test waits for next."""
    deadline = time.monotonic() + timeout_s
    last, since = blocks_known(routers, name), time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.1)
        now = blocks_known(routers, name)
        if now != last:
            last, since = now, time.monotonic()
    return last


def log_warnings(children, last: int = 10) -> dict[str, list[str]]:
    """The last WARNING and ERROR lines of each child's log: what a failed assertion about
    routing should show."""
    out = {}
    for c in children:
        try:
            with open(c.log_path, errors="replace") as fh:
                lines = [ln.rstrip() for ln in fh if "WARNING" in ln or "ERROR" in ln]
        except OSError:
            lines = []
        out[c.name] = lines[-last:]
    return out


def await_indexed(routers, name: str, before: dict, grown: dict, timeout_s: float = 30) -> None:
    """Until each (router's port, engine) of `grown` knows at least that many more blocks
    than `before` (`blocks_known`): events travel and are indexed asynchronously, slower
    on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = blocks_known(routers, name)
        short = {k: n for k, n in grown.items() if now.get(k, 0) < before.get(k, 0) + n}
        if not short:
            return
        assert time.monotonic() < deadline, f"events not indexed: {short} of {now}"
        time.sleep(0.1)


def model_name(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]


def cleanup(topo: Topology, keep_logs: bool = False) -> None:
    topo.stop()
    if not keep_logs:
        shutil.rmtree(topo.log_dir, ignore_errors=True)
