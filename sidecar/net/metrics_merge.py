"""One /metrics for several worker processes (net/workers.py): their expositions summed.

Counters and histograms add up; `_created` timestamps take the earliest; gauges add up
(requests in flight), except those that describe one shared thing each worker sees alike,
which take the largest value (the engine's capability: -1 unknown below 0 and 1 known; an
ejected prefill engine: 1 when any worker ejected it), or the smallest (the blocks the
workers' KV indexes know: what every worker knows, so an engine one worker does not list,
not subscribed to or not trusted there, reads 0). Pure: text in, text out."""

from __future__ import annotations

from typing import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

MAX_GAUGES = frozenset({"pdpool_sidecar_engine_rejects", "pdpool_sidecar_prefill_ejected"})
# Each worker follows the same engines' events on its own: what every one of them knows.
MIN_GAUGES = frozenset({"pdpool_sidecar_prefill_kv_blocks"})

_SampleKey = tuple[str, tuple[tuple[str, str], ...]]


class _Families:
    """A collector that yields the merged families (generate_latest formats them exactly as
    a single process's registry would be)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def merge_expositions(texts: Iterable[str]) -> bytes:
    """The Prometheus text exposition of the workers' metrics taken together."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[_SampleKey, float]] = {}
    reported: dict[str, int] = {}  # family: how many workers' expositions have it
    seen: dict[_SampleKey, int] = {}  # sample: in how many of them
    for text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type)
            )
            reported[family.name] = reported.get(family.name, 0) + 1
            into = values.setdefault(family.name, {})
            for sample in family.samples:
                key = (sample.name, tuple(sample.labels.items()))
                seen[key] = seen.get(key, 0) + 1
                if key in into:
                    into[key] = _combine(family.name, merged.type, into[key], sample.value)
                else:
                    into[key] = sample.value
    for name in MIN_GAUGES & reported.keys():
        for key in values[name]:
            if seen[key] < reported[name]:  # a worker without it knows none of it
                values[name][key] = min(values[name][key], 0.0)
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))  # type: ignore[arg-type]
    return generate_latest(registry)


def _combine(family: str, kind: str, a: float, b: float) -> float:
    if family.endswith("_created"):
        return min(a, b)
    if kind == "gauge" and family in MAX_GAUGES:
        return max(a, b)
    if kind == "gauge" and family in MIN_GAUGES:
        return min(a, b)
    return a + b
