"""Snapshots from Prometheus text: sums, counter deltas across restarts, p90 of a window."""

from __future__ import annotations

import math

import pytest

from pdpool.planner.metrics import (
    EndpointMetrics,
    Snapshot,
    bucket_delta,
    buckets,
    counter_delta,
    parse_text,
    quantile,
    total,
)
from pdpool.planner.signals import signals

TEXT = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{model_name="m"} 1000.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 2.0
vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="m"} 8.0
vllm:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} 10.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 10.0
vllm:time_to_first_token_seconds_count{model_name="m"} 10.0
vllm:time_to_first_token_seconds_sum{model_name="m"} 3.0
# TYPE pdpool_sidecar_prefill_attempts counter
pdpool_sidecar_prefill_attempts_total{outcome="ok"} 5.0
pdpool_sidecar_prefill_attempts_total{outcome="no_endpoint"} 2.0
"""


def test_parse_and_sum_by_name_with_or_without_total():
    s = parse_text(TEXT)
    assert total(s, "vllm:num_requests_running") == 3.0
    assert total(s, "vllm:prompt_tokens") == 1000.0  # vLLM 0.32's _total found too
    assert total(s, "pdpool_sidecar_prefill_attempts", outcome="no_endpoint") == 2.0
    assert total(s, "vllm:absent") == 0.0


def test_malformed_text_is_a_value_error():
    with pytest.raises(ValueError):
        parse_text("vllm:num_requests_running{oops 3\n")


def test_p90_interpolates_within_its_bucket_like_histogram_quantile():
    cum = buckets(parse_text(TEXT), "vllm:time_to_first_token_seconds")
    # rank 9 of 10 lies halfway through the (0.5, 1.0] bucket (8 -> 10). Python floats
    # interpolated in another order than the expected formula: rel 1e-9 (pytest.approx's
    # default 1e-6, tightened) covers rounding only.
    assert quantile(0.9, cum) == pytest.approx(0.75, rel=1e-9)
    assert quantile(0.5, cum) == pytest.approx(0.1 + 0.4 * (5 - 2) / 6, rel=1e-9)
    assert quantile(0.9, {0.5: 0.0, math.inf: 0.0}) is None
    assert quantile(0.99, {0.5: 1.0, math.inf: 5.0}) == 0.5  # in +Inf: the last bound


def test_deltas_survive_a_restart():
    assert counter_delta(150.0, 100.0) == 50.0
    assert counter_delta(20.0, 100.0) == 20.0  # restarted: counted from zero
    assert bucket_delta({1.0: 5.0, math.inf: 6.0}, {1.0: 2.0, math.inf: 2.0}) == {
        1.0: 3.0,
        math.inf: 4.0,
    }
    assert bucket_delta({1.0: 1.0, math.inf: 1.0}, {1.0: 2.0, math.inf: 2.0}) == {
        1.0: 1.0,
        math.inf: 1.0,
    }


def test_window_signals_use_only_the_observations_between_two_scrapes():
    before = Snapshot(0.0, (EndpointMetrics("prefill", "p0", parse_text(TEXT)),))
    later = TEXT.replace('le="1.0",model_name="m"} 10.0', 'le="1.0",model_name="m"} 20.0')
    later = later.replace('le="+Inf",model_name="m"} 10.0', 'le="+Inf",model_name="m"} 20.0')
    later = later.replace(
        'prompt_tokens_total{model_name="m"} 1000.0', 'prompt_tokens_total{model_name="m"} 3000.0'
    )
    now = Snapshot(10.0, (EndpointMetrics("prefill", "p0", parse_text(later)),))
    sig = signals(before, now)
    # The window's 10 first tokens all took 0.5-1.0 s: p90 is 0.95, not the lifetime's 0.75.
    assert sig.prefill.ttft_p90 == pytest.approx(0.95, rel=1e-9)  # rounding only (as above)
    assert sig.prefill.requests == 10.0
    assert sig.prefill.prompt_tokens_per_s == pytest.approx(200.0, rel=1e-9)  # rounding only
    assert sig.decode.engines == 0 and sig.decode.idle


SIDECAR = """# TYPE pdpool_sidecar_ttft_seconds histogram
pdpool_sidecar_ttft_seconds_bucket{le="0.5",path="decode"} 1.0
pdpool_sidecar_ttft_seconds_bucket{le="2.0",path="decode"} 10.0
pdpool_sidecar_ttft_seconds_bucket{le="+Inf",path="decode"} 10.0
pdpool_sidecar_ttft_seconds_bucket{le="0.5",path="pd"} 0.0
pdpool_sidecar_ttft_seconds_bucket{le="2.0",path="pd"} 0.0
pdpool_sidecar_ttft_seconds_bucket{le="+Inf",path="pd"} 50.0
# TYPE pdpool_sidecar_phase_seconds histogram
pdpool_sidecar_phase_seconds_bucket{le="0.5",phase="decode_first_token"} 10.0
pdpool_sidecar_phase_seconds_bucket{le="2.0",phase="decode_first_token"} 10.0
pdpool_sidecar_phase_seconds_bucket{le="+Inf",phase="decode_first_token"} 10.0
pdpool_sidecar_phase_seconds_bucket{le="0.5",phase="prefill"} 0.0
pdpool_sidecar_phase_seconds_bucket{le="2.0",phase="prefill"} 0.0
pdpool_sidecar_phase_seconds_bucket{le="+Inf",phase="prefill"} 30.0
"""


def test_decode_first_token_time_comes_from_the_sidecars_decode_share_only():
    """Requests decode served alone and P/D decode legs count; whole P/D requests (their
    prefill leg included) and prefill phases do not."""
    assert buckets(parse_text(SIDECAR), "pdpool_sidecar_ttft_seconds", path="decode") == {
        0.5: 1.0,
        2.0: 10.0,
        math.inf: 10.0,
    }
    now = Snapshot(10.0, (EndpointMetrics("sidecar", "s0", parse_text(SIDECAR)),))
    sig = signals(Snapshot(0.0, ()), now)
    # 20 observations: 11 under 0.5 s, 9 in (0.5, 2]: p90 = 0.5 + 1.5 * (18 - 11) / 9.
    assert sig.pool.decode_ttft_p90 == pytest.approx(0.5 + 1.5 * 7 / 9, rel=1e-9)  # rounding only
