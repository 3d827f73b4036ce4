"""`pdpool sidecar --workers`: several processes on one port (sidecar/net/workers.py).

Fast: the worker count, the port binding (a held port is refused, never shared), the
metrics merge, the shared capability. Slow: a real `pdpool sidecar --workers 2` in front of
the vLLM stand-in (tests/support/vllm_standin.py, a labelled fake of that third party):
both workers serve, /metrics counts every request once on either port, the engine gets
one capability probe, the workers listen on no other TCP port, and the workers stop with
their parent (terminated, killed) or all together when one dies."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdpool.cli import build_parser
from pdpool.errors import CliError
from pdpool.ports import free_ports
from pdpool.sidecar.net.metrics import KVBlocksCollector, SidecarMetrics
from pdpool.sidecar.net.metrics_merge import merge_expositions
from pdpool.sidecar.net.workers import MAX_AUTO_WORKERS, bind_shared, parse_workers
from pdpool.sidecar.proxy import cli as sidecar_cli
from pdpool.sidecar.proxy.capability import EngineCapability
from pdpool.sidecar.proxy.capability_share import CapabilityShare

from tests.support.vllm_standin import VllmStandIn

CLI = [sys.executable, "-c", "import sys; from pdpool.cli import main; sys.exit(main())"]


# ----------------------------------------------------------------------------- fast
def test_worker_count_auto_and_refusals():
    assert 1 <= parse_workers("auto") <= MAX_AUTO_WORKERS
    assert parse_workers("3") == 3
    for bad in ("0", "65", "-1", "two", ""):
        with pytest.raises(CliError, match="--workers"):
            parse_workers(bad)


def test_cli_refuses_a_bad_worker_count_with_one_line():
    args = build_parser().parse_args(
        ["sidecar", "--decode-url", "http://127.0.0.1:1", "--workers", "0"]
    )
    with pytest.raises(CliError, match="between 1 and 64"):
        sidecar_cli.main(args)


def test_a_held_port_is_refused_not_shared():
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    try:
        with pytest.raises(CliError, match="cannot listen"):
            bind_shared("127.0.0.1", port, 2)
    finally:
        held.close()
    # Another group of shared sockets (a second sidecar by mistake) is refused alike.
    group = bind_shared("127.0.0.1", 0, 2)
    port = group[0].getsockname()[1]
    for sock in group:
        sock.listen()
    try:
        with pytest.raises(CliError, match="cannot listen"):
            bind_shared("127.0.0.1", port, 2)
    finally:
        for sock in group:
            sock.close()


def test_bind_shared_puts_every_socket_on_one_port():
    group = bind_shared("127.0.0.1", 0, 3)
    try:
        assert len({s.getsockname()[1] for s in group}) == 1
    finally:
        for sock in group:
            sock.close()


def _samples(text: bytes) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_merge_adds_counts_and_keeps_shared_gauges():
    a, b = SidecarMetrics(), SidecarMetrics()
    a.requests_by("decode-first", "decode").inc(3)
    b.requests_by("decode-first", "decode").inc(4)
    b.requests_by("decode-first", "pd").inc()
    a.ttft_by("decode").observe(0.003)
    b.ttft_by("decode").observe(0.2)
    a.in_flight.inc(2)
    b.in_flight.inc(5)
    a.engine_rejects.set(-1)  # worker still reading the shared answer
    b.engine_rejects.set(0)
    a.prefill_ejected.labels("10.0.0.1:8000").set(1)
    b.prefill_ejected.labels("10.0.0.1:8000").set(0)
    merged = _samples(merge_expositions([a.render().decode(), b.render().decode()]))
    decode = (("mode", "decode-first"), ("path", "decode"))
    assert merged[("pdpool_sidecar_requests_total", decode)] == 7
    pd = (("mode", "decode-first"), ("path", "pd"))
    assert merged[("pdpool_sidecar_requests_total", pd)] == 1
    assert merged[("pdpool_sidecar_in_flight", ())] == 7
    assert merged[("pdpool_sidecar_engine_rejects", ())] == 0
    assert merged[("pdpool_sidecar_prefill_ejected", (("endpoint", "10.0.0.1:8000"),))] == 1
    assert merged[("pdpool_sidecar_ttft_seconds_count", (("path", "decode"),))] == 2
    le_5ms = (("le", "0.005"), ("path", "decode"))
    assert merged[("pdpool_sidecar_ttft_seconds_bucket", le_5ms)] == 1
    assert merged[("pdpool_sidecar_ttft_seconds_sum", (("path", "decode"),))] == pytest.approx(
        0.203
    )
    created = ("pdpool_sidecar_requests_created", decode)
    assert merged[created] == min(_samples(a.render())[created], _samples(b.render())[created])
    # One worker's exposition merges to itself.
    assert merge_expositions([a.render().decode()]) == a.render()


def test_metrics_merge_reads_an_engine_one_worker_does_not_know_as_zero_blocks():
    """The KV blocks gauge is what every worker knows: an engine missing from one worker's
    index (not subscribed, or not trusted after lost events) must not show the others'
    count, or a reader waiting for the blocks would go on while that worker routes blind."""

    def worker(counts: dict[str, int]) -> str:
        registry = CollectorRegistry()
        registry.register(
            KVBlocksCollector(
                "pdpool_sidecar_prefill_kv_blocks", "blocks", "endpoint", lambda: counts
            )
        )
        return generate_latest(registry).decode()

    merged = _samples(
        merge_expositions(
            [worker({"p0": 12, "p1": 30}), worker({"p1": 18}), worker({"p0": 7, "p1": 25})]
        )
    )
    assert merged[("pdpool_sidecar_prefill_kv_blocks", (("endpoint", "p0"),))] == 0
    assert merged[("pdpool_sidecar_prefill_kv_blocks", (("endpoint", "p1"),))] == 18
    both = _samples(merge_expositions([worker({"p0": 12}), worker({"p0": 7})]))
    assert both[("pdpool_sidecar_prefill_kv_blocks", (("endpoint", "p0"),))] == 7


async def test_capability_is_probed_by_one_worker_and_read_by_the_others(tmp_path):
    path = str(tmp_path / "engine-capability")
    probes = []

    async def probe(capability: EngineCapability) -> None:
        probes.append(1)
        capability.learn(False)

    follower = EngineCapability("auto")
    follower_probe = probe(follower)
    following = asyncio.create_task(
        CapabilityShare(path, prober=False).learn(follower, follower_probe)
    )
    await asyncio.sleep(0.3)
    assert follower.known is None and not following.done()  # waits for worker 0
    prober = EngineCapability("auto")
    await CapabilityShare(path, prober=True).learn(prober, probe(prober))
    await asyncio.wait_for(following, 5)
    assert prober.known is False and follower.known is False
    assert probes == [1]  # the follower's probe never ran


# ----------------------------------------------------------------------------- slow
def _start(decode_url: str, port: int, metrics_port: int, workers: int = 2) -> subprocess.Popen:
    return subprocess.Popen(
        [
            *CLI,
            "sidecar",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--decode-url",
            decode_url,
            "--engine-rejects",
            "auto",
            "--workers",
            str(workers),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )


async def _until_healthy(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 60
    async with httpx.AsyncClient() as c:
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                if (await c.get(url + "/health", timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the sidecar did not come up"
            await asyncio.sleep(0.2)


def _workers(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children()


def _counted(text: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "pdpool_sidecar_requests_total"
    )


async def _own_metrics(path: str) -> str:
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        return (await reader.read()).decode()
    finally:
        writer.close()


def _gone(pids: list[int], timeout_s: float = 15) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.slow
async def test_workers_serve_one_port_and_count_each_request_once(servers):
    engine = VllmStandIn("decode-0")
    decode = await servers(engine)
    port, metrics_port = free_ports(2)
    proc = _start(decode.url, port, metrics_port)
    url = f"http://127.0.0.1:{port}"
    try:
        await _until_healthy(proc, url)
        workers = _workers(proc)
        assert len(workers) == 2
        n = 40
        for i in range(n):  # a new connection each: the kernel spreads them over the workers
            async with httpx.AsyncClient() as c:
                body = {
                    "model": "standin",
                    "prompt": f"w{i} w2",
                    "max_tokens": 2,
                    "stream": i % 2 == 1,
                }
                r = await c.post(url + "/v1/completions", json=body, timeout=30)
                assert r.status_code == 200, r.text
        async with httpx.AsyncClient() as c:
            for where in (url, f"http://127.0.0.1:{metrics_port}"):
                scrape = await c.get(where + "/metrics")
                assert scrape.status_code == 200
                assert _counted(scrape.text) == n, where  # every request once, summed
            # The metrics port still serves nothing else, on every worker.
            for _ in range(6):
                r = await c.post(f"http://127.0.0.1:{metrics_port}/v1/completions", json={})
                assert r.status_code == 404
        # Each worker served a share (its own metrics, over its private Unix socket).
        own = []
        for worker in workers:
            paths = [c.laddr for c in worker.net_connections(kind="unix") if c.laddr]
            assert len(paths) == 1, paths
            assert os.stat(os.path.dirname(paths[0])).st_mode & 0o077 == 0  # this user only
            own.append(_counted(await _own_metrics(paths[0])))
        assert sum(own) == n and all(count > 0 for count in own), own
        # No port beyond the serving and metrics ports.
        listening = {
            c.laddr.port
            for p in [psutil.Process(proc.pid), *workers]
            for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        }
        assert listening == {port, metrics_port}
        assert engine.state.probes == 1  # the capability is probed once, for both workers
        pids = [w.pid for w in workers]
        share_dir = os.path.dirname(paths[0])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert _gone(pids)
        assert not os.path.exists(share_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
async def test_workers_stop_with_a_killed_parent_and_with_a_dead_sibling(servers):
    decode = await servers(VllmStandIn("decode-0"))
    for victim in ("parent", "worker"):
        port, metrics_port = free_ports(2)
        proc = _start(decode.url, port, metrics_port)
        try:
            await _until_healthy(proc, f"http://127.0.0.1:{port}")
            pids = [w.pid for w in _workers(proc)]
            if victim == "parent":
                proc.kill()
                proc.wait(10)
            else:
                os.kill(pids[0], signal.SIGKILL)
                assert proc.wait(30) != 0  # one worker's death stops the sidecar
                assert re.search(r"worker \d exited", proc.stderr.read())
            assert _gone(pids), victim
            with pytest.raises(OSError):  # nothing serves the port any more
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
