"""What each role saw between two snapshots: the planner's inputs.

Latencies are p90 over the window's observations (the histogram buckets' deltas, every
engine of the role merged), so one slow request does not scale a pool but a tenth of them
do. Gauges (running, waiting, KV usage) are taken at the newer snapshot."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from .metrics import (
    EndpointMetrics,
    Snapshot,
    bucket_delta,
    buckets,
    counter_delta,
    merge_buckets,
    quantile,
    total,
)

TTFT = "vllm:time_to_first_token_seconds"
# vLLM >= 0.10 name first; older engines export the same histogram as time_per_output_token.
ITL_NAMES = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
PREFILL_LEG = "pdpool_sidecar_prefill_leg_seconds"
# The decode engines' share of the client's first token, seen by the sidecars (queueing
# included, which some engines leave out of their own TTFT): requests decode served alone,
# and the decode leg of P/D requests until its first bytes.
DECODE_FIRST_BYTES = (
    ("pdpool_sidecar_ttft_seconds", {"path": "decode"}),
    ("pdpool_sidecar_phase_seconds", {"phase": "decode_first_token"}),
)
QUANTILE = 0.9


@dataclass(frozen=True)
class RoleSignals:
    engines: int  # engines of the role that answered the scrape
    running: float
    waiting: float
    kv_usage: float  # mean over the role's engines, 0..1
    ttft_p90: Optional[float]  # seconds; None: no first token in the window
    itl_p90: Optional[float]
    requests: float  # first tokens observed in the window
    prompt_tokens_per_s: float
    generation_tokens_per_s: float

    @property
    def idle(self) -> bool:
        return self.requests == 0 and self.running == 0 and self.waiting == 0

    def as_dict(self) -> dict[str, Any]:
        return {k: _rounded(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class PoolSignals:
    """The sidecars' view: P/D legs and what could not be prefilled elsewhere."""

    prefill_legs: float  # prefill legs run in the window
    threshold_rejections: float  # decode refused to prefill a prompt itself
    prefill_unserved: float  # legs with no prefill engine to go to (scale from zero)
    prefill_leg_p90: Optional[float]
    decode_ttft_p90: Optional[float] = None  # DECODE_FIRST_BYTES

    def as_dict(self) -> dict[str, Any]:
        return {k: _rounded(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Signals:
    prefill: RoleSignals
    decode: RoleSignals
    pool: PoolSignals
    window_s: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "windowSeconds": round(self.window_s, 3),
            "prefill": self.prefill.as_dict(),
            "decode": self.decode.as_dict(),
            "sidecars": self.pool.as_dict(),
        }


def _rounded(v: object) -> object:
    return round(v, 4) if isinstance(v, float) else v


def _previous(before: Optional[Snapshot], cur: EndpointMetrics) -> Optional[EndpointMetrics]:
    if before is None:
        return None
    for e in before.endpoints:
        if e.endpoint == cur.endpoint and e.role == cur.role:
            return e
    return None


def _counter_growth(before: Optional[Snapshot], engines: list[EndpointMetrics], name: str) -> float:
    grown = 0.0
    for e in engines:
        prev = _previous(before, e)
        grown += counter_delta(total(e.samples, name), total(prev.samples, name) if prev else None)
    return grown


def _window_buckets(
    before: Optional[Snapshot], engines: list[EndpointMetrics], name: str, **match: str
) -> dict[float, float]:
    parts = []
    for e in engines:
        prev = _previous(before, e)
        was = buckets(prev.samples, name, **match) if prev else None
        parts.append(bucket_delta(buckets(e.samples, name, **match), was))
    return merge_buckets(parts)


def _itl_buckets(before: Optional[Snapshot], engines: list[EndpointMetrics]) -> dict[float, float]:
    for name in ITL_NAMES:
        window = _window_buckets(before, engines, name)
        if window:
            return window
    return {}


def role_signals(before: Optional[Snapshot], now: Snapshot, role: str) -> RoleSignals:
    engines = now.role(role)
    window_s = max(now.at - before.at, 1e-9) if before else 0.0
    ttft = _window_buckets(before, engines, TTFT)
    itl = _itl_buckets(before, engines)
    requests = max(ttft.values(), default=0.0)

    def rate(name: str) -> float:
        return _counter_growth(before, engines, name) / window_s if window_s else 0.0

    usage = [total(e.samples, "vllm:kv_cache_usage_perc") for e in engines]
    return RoleSignals(
        engines=len(engines),
        running=sum(total(e.samples, "vllm:num_requests_running") for e in engines),
        waiting=sum(total(e.samples, "vllm:num_requests_waiting") for e in engines),
        kv_usage=sum(usage) / len(usage) if usage else 0.0,
        ttft_p90=quantile(QUANTILE, ttft),
        itl_p90=quantile(QUANTILE, itl),
        requests=requests,
        prompt_tokens_per_s=rate("vllm:prompt_tokens"),
        generation_tokens_per_s=rate("vllm:generation_tokens"),
    )


def pool_signals(before: Optional[Snapshot], now: Snapshot) -> PoolSignals:
    sidecars = now.role("sidecar")
    unserved = 0.0
    for e in sidecars:
        prev = _previous(before, e)
        for outcome in ("no_endpoint",):
            name = "pdpool_sidecar_prefill_attempts"
            was = total(prev.samples, name, outcome=outcome) if prev else None
            unserved += counter_delta(total(e.samples, name, outcome=outcome), was)
    legs = 0.0
    for e in sidecars:
        prev = _previous(before, e)
        name = "pdpool_sidecar_legs"
        was = total(prev.samples, name, leg="prefill") if prev else None
        legs += counter_delta(total(e.samples, name, leg="prefill"), was)
    return PoolSignals(
        prefill_legs=legs,
        threshold_rejections=_counter_growth(
            before, sidecars, "pdpool_sidecar_threshold_rejections"
        ),
        prefill_unserved=unserved,
        prefill_leg_p90=quantile(QUANTILE, _window_buckets(before, sidecars, PREFILL_LEG)),
        decode_ttft_p90=quantile(
            QUANTILE,
            merge_buckets(
                _window_buckets(before, sidecars, name, **match)
                for name, match in DECODE_FIRST_BYTES
            ),
        ),
    )


def signals(before: Optional[Snapshot], now: Snapshot) -> Signals:
    """The planner's inputs for the window (before, now]; before None: the first scrape,
    whose counters count since each process started."""
    return Signals(
        prefill=role_signals(before, now, "prefill"),
        decode=role_signals(before, now, "decode"),
        pool=pool_signals(before, now),
        window_s=now.at - before.at if before else 0.0,
    )
