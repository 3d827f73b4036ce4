"""Through P/D, a greedy answer is the answer one engine gives alone: random requests
(devtools/answer_diff.py: stop strings, stop ids, min_tokens, logit_bias, allowed ids,
penalties, n, truncation, logprobs, chat flags, batches and token-id prompts), whole and
streamed, through `pdpool up --mode prefill-first` (every single-prompt request is a
prefill leg, a KV transfer over NIXL and a decode leg) and through one `pdpool serve` of the
same checkpoint and engine flags. And through the default decode-first flow with a prefix
every prompt shares, so that decode holds part of each prompt: rejected requests' prefill
legs pull that prefix from decode before decode loads the whole prompt back. And a rejected
decode-first stream with echo: the echo comes once, from the answer after the handoff. And
requests for their prompt's logprobs, which no handoff can give: served where they land."""

from __future__ import annotations

import httpx
import pytest

from devtools.answer_diff import compare, post, streamed_answer
from devtools.engine_procs import SpawnedEngine
from tests.support.e2e_helpers import cleanup, metric, start_topology

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    topo = start_topology(tmp_path_factory, prefill=1, decode=1, mode="prefill-first")
    yield topo.gateway.url
    cleanup(topo, keep_logs=False)


@pytest.fixture(scope="module")
def decode_first(tmp_path_factory):
    topo = start_topology(tmp_path_factory, prefill=1, decode=1, cache_hit_threshold=0.5)
    yield topo
    cleanup(topo, keep_logs=False)


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    from pdpool.up.topology import ensure_tiny_model

    eng = SpawnedEngine(
        ensure_tiny_model("qwen3"),
        tmp_path_factory.mktemp("alone"),
        "--max-model-len", "2048", "--num-kv-blocks", "512",
    )  # fmt: skip
    try:
        yield eng.wait().url
    finally:
        eng.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_pd_answers_equal_one_engines(pd, alone, stream):
    report = compare(alone, pd, requests=60, seed=11 + stream, stream=stream)
    assert not report.differ, report.differ[:3]
    assert report.same == 60


def test_decode_first_answers_with_pulled_prefixes_equal_one_engines(decode_first, alone):
    sidecar = decode_first.by_role("sidecar")[0].url
    report = compare(alone, decode_first.gateway.url, requests=40, seed=5, stream=False,
                     prefix_words=40)  # fmt: skip
    assert not report.differ, report.differ[:3]
    assert metric(sidecar, "pdpool_sidecar_legs_total", 'leg="prefill"') >= 10
    assert metric(sidecar, "pdpool_sidecar_pull_offered_tokens_total") > 0


@pytest.mark.parametrize("chat", [False, True])
def test_a_rejected_echo_stream_echoes_once_as_one_engine(decode_first, alone, chat):
    """Decode-first with echo, streamed: decode rejects a prompt it holds nothing of, and
    the echo must not leak from that rejected attempt; the answer after the KV handoff
    echoes once, as one engine's does."""
    sidecar = decode_first.by_role("sidecar")[0].url
    words = " ".join(["river stone cloud"] * 20) + (" chat" if chat else " text")
    if chat:
        body = {"messages": [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": words}],
                "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
        path = "/v1/chat/completions"
    else:
        body, path = {"prompt": words}, "/v1/completions"
    model = httpx.get(alone + "/v1/models", timeout=30).json()["data"][0]["id"]
    body.update(model=model, max_tokens=8, temperature=0, stream=True, echo=True)
    rejections = "pdpool_sidecar_threshold_rejections_total"
    before = metric(sidecar, rejections)
    one, through_pd = (
        streamed_answer(*post(u, path, body), body) for u in (alone, decode_first.gateway.url)
    )
    assert through_pd == one
    assert one[0][1].startswith(words) and one[0][1].count(words) == 1
    assert metric(sidecar, rejections) == before + 1  # decode did reject it first


@pytest.mark.parametrize("mode", ["decode-first", "prefill-first"])
def test_prompt_logprobs_are_served_where_they_land_as_one_engine(decode_first, pd, alone, mode):
    """A prompt decode holds nothing of, with prompt_logprobs (or completions' echo with
    logprobs): neither a rejection nor a prefill leg (their KV would come from another engine,
    and the prompt's logprobs with it cannot); the answer is one engine's."""
    gateway = decode_first.gateway.url if mode == "decode-first" else pd
    sidecar = decode_first.by_role("sidecar")[0].url
    model = httpx.get(alone + "/v1/models", timeout=30).json()["data"][0]["id"]
    words = " ".join(["meadow lantern"] * 24) + f" {mode}"
    rejections = "pdpool_sidecar_threshold_rejections_total"
    before = metric(sidecar, rejections)
    for extra in ({"prompt_logprobs": 2}, {"echo": True, "logprobs": 1, "max_tokens": 0}):
        body = {"model": model, "prompt": words, "max_tokens": 4, "temperature": 0, **extra}
        one, through = (
            httpx.post(u + "/v1/completions", json=body, timeout=120) for u in (alone, gateway)
        )
        assert through.status_code == 200 == one.status_code, through.text
        a, b = one.json()["choices"][0], through.json()["choices"][0]
        assert b["text"] == a["text"]
        rows_a, rows_b = a.get("prompt_logprobs"), b.get("prompt_logprobs")
        assert rows_b is not None and len(rows_b) == len(rows_a) > 40
        for ra, rb in zip(rows_a[1:], rows_b[1:], strict=True):
            assert ra.keys() == rb.keys()
            for token, entry in ra.items():
                assert abs(entry["logprob"] - rb[token]["logprob"]) < 1e-4
    assert metric(sidecar, rejections) == before
