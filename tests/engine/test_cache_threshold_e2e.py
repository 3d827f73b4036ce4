"""The cache-hit-threshold seed's scenario on a real `pdpool serve`, global threshold 0.8.

Prompts are token ids so that hit ratios are exact: a 64-token base (4 blocks of 16) is
warmed first, then prompts that extend it are judged by cached / prompt tokens.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest

from devtools.engine_procs import SpawnedEngine

# Starts engine processes: the full run's tier, not the fast one.
pytestmark = pytest.mark.slow

BASE = list(range(100, 164))  # 64 tokens = 4 full blocks


def tail(n: int, seed: int) -> list[int]:
    """n pseudo-random token ids (below the tiny vocab of 512), different for each seed."""
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    eng = SpawnedEngine(
        tiny_qwen3,
        tmp_path_factory.mktemp("logs"),
        "--global-cache-hit-threshold",
        "0.8",
        "--log-level",
        "info",
    )
    try:
        yield eng.wait()
    finally:
        eng.stop()


def complete(server, prompt, **extra) -> dict:
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **extra},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_the_seed_scenario(server):
    # 1) warm the cache: threshold 0 always runs.
    warm = complete(server, BASE, cache_hit_threshold=0)
    assert warm["choices"][0]["finish_reason"] == "length"
    # 2) miss: 64 of 234 cached = 0.27 < 0.33.
    miss = complete(server, BASE + tail(170, 300), cache_hit_threshold=0.33)
    assert miss["choices"][0]["finish_reason"] == "cache_threshold"
    assert miss["choices"][0]["text"] == ""
    assert miss["usage"]["completion_tokens"] == 0
    assert miss["usage"]["prompt_tokens"] == 234
    assert miss["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    # 3) hit: 64 of 104 cached = 0.62 >= 0.33.
    hit = complete(server, BASE + tail(40, 300), cache_hit_threshold=0.33)
    assert hit["choices"][0]["finish_reason"] == "length"
    assert hit["usage"]["completion_tokens"] == 4
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    # 4) miss under the global 0.8: 64 of 156 cached = 0.41, no per-request value.
    glob = complete(server, BASE + tail(92, 600))
    assert glob["choices"][0]["finish_reason"] == "cache_threshold"

    log = server.log.read_text()
    assert "cache hit ratio 0.274 < request threshold 0.330" in log
    assert "cache hit ratio 0.410 < global threshold 0.800" in log
    assert server.metric("pdpool_cache_threshold_rejections_total") == 2
    # Rejected requests never took blocks.
    assert server.metric("pdpool_kv_blocks_used") == 0


def test_threshold_zero_always_runs_and_one_always_rejects(server):
    cold = complete(server, tail(50, 2000), cache_hit_threshold=0.0)
    assert cold["choices"][0]["finish_reason"] == "length"
    complete(server, BASE, cache_hit_threshold=0)
    # Even a fully cached prompt computes its last token, so the ratio stays below 1.
    full = complete(server, BASE, cache_hit_threshold=1.0)
    assert full["choices"][0]["finish_reason"] == "cache_threshold"


def test_streamed_rejection_and_chat(server):
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={
            "prompt": tail(80, 3000),
            "max_tokens": 4,
            "stream": True,
            "cache_hit_threshold": 0.5,
        },
        timeout=60,
    ) as r:
        events = [
            json.loads(line[5:])
            for line in r.iter_lines()
            if line.startswith("data:") and "[DONE]" not in line
        ]
    assert events[-1]["choices"][0]["finish_reason"] == "cache_threshold"
    assert "".join(e["choices"][0]["text"] for e in events) == ""
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "a new conversation"}],
            "cache_hit_threshold": 0.9,
            "max_completion_tokens": 4,
        },
    )
    assert r.json()["choices"][0]["finish_reason"] == "cache_threshold"
    assert r.json()["choices"][0]["message"]["content"] == ""
