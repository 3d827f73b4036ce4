"""`pdpool serve --scheduling-policy priority` on a real engine process: with one batch slot,
requests queued behind a long low-priority one run by priority (lower first; the three
generation routes carry it), and /metrics counts them by priority. Under fcfs a priority is
accepted and ignored, as vLLM 0.32 does."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from devtools.engine_procs import spawned_engine
from pdpool.engine.server.priority_metrics import MAX_PRIORITY_LABELS
from tests.support.priority_mix import EXPECTED, QUEUED, run_mix

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def samples(url: str, name: str) -> dict[str, float]:
    """priority label -> value of the samples called `name`."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        s.labels["priority"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    }


def model_of(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def post_one(url: str, priority: int) -> None:
    r = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 1, "priority": priority},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def test_high_priority_runs_before_the_queued_low_ones(tiny_qwen3, tmp_path):
    flags = ("--scheduling-policy", "priority", "--max-num-seqs", "1")
    with spawned_engine(tiny_qwen3, tmp_path, *flags) as eng:

        def waiting_by_priority() -> None:
            waiting = samples(eng.url, "pdpool_num_requests_waiting_by_priority")
            assert waiting == {"5": 3, "0": 1, "-1": 2}

        assert run_mix(eng.url, model_of(eng.url), on_queued=waiting_by_priority) == EXPECTED
        queued = samples(eng.url, "pdpool_request_queue_time_by_priority_seconds_count")
        # the finished ones, each route's warm-up too (busy's client left: a disconnect)
        assert queued == {"5": 6, "0": 2, "-1": 4}
        assert samples(eng.url, "pdpool_num_requests_waiting_by_priority") == {
            "5": 0,
            "0": 0,
            "-1": 0,
        }
        # Labels are bounded: 8 distinct priorities at most (3 seen so far), then "other".
        for p in range(100, 100 + MAX_PRIORITY_LABELS):
            post_one(eng.url, p)
        ttft = samples(eng.url, "pdpool_time_to_first_token_by_priority_seconds_count")
        assert len(ttft) == MAX_PRIORITY_LABELS + 1
        assert ttft["other"] == 3 and ttft["104"] == 1 and "105" not in ttft
        bad = httpx.post(
            f"{eng.url}/v1/completions",
            json={"prompt": "hi", "max_tokens": 1, "priority": "high"},
            timeout=30,
        )
        assert bad.status_code == 400 and "priority" in bad.text


def test_fcfs_accepts_and_ignores_priority(tiny_qwen3, tmp_path):
    """vLLM 0.32 dropped its 'Priority scheduling is not enabled' check: a priority under
    fcfs is served, in arrival order."""
    with spawned_engine(tiny_qwen3, tmp_path, "--max-num-seqs", "1") as eng:
        order = run_mix(eng.url, model_of(eng.url))
        assert order == [name for name, _, _ in QUEUED]
