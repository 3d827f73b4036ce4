"""`pdpool up --autoscale` end to end: real engines, sidecars and the gateway on file:
discovery, the planner in a loop as `pdpool up` runs it (pdpool/up/autoscale.py).

Load makes it add decode engines; a scale-down while streams run drains the leaving engine
(its streams finish, its processes stop only afterwards, new requests go elsewhere); idle
makes it scale down to the minimum; not one request fails."""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import time
from typing import Any, Optional

import httpx
import pytest

from pdpool.planner.policy import PlannerConfig, RoleBounds
from pdpool.up.autoscale import LocalAutoscaler
from tests.support.e2e_helpers import cleanup, model_name, start_topology

pytestmark = pytest.mark.slow

MAX_TOKENS = 160
PINNED_TOKENS = 1000  # seconds of decoding here
DRAIN_WAIT_S = 300  # the pinned stream and the drain: well inside the test's 600 s timeout


class Load:
    """Streaming clients in threads, each sending one request after another."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self.results: list[dict] = []
        self.serial = itertools.count()
        self.active: dict[int, str] = {}  # request -> the sidecar streaming it, while it runs
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def one(
        self, client: httpx.Client, sidecar: Optional[Any] = None, max_tokens: int = MAX_TOKENS
    ) -> dict:
        """One stream through the gateway, or straight to `sidecar` (a topology child)."""
        serial = next(self.serial)
        body = {
            "model": self.model,
            # A head of its own: prefix affinity would keep one prompt on one engine, and
            # the test is about the engines the planner adds taking load.
            "prompt": f"{serial} " + "the planner scales engines " * 8,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        url = self.url if sidecar is None else sidecar.url
        out = {"start": time.monotonic(), "tokens": 0, "finish": None, "status": None}
        try:
            with client.stream("POST", url + "/v1/completions", json=body) as r:
                out["status"] = r.status_code
                out["backend"] = (
                    r.headers.get("x-pdpool-backend")
                    if sidecar is None
                    else f"127.0.0.1:{sidecar.port}"
                )
                self.active[serial] = out["backend"]
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        choice = httpx.Response(200, content=line[6:]).json()["choices"][0]
                        out["tokens"] += 1
                        out["finish"] = choice.get("finish_reason") or out["finish"]
        except httpx.HTTPError as exc:
            out["error"] = repr(exc)
        self.active.pop(serial, None)
        out["end"] = time.monotonic()
        return out

    def run(self, workers: int) -> None:
        def loop():
            with httpx.Client(timeout=120) as client:
                while not self.stop.is_set():
                    self.results.append(self.one(client))

        self.stop.clear()
        self.threads = [threading.Thread(target=loop) for _ in range(workers)]
        for t in self.threads:
            t.start()

    def pinned(self, sidecar: Any, max_tokens: int, until: threading.Event) -> threading.Thread:
        """Long streams on one sidecar, one after another from now until `until` is set, their
        results kept with the others: however fast or slow the engine decodes, one of them
        runs at any moment before `until`."""

        def run():
            with httpx.Client(timeout=300) as client:
                while True:
                    self.results.append(self.one(client, sidecar, max_tokens))
                    if until.is_set():
                        return

        thread = threading.Thread(target=run)
        thread.start()
        self.threads.append(thread)
        return thread

    def halt(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def failed(self) -> list[dict]:
        return [
            r
            for r in self.results
            if r["status"] != 200 or r.get("error") or r["finish"] != "length"
        ]


def wait(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s: {what}")


def serving(topo, role):
    return [c for c in topo.by_role(role) if c.state == "serving"]


def test_load_scales_up_a_busy_scale_down_drains_and_idle_returns_to_the_minimum(
    tmp_path_factory, tmp_path
):
    topo = start_topology(tmp_path_factory, prefill=0, decode=1, discovery_files=True)
    config = PlannerConfig(
        prefill=RoleBounds(0, 0),
        decode=RoleBounds(1, 3),
        ttft_seconds=60.0,
        itl_seconds=0.001,  # any load is over target: scale up
        down_window_s=2.0,
        up_cooldown_s=1.0,
        down_cooldown_s=1.0,
    ).validate()
    state_file = str(tmp_path / "state.json")
    scaler = LocalAutoscaler(topo, config, interval_s=1.0, state_file=state_file)
    paused, done = threading.Event(), threading.Event()

    def planner_loop():  # what `pdpool up --autoscale` runs in its supervisor loop
        while not done.is_set():
            # Paused: no more decisions, but drains that end are still reaped (stopped).
            if paused.is_set():
                scaler.reap()
            else:
                scaler.tick()
            topo.supervise_once()
            time.sleep(0.3)

    loop = threading.Thread(target=planner_loop)
    load = Load(topo.gateway.url, model_name(topo.gateway.url))
    try:
        loop.start()
        load.run(workers=6)
        wait(lambda: len(serving(topo, "decode")) == 3, 180, "load scales decode 1 -> 3")
        ups = [e for e in scaler.events if e["direction"] == "up"]
        assert ups and all(e["role"] == "decode" and "itl" in e["reason"] for e in ups)
        wait(lambda: len({r.get("backend") for r in load.results[-24:]}) == 3, 120, "all 3 used")

        # A scale-down under load (targets relaxed: the same load is now far under them),
        # once the engine it will take (the newest) is streaming.
        newest = max(serving(topo, "decode"), key=lambda c: c.index)
        newest_sidecar = next(c for c in topo.by_role("sidecar") if newest.url in c.argv)
        streaming = f"127.0.0.1:{newest_sidecar.port}"
        # Its own streams come and go with the gateway's choices: long streams of its own,
        # one after another until the planner has decided, are running when it decides.
        decided = threading.Event()
        pinned = load.pinned(newest_sidecar, PINNED_TOKENS, until=decided)
        wait(lambda: streaming in load.active.values(), 60, "a stream on the newest engine")
        scaler.config = dataclasses.replace(config, itl_seconds=10.0)
        wait(lambda: scaler.drains, 30, "a scale-down decision")
        decided.set()
        paused.set()
        leaving = list(scaler.drains[0].children)
        retired_at = scaler.drains[0].started_at  # unlisted then, not when this loop saw it
        exited: dict[str, float] = {}

        def watch(child):
            while child.proc.poll() is None:
                time.sleep(0.02)
            exited[child.name] = time.monotonic()

        watchers = [threading.Thread(target=watch, args=(c,)) for c in leaving]
        for w in watchers:
            w.start()
        # The pinned stream's result is recorded only when it ends, and on a loaded machine
        # its tokens take minutes: wait for it and for the leaving processes, however long
        # the drain is, before reading what ran when.
        pinned.join(DRAIN_WAIT_S)
        assert not pinned.is_alive(), f"the pinned stream outlived {DRAIN_WAIT_S}s"
        for w in watchers:
            w.join(DRAIN_WAIT_S)
        assert sorted(exited) == sorted(c.name for c in leaving), (exited, leaving)
        sidecar = next(c for c in leaving if c.role == "sidecar")
        backend = f"127.0.0.1:{sidecar.port}"
        on_leaving = [r for r in load.results if r.get("backend") == backend]
        in_flight = [r for r in on_leaving if r["start"] < retired_at < r["end"]]
        assert in_flight, ("no stream was running on the engine when it was retired", on_leaving)
        last_end = max(r["end"] for r in on_leaving)
        assert all(t >= last_end for t in exited.values()), (exited, last_end)
        assert all(r["start"] < retired_at + 1.0 for r in on_leaving)  # none routed after
        load.halt()
        assert len(serving(topo, "decode")) == 2

        # Idle: down to the minimum.
        paused.clear()
        wait(lambda: len(serving(topo, "decode")) == 1, 60, "idle scales decode 2 -> 1")
        wait(lambda: not scaler.drains, 60, "the last drain finished")
        assert len(topo.by_role("decode")) == 1 and len(topo.by_role("sidecar")) == 1
        assert not load.failed(), load.failed()[:3]
        assert len(load.results) > 20
        with open(state_file) as fh:
            state = json.load(fh)
        assert [c["name"] for c in state["children"] if c["role"] == "decode"] == [
            c.name for c in topo.by_role("decode")
        ]
        assert [e["direction"] for e in state["autoscaling"]["events"]].count("down") == 2
    finally:
        load.halt()
        done.set()
        loop.join(60)
        cleanup(topo, keep_logs=True)
