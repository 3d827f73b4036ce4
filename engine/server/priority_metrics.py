"""Per-priority series of one engine (`pdpool_*` with a `priority` label): how long requests
of each priority wait in the queue and for their first token, and how many wait now.

A request's priority is any 64-bit int a client sends, so the label set is bounded: the
first MAX_PRIORITY_LABELS distinct values seen get a label of their own (behind a gateway
they are the few bands of its tenants file, as engine priorities), every later one is
counted under "other". A client cannot create unbounded series.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily

from pdpool.engine.engine_state import EngineView
from pdpool.engine.outputs import RequestOutput

MAX_PRIORITY_LABELS = 8
OTHER = "other"
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class PriorityLabels:
    """Priority -> label, at most MAX_PRIORITY_LABELS distinct ones plus "other"."""

    def __init__(self, limit: int = MAX_PRIORITY_LABELS) -> None:
        self.limit = limit
        self.seen: dict[int, str] = {}

    def __call__(self, priority: int) -> str:
        label = self.seen.get(priority)
        if label is None:
            if len(self.seen) >= self.limit:
                return OTHER
            label = self.seen[priority] = str(priority)
        return label


class PriorityMetrics:
    def __init__(
        self, registry: CollectorRegistry, view: EngineView, labels: dict[str, str]
    ) -> None:
        self.view, self.labels = view, labels
        self.label = PriorityLabels()
        names = [*labels, "priority"]
        self.queue = Histogram(
            "pdpool_request_queue_time_by_priority_seconds",
            "Time in the waiting queue (arrival to admission), by request priority.",
            names,
            buckets=_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "pdpool_time_to_first_token_by_priority_seconds",
            "Time to first token, by request priority.",
            names,
            buckets=_BUCKETS,
            registry=registry,
        )
        registry.register(self)  # the waiting gauge, read at scrape time

    def observe(self, out: RequestOutput, priority: int, first: bool, since: float) -> None:
        if first:
            self.ttft.labels(priority=self.label(priority), **self.labels).observe(since)
        phases = out.phases
        if out.finished and phases is not None and phases.admitted is not None:
            self.queue.labels(priority=self.label(priority), **self.labels).observe(
                phases.admitted - phases.arrived
            )

    def collect(self) -> Iterator[GaugeMetricFamily]:
        waiting: Counter[str] = Counter()
        for priority, n in self.view.state().waiting_by_priority.items():
            waiting[self.label(priority)] += n
        family = GaugeMetricFamily(
            "pdpool_num_requests_waiting_by_priority",
            "Requests waiting to be scheduled, by request priority.",
            labels=[*self.labels, "priority"],
        )
        # Every label seen keeps its series (0 when none waits).
        for label in [*self.label.seen.values(), *([OTHER] if OTHER in waiting else [])]:
            family.add_metric([*self.labels.values(), label], waiting[label])
        return iter([family])

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter([])  # registered unchecked: the series come and go with the labels seen
