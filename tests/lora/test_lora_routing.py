"""Residency-aware routing with real engines: three `pdpool serve` engines with --max-loras 1
behind their sidecars and our gateway (`pdpool up`'s topology). An adapter is made resident
on an engine by a long request sent to that engine's sidecar directly (the gateway does not
count it as load); the gateway reads every engine's vllm:lora_requests_info and routes."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from typing import Iterator

import httpx
import pytest

from pdpool.up.topology import SIDE_BY_SIDE, Topology, TopologySpec

pytestmark = pytest.mark.slow

BACKEND = "x-pdpool-backend"


@pytest.fixture(scope="module")
def topo(tiny_qwen3, qwen3_adapters, tmp_path_factory):
    lora = ["--enable-lora", "--max-loras=1", "--max-lora-rank=16"]
    lora += [f"--lora-modules={n}={p}" for n, p in qwen3_adapters.items()]
    spec = TopologySpec(
        model=str(tiny_qwen3),
        prefill=0,
        decode=3,
        mode="aggregated",
        log_dir=str(tmp_path_factory.mktemp("lora-routing")),
        engine_args=["--num-kv-blocks=512", *lora],
        gateway_args=["--lora-scrape-interval-s=0.1"],
        **SIDE_BY_SIDE,
    )
    t = Topology(spec)
    t.start(timeout_s=300)
    try:
        yield t
    finally:
        t.stop()


def sidecar_hostports(topo) -> list[str]:
    return [f"127.0.0.1:{c.port}" for c in topo.by_role("sidecar")]


def body(model: str, n: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 500) for _ in range(24)]
    return {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}


@contextlib.contextmanager
def streaming(url: str, model: str, seed: int) -> Iterator[str]:
    """A long streamed request for `model` held open on `url` while the block runs; yields
    the backend the gateway named (or '' straight to a sidecar). Closed at the end (the
    engine aborts it)."""
    started = threading.Event()
    stop = threading.Event()
    named: list[str] = []

    def run() -> None:
        req = {**body(model, 3000, seed), "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=req, timeout=120) as r:
            assert r.status_code == 200
            named.append(r.headers.get(BACKEND, ""))
            for _ in r.iter_lines():
                started.set()
                if stop.is_set():
                    return

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(60), "the long request never streamed"
    try:
        yield named[0]
    finally:
        stop.set()
        t.join(30)


def wait_running(topo, index: int, adapter: str) -> None:
    """Until engine `index` reports `adapter` running (the series the gateway reads)."""
    engine = topo.by_role("decode")[index].url
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(f"{engine}/metrics", timeout=5).text
        line = next((x for x in text.splitlines() if x.startswith("vllm:lora_requests_info")), "")
        if f'running_lora_adapters="{adapter}"' in line:
            time.sleep(0.5)  # a few of the gateway's scrapes
            return
        time.sleep(0.1)
    raise AssertionError(f"{adapter} never ran on engine {index}")


def served_by(topo, model: str, seed: int) -> str:
    r = httpx.post(f"{topo.gateway.url}/v1/completions", json=body(model, 4, seed), timeout=60)
    assert r.status_code == 200, r.text
    return r.headers[BACKEND]


def test_a_request_goes_where_its_adapter_runs(topo):
    sidecars = sidecar_hostports(topo)
    for index in (2, 0):  # whichever engine holds it, whatever the prompt
        with streaming(topo.by_role("sidecar")[index].url, "alpha", seed=100 + index):
            wait_running(topo, index, "alpha")
            chosen = {served_by(topo, "alpha", seed) for seed in range(6)}
            assert chosen == {sidecars[index]}


def test_engines_whose_slots_are_taken_are_avoided(topo):
    sidecars = sidecar_hostports(topo)
    scs = topo.by_role("sidecar")
    loads = [slot_loads(topo, i) for i in range(3)]
    with streaming(scs[0].url, "beta", seed=200), streaming(scs[1].url, "gamma", seed=201):
        wait_running(topo, 0, "beta")
        wait_running(topo, 1, "gamma")
        chosen = {served_by(topo, "alpha", seed) for seed in range(10, 16)}
        assert chosen == {sidecars[2]}  # the only engine with a free slot
    # the engines count the adapters copied into their one slot: beta and gamma once each;
    # alpha at most once, for its six requests (none when it stayed from the test before)
    got = [slot_loads(topo, i) - loads[i] for i in range(3)]
    assert got[:2] == [1, 1] and got[2] in (0, 1)


def slot_loads(topo, index: int) -> float:
    text = httpx.get(f"{topo.by_role('decode')[index].url}/metrics", timeout=5).text
    line = next(x for x in text.splitlines() if x.startswith("pdpool_lora_slot_loads_total"))
    return float(line.split()[-1])


def test_the_load_bound_spills_an_overloaded_resident_engine(topo):
    sidecars = sidecar_hostports(topo)
    scs = topo.by_role("sidecar")
    with streaming(scs[1].url, "alpha", seed=300):
        wait_running(topo, 1, "alpha")
        # through the gateway: the first long alpha request joins engine 1; with it in
        # flight there, the cap is ceil(1.25 * 2 / 3) = 1, so the second goes elsewhere
        with streaming(topo.gateway.url, "alpha", seed=301) as first:
            assert first == sidecars[1]
            with streaming(topo.gateway.url, "alpha", seed=302) as second:
                assert second != sidecars[1]
        # the load gone, alpha's requests go where it is loaded: engine 1, or where the
        # spilled request loaded it; never the third engine
        assert served_by(topo, "alpha", 303) in {sidecars[1], second}
