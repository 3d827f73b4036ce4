"""Prometheus text -> a metrics snapshot, and the arithmetic over snapshots the planner needs
(sums across engines, counter deltas that survive restarts, quantiles of histogram deltas).

A sample is keyed by its full name (`vllm:prompt_tokens_total`, `..._bucket`) and its labels;
counters are looked up with and without `_total` (vLLM 0.32 adds it, older versions not)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
Samples = Mapping[str, Mapping[Labels, float]]


@dataclass(frozen=True)
class EndpointMetrics:
    """One scrape of one endpoint: an engine (role prefill or decode) or a sidecar."""

    role: str  # prefill, decode, sidecar
    endpoint: str  # HOST:PORT, pod name...: the identity deltas are taken per
    samples: Samples = field(default_factory=dict)


@dataclass(frozen=True)
class Snapshot:
    """Every endpoint scraped at one moment (`at`: seconds on any monotonic clock)."""

    at: float
    endpoints: tuple[EndpointMetrics, ...] = ()

    def role(self, role: str) -> list[EndpointMetrics]:
        return [e for e in self.endpoints if e.role == role]


def parse_text(text: str) -> dict[str, dict[Labels, float]]:
    """Prometheus exposition text -> {sample name: {labels: value}}; ValueError if malformed."""
    samples: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = tuple(sorted(s.labels.items()))
            samples.setdefault(s.name, {})[key] = float(s.value)
    return samples


def _series(samples: Samples, name: str) -> Mapping[Labels, float]:
    return samples.get(name) or samples.get(name + "_total") or {}


def total(samples: Samples, name: str, **match: str) -> float:
    """Sum of a gauge or counter over its series (those whose labels include `match`)."""
    return sum(
        v
        for labels, v in _series(samples, name).items()
        if all((k, want) in labels for k, want in match.items())
    )


def has(samples: Samples, name: str) -> bool:
    return bool(_series(samples, name))


def buckets(samples: Samples, histogram: str, **match: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts by upper bound, summed over its series (those
    whose labels include `match`)."""
    out: dict[float, float] = {}
    for labels, v in samples.get(histogram + "_bucket", {}).items():
        le = dict(labels).get("le")
        if le is not None and all((k, want) in labels for k, want in match.items()):
            bound = math.inf if le == "+Inf" else float(le)
            out[bound] = out.get(bound, 0.0) + v
    return out


def counter_delta(now: float, before: Optional[float]) -> float:
    """What a counter grew by; a smaller value means the process restarted (count from 0)."""
    if before is None or now < before:
        return now
    return now - before


def bucket_delta(
    now: dict[float, float], before: Optional[dict[float, float]]
) -> dict[float, float]:
    """The buckets of the observations made between two scrapes of one endpoint."""
    if not before or any(now.get(le, 0.0) < v for le, v in before.items()):
        return dict(now)  # first scrape, or a restart: everything counted is new
    return {le: v - before.get(le, 0.0) for le, v in now.items()}


def merge_buckets(parts: Iterable[dict[float, float]]) -> dict[float, float]:
    out: dict[float, float] = {}
    for part in parts:
        for le, v in part.items():
            out[le] = out.get(le, 0.0) + v
    return out


def quantile(q: float, cumulative: dict[float, float]) -> Optional[float]:
    """Prometheus' histogram_quantile over cumulative buckets (linear within a bucket);
    None without observations. A quantile in the +Inf bucket is the last finite bound."""
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] <= 0:
        return None
    rank = q * cumulative[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = cumulative[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower
