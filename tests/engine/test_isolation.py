"""One bad request never hurts another: a failure attributable to one request (in its
sampling, its output processing, or the model forward of a batch it is in) ends that
request only; the others finish complete and equal to what they produce alone, the engine
stays healthy and no block leaks."""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest

from devtools.engine_procs import SpawnedEngine
from pdpool.engine.config import EngineConfig
from pdpool.engine.engine_core import LLMEngine
from pdpool.engine.sampling_params import SamplingParams

# Starts engine processes: the full run's tier, not the fast one.
pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0, ignore_eos=True)


def _engine(model):
    return LLMEngine(EngineConfig(model=str(model), device="cpu", num_kv_blocks=64))


def _run(engine, requests: dict[str, list[int]], params: SamplingParams):
    for rid, prompt in requests.items():
        engine.add_request(rid, prompt, params)
    tokens = {rid: [] for rid in requests}
    finals = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                finals[o.request_id] = o
    return tokens, finals


PROMPTS = {"a": [5, 6, 7, 8], "b": [40, 41, 42], "c": [300, 301, 302, 303, 304]}


def _assert_idle(engine):
    pool = engine.kv.pool
    assert not engine.requests and not engine.kv.req_blocks
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_forward_failure_is_retried_without_the_offender(tiny_qwen3, monkeypatch):
    params = SamplingParams(max_tokens=12, **GREEDY)
    solo = {rid: _engine(tiny_qwen3).generate([p], params)[0] for rid, p in PROMPTS.items()}
    monkeypatch.setenv("PDPOOL_TEST_FAIL_FORWARD_FOR", "poison")
    engine = _engine(tiny_qwen3)
    tokens, finals = _run(engine, {**PROMPTS, "poison-1": [9, 10, 11]}, params)
    assert finals["poison-1"].finish_reason == "error"
    assert finals["poison-1"].error_status == 500
    assert "forward" in finals["poison-1"].error
    assert tokens["poison-1"] == []
    for rid in PROMPTS:
        assert finals[rid].finish_reason == "length"
        assert tokens[rid] == solo[rid], rid
    assert engine.stats["forward_failures"] == 1 and engine.stats["failed"] == 1
    assert engine.fault is None  # the offender was found: not an engine-wide fault
    _assert_idle(engine)
    # Alone, a failing request cannot be told apart from a broken engine: after two
    # requests in a row fail in the forward, the engine reports a fault (on /health)...
    _run(engine, {"poison-2": [1, 2]}, params)
    assert engine.fault is None
    _run(engine, {"poison-3": [1, 2]}, params)
    assert engine.fault is not None and "forward" in engine.fault
    # ... until a forward succeeds again.
    tokens, _ = _run(engine, {"a2": PROMPTS["a"]}, params)
    assert tokens["a2"] == solo["a"] and engine.fault is None
    _assert_idle(engine)


def test_sampling_failure_ends_that_request_only(tiny_qwen3, monkeypatch):
    params = SamplingParams(max_tokens=12, **GREEDY)
    solo = {rid: _engine(tiny_qwen3).generate([p], params)[0] for rid, p in PROMPTS.items()}
    monkeypatch.setenv("PDPOOL_TEST_FAIL_SAMPLING_FOR", "poison-first,poison-later@4")
    engine = _engine(tiny_qwen3)
    tokens, finals = _run(
        engine, {**PROMPTS, "poison-first": [9, 10], "poison-later": [11, 12]}, params
    )
    assert finals["poison-first"].finish_reason == "error" and tokens["poison-first"] == []
    assert finals["poison-later"].finish_reason == "error"
    assert len(tokens["poison-later"]) == 4
    assert "injected sampling failure" in finals["poison-later"].error
    for rid in PROMPTS:
        assert tokens[rid] == solo[rid], rid
    assert engine.stats["failed"] == 2 and engine.fault is None
    _assert_idle(engine)


# --- over HTTP, on a real `pdpool serve` ------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    hooks = {"PDPOOL_TEST_FAIL_SAMPLING_FOR": "poison@3", "PDPOOL_TEST_FAIL_FORWARD_FOR": "deadly"}
    saved = {k: os.environ.get(k) for k in hooks}
    os.environ.update(hooks)
    try:
        eng = SpawnedEngine(tiny_qwen3, tmp_path_factory.mktemp("logs"), "--num-kv-blocks", "64")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield eng.wait()
    finally:
        eng.stop()


async def _stream(c: httpx.AsyncClient, url: str, body: dict, rid: str):
    """(status, text, events) of a streamed completion; events are the parsed chunks."""
    headers = {"x-request-id": rid}
    async with c.stream(
        "POST",
        f"{url}/v1/completions",
        json={**body, "stream": True, "return_token_ids": True},
        headers=headers,
    ) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return resp.status_code, resp.json(), []
        events = []
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
        text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
        return 200, text, events


def _idle(server, timeout=10.0) -> tuple[float, float]:
    deadline = time.monotonic() + timeout
    while True:
        used = server.metric("pdpool_kv_blocks_used")
        running = server.metric("pdpool_num_requests_running") + server.metric(
            "pdpool_num_requests_waiting"
        )
        if (used == 0 and running == 0) or time.monotonic() > deadline:
            return used, running
        time.sleep(0.1)


def test_http_one_failing_request_leaves_concurrent_streams_whole(server):
    prompts = ["The river bank was", "Tokens flow through the", "In the beginning the"]
    body = dict(max_tokens=40, temperature=0, ignore_eos=True)

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            solo = [
                await _stream(c, server.url, {**body, "prompt": p}, f"solo{i}")
                for i, p in enumerate(prompts)
            ]
            together = await asyncio.gather(
                *[
                    _stream(c, server.url, {**body, "prompt": p}, f"good{i}")
                    for i, p in enumerate(prompts)
                ],
                _stream(c, server.url, {**body, "prompt": "a poisoned stream"}, "poison-s"),
                c.post(
                    f"{server.url}/v1/completions",
                    headers={"x-request-id": "poison-n"},
                    json={**body, "prompt": "a poisoned answer"},
                ),
            )
            return solo, together

    solo, together = asyncio.run(go())
    *good, poisoned_stream, poisoned_plain = together
    for (s_status, s_text, _), (g_status, g_text, g_events) in zip(solo, good, strict=True):
        assert s_status == g_status == 200
        assert g_text == s_text and g_text
        assert g_events[-1]["choices"][0]["finish_reason"] == "length"
    # Already streaming: three tokens (in as many events or fewer: a reader behind the
    # engine gets what waits at once), then an error event (and [DONE]).
    status, _, events = poisoned_stream
    assert status == 200
    assert sum(len(e["choices"][0]["token_ids"]) for e in events if e.get("choices")) == 3
    assert events[-1]["error"]["code"] == 500
    assert "injected sampling failure" in events[-1]["error"]["message"]
    # Not streaming: the whole answer is the error.
    assert poisoned_plain.status_code == 500, poisoned_plain.text
    assert "injected sampling failure" in poisoned_plain.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert _idle(server) == (0, 0)
    assert server.metric("pdpool_request_success_total") >= 8
    assert server.metric("pdpool_requests_failed_total") == 2


def test_http_bad_stop_token_is_400_and_engine_fault_shows_on_health(server):
    r = httpx.post(
        f"{server.url}/v1/completions",
        timeout=30,
        json={"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [10**6]},
    )
    assert r.status_code == 400 and "stop_token_ids" in r.json()["error"]["message"]
    # Two requests in a row failing in the model forward: an engine-wide fault, not hidden.
    for i in range(2):
        r = httpx.post(
            f"{server.url}/v1/completions",
            headers={"x-request-id": f"deadly{i}"},
            json={"prompt": "x", "max_tokens": 4},
            timeout=30,
        )
        assert r.status_code == 500 and "forward" in r.json()["error"]["message"]
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and "engine failure" in health.json()["error"]["message"]
    assert server.metric("pdpool_engine_fault") == 1
    r = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "ok", "max_tokens": 4}, timeout=30
    )
    assert r.status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert server.metric("pdpool_engine_fault") == 0
    assert _idle(server) == (0, 0)
