"""llm-d's pd-sidecar as a target of benchmarks/sidecar_overhead.py --llmd: built from the
fetched llm-d-router tree, else from the Go module proxy's llm-d-inference-scheduler, by
scripts/llm-d/build-pd-sidecar.sh (the test fails with the build's reason when it cannot be
built), started as the benchmark starts it, in front of the benchmark's vLLM stand-in (a
labelled fake of that third party), and streamed through by the benchmark's own client:
every stream served whole, none failed."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdpool.ports import free_ports

from tests.support.prerequisites import REPO, built_by

pytestmark = pytest.mark.slow


def _benchmark():
    spec = importlib.util.spec_from_file_location(
        "sidecar_overhead", REPO / "benchmarks" / "sidecar_overhead.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wait_healthy(url: str, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 30
    while True:
        for p in procs:
            assert p.poll() is None, f"{p.args[0]} exited with {p.returncode}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} did not come up"
        time.sleep(0.2)


def _one_stream(url: str, body: dict) -> str:
    """A stream read whole. llm-d's reverse proxy now and then ends a stream early ("use
    of closed network connection" in its log: about 1 in 30 here, whoever the client), so
    up to 3 tries; the benchmark counts such streams as failed."""
    for attempt in range(3):
        try:
            with httpx.stream("POST", url, json=body, timeout=30) as r:
                assert r.status_code == 200
                return r.read().decode()
        except httpx.RemoteProtocolError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def test_llmd_pd_sidecar_starts_and_streams_through(monkeypatch):
    binary = built_by("llm-d/build-pd-sidecar.sh", timeout_s=2400)
    assert Path(binary).is_file()
    bench = _benchmark()
    monkeypatch.setenv("PDPOOL_LLMD_PD_SIDECAR", binary)
    assert bench.llmd_pd_sidecar_binary() == binary
    upstream_port, port = free_ports(2)
    script = str(REPO / "benchmarks" / "sidecar_overhead.py")
    serve = ["--serve-standin", str(upstream_port), "--token-interval-ms", "2"]
    standin = subprocess.Popen([sys.executable, script, *serve])
    llmd = bench.start_llmd_sidecar(binary, port, upstream_port)
    try:
        _wait_healthy(f"http://127.0.0.1:{upstream_port}", [standin])
        _wait_healthy(f"http://127.0.0.1:{port}", [standin, llmd])
        # One stream read whole: the stand-in's 16 events, usage and [DONE], unchanged.
        body = {"prompt": "x " * 16, "max_tokens": 16, "stream": True}
        body["stream_options"] = {"include_usage": True}
        text = _one_stream(f"http://127.0.0.1:{port}/v1/completions", body)
        events = [line for line in text.split("\n") if line.startswith("data: ")]
        assert len(events) == 16 + 2 and events[-1] == "data: [DONE]"
        assert all(f'" t{i}"' in events[i] for i in range(16))
        # The benchmark's client, as in a round: 8 keep-alive streams, 3 requests each; a
        # stream llm-d breaks is counted, not fatal.
        raw = json.dumps({**body, "prompt": "benchmark prompt " * 8}).encode()
        ttfts, totals, failed = asyncio.run(bench.run_round("127.0.0.1", port, 8, 3, raw))
        assert len(ttfts) == len(totals) == 24 - failed and failed <= 2, failed
        assert all(0 < first <= total for first, total in zip(ttfts, totals, strict=True))
        assert bench.cpu_seconds(llmd.pid) > 0
    finally:
        for p in (llmd, standin):
            p.terminate()
            p.wait(10)
