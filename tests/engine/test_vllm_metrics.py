"""vLLM's metric names on our engine, beside pdpool_*: what vLLM dashboards and llm-d's
endpoint picker scrape. The list (tests/support/vllm_metric_names.py) is vLLM 0.32's
(vllm/v1/metrics/loggers.py: name, type, label names); tests/vllm/ checks the same list
against a live vLLM server."""

from __future__ import annotations

import httpx
import pytest

from devtools.engine_procs import spawned_engine
from tests.support.vllm_metric_names import check_vllm_names

# Starts engine processes: the full run's tier, not the fast one.
pytestmark = pytest.mark.slow


def value(fams: dict, name: str, sample: str, **labels) -> float:
    for s in fams[name].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((sample, labels))


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    with spawned_engine(
        tiny_qwen3, tmp_path_factory.mktemp("logs"), "--num-kv-blocks", "64"
    ) as eng:
        yield eng


def test_vllm_metric_names_types_labels_and_values(server):
    before = check_vllm_names(httpx.get(f"{server.url}/metrics").text)
    assert (
        value(
            before, "vllm:request_success", "vllm:request_success_total", finished_reason="length"
        )
        == 0
    )
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    r = httpx.post(
        f"{server.url}/v1/completions",
        timeout=60,
        json={
            "model": model,
            "prompt": "Hello world, the quick brown fox",
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    fams = check_vllm_names(httpx.get(f"{server.url}/metrics").text)
    labels = {"model_name": model, "engine": "0"}
    assert value(fams, "vllm:prompt_tokens", "vllm:prompt_tokens_total", **labels) == prompt_tokens
    assert value(fams, "vllm:generation_tokens", "vllm:generation_tokens_total", **labels) == 5
    assert (
        value(
            fams,
            "vllm:request_success",
            "vllm:request_success_total",
            finished_reason="length",
            **labels,
        )
        == 1
    )
    for reason in ("stop", "abort", "error"):  # pre-created at zero, as vLLM does
        assert (
            value(
                fams,
                "vllm:request_success",
                "vllm:request_success_total",
                finished_reason=reason,
                **labels,
            )
            == 0
        )
    assert (
        value(fams, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total", **labels)
        >= prompt_tokens
    )
    assert (
        value(
            fams,
            "vllm:time_to_first_token_seconds",
            "vllm:time_to_first_token_seconds_count",
            **labels,
        )
        == 1
    )
    assert (
        value(
            fams,
            "vllm:inter_token_latency_seconds",
            "vllm:inter_token_latency_seconds_count",
            **labels,
        )
        == 4
    )
    assert (
        value(
            fams,
            "vllm:e2e_request_latency_seconds",
            "vllm:e2e_request_latency_seconds_count",
            **labels,
        )
        == 1
    )
    assert value(fams, "vllm:num_requests_running", "vllm:num_requests_running", **labels) == 0
    assert (
        value(
            fams,
            "vllm:cache_config_info",
            "vllm:cache_config_info",
            block_size="16",
            num_gpu_blocks="64",
        )
        == 1
    )
    # ours stay beside them
    assert "pdpool_prompt_tokens" in fams and "pdpool_num_requests_running" in fams
