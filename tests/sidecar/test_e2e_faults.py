"""Faults on the real topology: prefill engines down or hanging, the decode engine
restarted mid-run, SSRF attempts, injected kv_transfer_params, malformed bodies, and a
client that disconnects mid-stream. No 500s; no request lost while a path can serve it."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.support.e2e_helpers import cleanup, metric, model_name, start_topology

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def topo(request, tmp_path_factory):
    t = start_topology(
        tmp_path_factory,
        prefill=2,
        decode=1,
        cache_hit_threshold=0.5,
        prefill_timeout=3.0,
        decode_retry_s=90.0,
    )
    yield t
    cleanup(t, keep_logs=request.node.session.testsfailed > 0)


@pytest.fixture(scope="module")
def gw(topo):
    with httpx.Client(base_url=topo.gateway.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(topo):
    return model_name(topo.gateway.url)


def cold_prompt(tag: str) -> str:
    return f"{tag}: " + "a fresh prompt nobody has seen " * 10


def test_prefiller_header_outside_the_set_is_refused(gw, topo, model):
    decode = topo.by_role("decode")[0]
    for target in (f"127.0.0.1:{decode.port}", "169.254.169.254:80", "evil.example:443"):
        r = gw.post(
            "/v1/completions",
            json={"model": model, "prompt": cold_prompt("ssrf"), "max_tokens": 2},
            headers={"x-prefiller-host-port": target},
        )
        assert r.status_code == 403, target
        assert r.json()["error"]["param"] == "x-prefiller-host-port"
    good = topo.by_role("prefill")[1]
    r = gw.post(
        "/v1/completions",
        json={"model": model, "prompt": cold_prompt("ssrf-ok"), "max_tokens": 2},
        headers={"x-prefiller-host-port": f"127.0.0.1:{good.port}"},
    )
    assert r.status_code == 200


def test_injected_kv_transfer_params_change_nothing(gw, model):
    prompt = cold_prompt("inject")
    evil = {
        "do_remote_prefill": True,
        "remote_engine_id": "evil",
        "remote_host": "10.6.6.6",
        "remote_port": 1,
        "remote_block_ids": [0, 1, 2, 3],
        "remote_request_id": "x",
    }
    r = gw.post(
        "/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": 6,
            "temperature": 0,
            "kv_transfer_params": evil,
        },
    )
    clean = gw.post(
        "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0},
    )
    assert r.status_code == 200 and clean.status_code == 200
    assert r.json()["choices"][0]["text"] == clean.json()["choices"][0]["text"]


@pytest.mark.parametrize(
    "content",
    [
        b"{oops",
        b"",
        b"null",
        b'"text"',
        b'{"prompt": 5, "max_tokens": -3}',
        b'{"prompt": "x", "stream": 3}',
        b'{"messages": "not a list"}',
        b'{"prompt": "x", "max_tokens": 99999999}',
        b'{"prompt": "x", "temperature": "hot"}',
        b'{"prompt": "x", "cache_hit_threshold": -1}',
    ],
)
def test_malformed_bodies_are_4xx_never_500(gw, content):
    for route in ("/v1/completions", "/v1/chat/completions"):
        r = gw.post(route, content=content, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (route, content, r.status_code, r.text)
        assert "message" in r.json()["error"]


def test_client_disconnect_mid_stream_aborts_the_engine_request(gw, topo, model):
    decode = topo.by_role("decode")[0]
    generated_before = metric(decode.url, "pdpool_generation_tokens_total")
    with gw.stream(
        "POST",
        "/v1/completions",
        json={
            "model": model,
            "prompt": "count forever " * 30,
            "max_tokens": 1500,
            "temperature": 0,
            "stream": True,
            "cache_hit_threshold": 0,
        },
    ) as r:
        assert r.status_code == 200
        for _ in r.iter_raw():
            break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if metric(decode.url, "pdpool_num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert metric(decode.url, "pdpool_num_requests_running") == 0
    assert metric(decode.url, "pdpool_generation_tokens_total") - generated_before < 1500


def test_prefill_engine_hanging_or_down_still_serves(gw, topo, model):
    sidecar = topo.by_role("sidecar")[0]
    p0, p1 = topo.by_role("prefill")
    os.kill(p0.pid, signal.SIGSTOP)  # hangs: accepts connections, never answers
    try:
        rs = [
            gw.post(
                "/v1/completions",
                json={"model": model, "prompt": cold_prompt(f"h{i}"), "max_tokens": 3},
            )
            for i in range(3)
        ]
        assert all(r.status_code == 200 for r in rs)
        assert all(r.headers["x-pdpool-path"] in ("pd", "fallback") for r in rs)
        os.kill(p1.pid, signal.SIGKILL)  # and the other one is gone
        p1.proc.wait(10)
        r = gw.post(
            "/v1/completions", json={"model": model, "prompt": cold_prompt("down"), "max_tokens": 3}
        )
        assert r.status_code == 200 and r.headers["x-pdpool-path"] == "fallback"
        # The hung engine was given up on: a leg to it timed out, or a health probe ejected
        # it (before or while a leg waited on it; which comes first is a race).
        given_up = sum(
            metric(sidecar.url, "pdpool_sidecar_prefill_attempts_total", f'outcome="{o}"')
            for o in ("timeout", "ejected")
        ) + metric(
            sidecar.url, "pdpool_sidecar_prefill_ejections_total", f'endpoint="127.0.0.1:{p0.port}"'
        )
        assert given_up >= 1
        # And the dead one: a leg was refused, or a probe found it gone first.
        assert (
            metric(sidecar.url, "pdpool_sidecar_prefill_attempts_total", 'outcome="connect_error"')
            + metric(
                sidecar.url,
                "pdpool_sidecar_prefill_ejections_total",
                f'endpoint="127.0.0.1:{p1.port}"',
            )
            >= 1
        )
    finally:
        os.kill(p0.pid, signal.SIGCONT)
        if p1.proc.poll() is not None:
            topo.restart(p1)
        topo.wait_healthy(120)


def test_decode_engine_restarted_mid_run_loses_no_request(gw, topo, model):
    decode = topo.by_role("decode")[0]
    results, errors = [], []

    def client_loop(i):
        with httpx.Client(base_url=topo.gateway.url, timeout=180) as c:
            for j in range(4):
                try:
                    r = c.post(
                        "/v1/completions",
                        json={
                            "model": model,
                            "prompt": f"client {i} turn {j} " * 8,
                            "max_tokens": 4,
                        },
                    )
                    results.append(r.status_code)
                except httpx.HTTPError as exc:
                    errors.append(repr(exc))
                time.sleep(0.3)

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    topo.restart(decode)
    for t in threads:
        t.join(240)
    topo.wait_healthy(120)
    assert not errors
    # Requests in flight when the engine died, or sent while it restarted, are retried by
    # the sidecar once the engine is back (nothing had been sent to the client yet).
    assert results == [200] * 12
    assert metric(topo.by_role("sidecar")[0].url, "pdpool_sidecar_decode_retries_total") > 0
