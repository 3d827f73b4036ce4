"""`pdpool up --gateway envoy` end to end: real Envoy (scripts/envoy/install.sh) in front of
real engines and sidecars, asking `pdpool epp` (the Gateway API Inference Extension endpoint
picker, over ext_proc) where each request goes.

One topology (1 prefill, 2 decode engines, KV events) serves every test; the picker runs
with --test-endpoint-selection so that GIE's conformance header can restrict its choice."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import httpx
import pytest

from pdpool.ports import free_port
from pdpool.up.envoy_config import envoy_bootstrap
from pdpool.up.envoy_gateway import find_envoy
from pdpool.up.topology import healthy
from tests.support.e2e_helpers import (
    await_indexed,
    settled_blocks,
    cleanup,
    metric,
    model_name,
    start_topology,
)
from tests.support.prerequisites import envoy_for_children

pytestmark = pytest.mark.slow

SELECT = "test-epp-endpoint-selection"


@pytest.fixture(scope="module")
def topo(tmp_path_factory):
    envoy_for_children()
    t = start_topology(
        tmp_path_factory,
        prefill=1,
        decode=2,
        kv_events=True,
        gateway="envoy",
        epp_args=["--test-endpoint-selection"],
    )
    yield t
    cleanup(t)


@pytest.fixture(scope="module")
def model(topo):
    return model_name(topo.gateway.url)


def _complete(url: str, body: dict, headers: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        json={"max_tokens": 4, "temperature": 0, **body},
        headers=headers,
        timeout=kw.get("timeout", 60),
    )


def _endpoint(child) -> str:
    return f"127.0.0.1:{child.port}"


def test_requests_reach_exactly_the_sidecar_the_picker_chose(topo, model):
    roles = {c.role for c in topo.children}
    assert {"envoy", "epp"} <= roles and "gateway" not in roles
    sidecars = topo.by_role("sidecar")
    for chosen in sidecars * 2:
        before = {s.port: metric(s.url, "pdpool_sidecar_requests_total") for s in sidecars}
        r = _complete(
            topo.gateway.url, {"model": model, "prompt": "pick me"}, {SELECT: _endpoint(chosen)}
        )
        assert r.status_code == 200, r.text
        # Envoy reports where it connected (upstream.address): the picker's choice.
        assert r.headers["x-pdpool-backend"] == _endpoint(chosen)
        after = {s.port: metric(s.url, "pdpool_sidecar_requests_total") for s in sidecars}
        assert {p: after[p] - before[p] for p in after} == {
            s.port: (1.0 if s is chosen else 0.0) for s in sidecars
        }


def test_streamed_bodies_arrive_intact(topo, model):
    """A request body streamed in chunks (and larger than one ext_proc chunk) reaches the
    sidecar whole; the streamed answer is the one the sidecar gives directly."""
    sidecar = topo.by_role("sidecar")[0]
    prompt = [random.Random(3).randrange(3, 500) for _ in range(40)]
    # 200 kB of JSON whitespace: the picker must hand every byte on for this to parse.
    raw = (
        b'{"model": "' + model.encode() + b'", "stream": true, "max_tokens": 6, '
        b'"temperature": 0, "prompt": ' + json.dumps(prompt).encode() + b" " * 200_000 + b"}"
    )

    def pieces():
        for i in range(0, len(raw), 7_000):
            yield raw[i : i + 7_000]

    headers = {"content-type": "application/json", SELECT: _endpoint(sidecar)}
    via = httpx.post(topo.gateway.url + "/v1/completions", content=pieces(), headers=headers)
    direct = httpx.post(sidecar.url + "/v1/completions", content=raw, headers=headers)
    assert via.status_code == direct.status_code == 200, via.text
    assert via.headers["content-type"].startswith("text/event-stream")

    def text(r):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        assert chunks[-1]["finish_reason"] == "length"
        return "".join(c["text"] for c in chunks)

    # (Event boundaries may differ: the picker may have sent this one P/D up front.)
    assert text(via) == text(direct) != ""


def test_precise_routing_hits_the_warmed_engine(topo, model):
    """Only the engines' KV events can tell the picker where these prompts live."""
    sidecars = topo.by_role("sidecar")
    rng = random.Random(5)
    docs = []
    before = settled_blocks([topo.router], "pdpool_gateway_kv_blocks")
    for i in range(4):
        doc = [rng.randrange(3, 500) for _ in range(96)]
        holder = sidecars[i % 2]
        assert _complete(holder.url, {"model": model, "prompt": doc}).status_code == 200
        docs.append((doc, holder))
    # 96 tokens: 6 blocks of 16 per prompt, two prompts per engine.
    grown = {(topo.router.port, _endpoint(s)): 12 for s in sidecars}
    await_indexed([topo.router], "pdpool_gateway_kv_blocks", before, grown)
    for doc, holder in docs:
        r = _complete(topo.gateway.url, {"model": model, "prompt": [*doc, 7, 8, 9]})
        assert r.status_code == 200, r.text
        assert r.headers["x-pdpool-backend"] == _endpoint(holder)
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 80
    assert metric(topo.router.url, "pdpool_gateway_kv_routes_total", 'path="decode"') >= 4


def test_a_pd_request_through_envoy_takes_the_pd_path_with_the_aggregated_text(topo, model):
    prompt = [random.Random(17).randrange(3, 500) for _ in range(80)]
    body = {"model": model, "prompt": prompt, "max_tokens": 8}
    r = _complete(topo.gateway.url, body)
    assert r.status_code == 200, r.text
    assert r.headers["x-pdpool-path"] == "pd", r.headers  # told up front: nobody holds it
    assert r.headers["x-pdpool-prefill-endpoint"] == _endpoint(topo.by_role("prefill")[0])
    aggregated = _complete(topo.by_role("decode")[0].url, body)  # one engine, no P/D
    assert r.json()["choices"][0]["text"] == aggregated.json()["choices"][0]["text"]


def test_bad_bodies_are_refused_by_the_picker(topo, model):
    r = _complete(topo.gateway.url, {"model": model, "prompt": "x", "max_tokens": -1})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(topo.gateway.url + "/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "error" in r.json()


def _second_envoy(topo, tmp_path, failure_mode: str):
    """Another Envoy, in front of the same picker and sidecars, in the given failure mode."""
    grpc_port = int(topo.router.argv[topo.router.argv.index("--port") + 1])
    port = free_port()
    sidecars = [("127.0.0.1", s.port) for s in topo.by_role("sidecar")]
    config = tmp_path / f"envoy-{failure_mode}.json"
    admin = free_port()
    bootstrap = envoy_bootstrap(port, admin, grpc_port, sidecars, failure_mode)
    config.write_text(json.dumps(bootstrap))
    log = open(tmp_path / f"envoy-{failure_mode}.log", "wb")  # noqa: SIM115 (the child's)
    proc = subprocess.Popen(
        [find_envoy(), "-c", str(config), "--disable-hot-restart", "--concurrency", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not healthy(url) and time.monotonic() < deadline:
        time.sleep(0.2)
    return proc, url, f"http://127.0.0.1:{admin}"


def _wait_picker_unhealthy(admin_url: str) -> None:
    """Until Envoy's health checks have found the picker down (at most a few seconds)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        clusters = httpx.get(admin_url + "/clusters", timeout=5).text
        if any(
            line.startswith("epp::") and "health_flags::/failed_active_hc" in line
            for line in clusters.splitlines()
        ):
            return
        time.sleep(0.1)
    raise AssertionError("Envoy did not find the picker down")


def test_picker_down_fail_close_gives_5xx_and_fail_open_serves(topo, model, tmp_path):
    opened, open_url, open_admin = _second_envoy(topo, tmp_path, "open")
    epp = topo.router
    try:
        assert _complete(open_url, {"model": model, "prompt": "up"}).status_code == 200
        os.killpg(epp.proc.pid, signal.SIGKILL)
        epp.proc.wait(10)
        closed = _complete(topo.gateway.url, {"model": model, "prompt": "down"}, timeout=20)
        assert 500 <= closed.status_code < 600
        # (Before Envoy's health checks find the picker down, a request whose body already
        # streamed to it fails even failing open: see pdpool/up/envoy_config.py.)
        _wait_picker_unhealthy(open_admin)
        served = _complete(open_url, {"model": model, "prompt": "down"}, timeout=20)
        assert served.status_code == 200, (served.headers, served.text)
        assert served.json()["choices"][0]["text"]
    finally:
        opened.terminate()
        opened.wait(10)
        topo.restart(epp)
        topo.wait_healthy(60)


def test_a_dead_picked_endpoint_gives_a_clear_503(topo, model):
    sidecar = topo.by_role("sidecar")[1]
    os.killpg(sidecar.proc.pid, signal.SIGKILL)
    sidecar.proc.wait(10)
    try:
        started = time.monotonic()
        r = _complete(
            topo.gateway.url,
            {"model": model, "prompt": "anyone?"},
            {SELECT: _endpoint(sidecar)},
            timeout=30,
        )
        assert time.monotonic() - started < 10
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "no_backend"
        assert _endpoint(sidecar) in r.json()["error"]["message"] or "healthy" in r.text
        # Unrestricted requests go on to the other sidecar meanwhile.
        ok = _complete(topo.gateway.url, {"model": model, "prompt": "anyone else?"})
        assert ok.status_code == 200, ok.text
        assert ok.headers["x-pdpool-backend"] == _endpoint(topo.by_role("sidecar")[0])
    finally:
        topo.restart(sidecar)
        topo.wait_healthy(60)
