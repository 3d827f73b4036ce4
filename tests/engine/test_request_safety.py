"""One bad request never hurts another, on real `pdpool serve` processes: poison bodies are
refused while other streams run (and those finish unchanged), clients that leave while their
request is queued abort it before it is computed, and /health stays responsive while a
10 MB body is being prepared."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from devtools.engine_procs import SpawnedEngine

# Starts engine processes: the full run's tier, not the fast one.
pytestmark = pytest.mark.slow

# Each of these once raised inside the engine step (or the event loop) and failed every
# running request; now each is a 400 at the API.
POISON = [
    {"prompt": "hi", "seed": 18446744073709551616, "temperature": 1},
    {"prompt": "hi", "min_tokens": 2, "stop_token_ids": [999999]},
    {"prompt": "hi", "min_tokens": 2, "stop_token_ids": [2**70]},
    {"prompt": "hi", "temperature": 1e-300},
    {"prompt": "hi", "n": 2, "seed": 2**64 - 1, "temperature": 1},
    {"prompt": [2**70]},
    {"prompt": "\ud800"},
    {"prompt": "hi", "stream": "yes"},
    {"prompt": "hi", "max_tokens": "16"},
    {"prompt": [True, False]},
    {"prompt": "hi", "best_of": 3},
    {"prompt": "hi", "logit_bias": {"5": 1000}},
]
POISON_RAW = [  # (route, body) sent as raw bytes
    ("/v1/completions", b"[" * 5000 + b"]" * 5000),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
    ),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "tools": ["f"]}'),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "x"}], "tools": -1}'),
    (
        "/v1/chat/completions/render",
        b'{"messages": [{"role": "user", "content": "x"}], "tools": "f"}',
    ),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"a": 1}]}'),
]

STREAMS = [  # three long streams, one of them sampled with a seed
    {"prompt": "the river runs " * 4, "max_tokens": 1000, "temperature": 0},
    {"prompt": "a pool of engines " * 3, "max_tokens": 1000, "temperature": 0},
    {
        "prompt": "seeded sampling",
        "max_tokens": 1000,
        "temperature": 0.8,
        "top_p": 0.9,
        "seed": 1234,
    },
]
MAX_NUM_SEQS = 3


@pytest.fixture(scope="module")
def eng(tiny_qwen3, tmp_path_factory):
    """At most three sequences run at once: a fourth request queues."""
    proc = SpawnedEngine(
        tiny_qwen3, tmp_path_factory.mktemp("logs"), "--max-num-seqs", str(MAX_NUM_SEQS)
    )
    try:
        yield proc.wait()
    finally:
        proc.stop()


async def stream_text(
    client: httpx.AsyncClient, url: str, body: dict, first: asyncio.Event | None = None
) -> tuple[str, str, float]:
    """(text, finish_reason, monotonic time of [DONE]) of a streamed completion."""
    text, reason = [], None
    async with client.stream(
        "POST", url + "/v1/completions", json={**body, "stream": True, "ignore_eos": True}
    ) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "".join(text), reason, time.monotonic()
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if first is not None:
                first.set()
            text.append(chunk["choices"][0]["text"])
            reason = chunk["choices"][0]["finish_reason"] or reason
    raise AssertionError("stream ended without [DONE]")


def test_poison_bodies_get_400_while_three_streams_finish_unchanged(eng):

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            reference = await asyncio.gather(*(stream_text(c, eng.url, s) for s in STREAMS))
            started = [asyncio.Event() for _ in STREAMS]
            runs = [
                asyncio.ensure_future(stream_text(c, eng.url, s, ev))
                for s, ev in zip(STREAMS, started, strict=True)
            ]
            await asyncio.gather(*(ev.wait() for ev in started))
            answers = []
            for body in POISON:
                r = await c.post(
                    eng.url + "/v1/completions",
                    content=json.dumps(body),
                    headers={"content-type": "application/json"},
                )
                answers.append((body, r.status_code, r.json()))
            for route, raw in POISON_RAW:
                r = await c.post(
                    eng.url + route, content=raw, headers={"content-type": "application/json"}
                )
                answers.append((raw[:60], r.status_code, r.json()))
            last_poison = time.monotonic()
            return reference, await asyncio.gather(*runs), answers, last_poison

    reference, results, answers, last_poison = asyncio.run(go())
    for body, status, data in answers:
        assert status == 400, (body, status, data)
        assert data["error"]["type"] == "BadRequestError" and data["error"]["message"], data
    for ref, got in zip(reference, results, strict=True):
        assert got[1] == "length" and ref[1] == "length"
        assert got[0] == ref[0]  # same text as without the poison bodies
        assert got[2] > last_poison  # the stream was still running meanwhile
    assert eng.metric("pdpool_requests_failed_total") == 0
    assert eng.metric("pdpool_engine_fault") == 0
    assert httpx.get(eng.url + "/ready", timeout=5).status_code == 200


def test_queued_requests_of_departed_clients_are_aborted_and_never_computed(eng):
    """Three long streams fill every running slot; five clients queue behind them and give
    up after 1 s. Their requests must leave the queue (aborted, counted) and never be
    computed: none of their prompt blocks ever reaches the prefix cache."""
    aborted0 = eng.metric("pdpool_requests_aborted_total")
    computed0 = _labelled(eng, "pdpool_prompt_tokens_by_source_total", 'source="computed"')
    waiting_gone0 = _labelled(eng, "pdpool_client_disconnects_total", 'phase="waiting"')
    long_body = {"prompt": "one long request ", "max_tokens": 3000, "temperature": 0}
    queued = [
        {
            "prompt": f"client {i} gave up " * 40,
            "max_tokens": 20,
            "ignore_eos": True,
            "stream": i % 2 == 0,
        }
        for i in range(5)
    ]

    async def go():
        async with httpx.AsyncClient(timeout=120) as c:
            started = [asyncio.Event() for _ in range(MAX_NUM_SEQS)]
            runners = [
                asyncio.ensure_future(stream_text(c, eng.url, long_body, ev)) for ev in started
            ]
            await asyncio.gather(*(ev.wait() for ev in started))

            async def impatient(body):
                async with httpx.AsyncClient(timeout=1.0) as short:
                    with pytest.raises(httpx.TimeoutException):
                        await short.post(eng.url + "/v1/completions", json=body)

            async def waiting_after(delay):
                await asyncio.sleep(delay)
                return _sample(
                    (await c.get(eng.url + "/metrics")).text, "pdpool_num_requests_waiting"
                )

            *_, waiting_meanwhile = await asyncio.gather(
                *(impatient(b) for b in queued), waiting_after(0.6)
            )
            waiting_later = await waiting_after(0.3)
            still_running = not any(r.done() for r in runners)
            for r in runners:  # the long streams leave too (they are aborted)
                r.cancel()
            await asyncio.gather(*runners, return_exceptions=True)
            return waiting_meanwhile, waiting_later, still_running

    waiting_meanwhile, waiting_later, still_running = asyncio.run(go())
    assert still_running  # the queued requests never had a free slot ...
    assert waiting_meanwhile == 5  # ... they waited behind the long ones ...
    assert waiting_later == 0  # ... and left the queue when their clients left
    assert _labelled(eng, "pdpool_client_disconnects_total", 'phase="waiting"') - waiting_gone0 == 5
    deadline = time.monotonic() + 10
    while (
        eng.metric("pdpool_requests_aborted_total") - aborted0 < 5 + MAX_NUM_SEQS
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert eng.metric("pdpool_requests_aborted_total") - aborted0 == 5 + MAX_NUM_SEQS
    computed = (
        _labelled(eng, "pdpool_prompt_tokens_by_source_total", 'source="computed"') - computed0
    )
    # Never computed: a computed prompt leaves its full blocks in the prefix cache.
    for body in queued:
        usage = httpx.post(
            eng.url + "/v1/completions",
            timeout=30,
            json={"prompt": body["prompt"], "max_tokens": 1},
        ).json()["usage"]
        assert usage["prompt_tokens"] > 100
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0, usage
    # (and the check can see it: the same prompt again is a hit)
    usage = httpx.post(
        eng.url + "/v1/completions",
        timeout=30,
        json={"prompt": queued[0]["prompt"], "max_tokens": 1},
    ).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    # The engine's own count agrees: only the long requests' prompts were ever computed.
    long_prompt = httpx.post(
        eng.url + "/v1/completions",
        timeout=30,
        json={"prompt": long_body["prompt"], "max_tokens": 1},
    ).json()["usage"]["prompt_tokens"]
    assert computed == MAX_NUM_SEQS * long_prompt, (computed, long_prompt)


def test_health_answers_within_1s_while_a_10mb_body_is_prepared(eng):
    """A 10 MB prompt is parsed off the event loop and refused before it is tokenized (it
    cannot fit the context): 400, while every probe is answered within 1 s."""
    big = json.dumps(
        {"prompt": "hello world, the quick brown fox " * 310_000, "max_tokens": 4}
    ).encode()
    assert len(big) > 10_000_000
    outcome = {}

    def send_big():
        try:
            r = httpx.post(
                eng.url + "/v1/completions",
                content=big,
                timeout=6.0,
                headers={"content-type": "application/json"},
            )
            outcome["status"] = r.status_code
        except httpx.TimeoutException:
            outcome["status"] = "timeout"
        outcome["at"] = time.monotonic()

    sender = threading.Thread(target=send_big)
    sender.start()
    time.sleep(0.5)  # the body is in; preparation has begun
    latencies = []
    with httpx.Client(timeout=1.0) as c:
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            t0 = time.monotonic()
            for probe in ("/health", "/ready"):
                assert c.get(eng.url + probe).status_code == 200, probe
            latencies.append(time.monotonic() - t0)
            time.sleep(0.1)
    sender.join()
    assert outcome.get("status") == 400, outcome
    assert max(latencies) < 1.0, latencies
    assert len(latencies) >= 10


def _labelled(eng: SpawnedEngine, name: str, labels: str) -> float:
    text = httpx.get(eng.url + "/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and labels in line
    )


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")
