"""Flow control's metrics, per tenant and priority band (`pdpool_flow_*`), registered on
the front-end's registry so they appear in its /metrics."""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..net.metrics import Children

# Queue waits: none at all (admitted at once) up to a long TTL.
WAIT_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class FlowMetrics:
    def __init__(self, registry: Optional[CollectorRegistry] = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.queue_length = Children(
            Gauge(
                "pdpool_flow_queue_length",
                "Requests waiting for admission",
                ["tenant", "band"],
                registry=r,
            )
        )
        self.wait_seconds = Children(
            Histogram(
                "pdpool_flow_queue_wait_seconds",
                "Time from arrival to admission (0 when admitted at once)",
                ["tenant", "band"],
                buckets=WAIT_BUCKETS,
                registry=r,
            )
        )
        self.admitted = Children(
            Counter("pdpool_flow_admitted", "Requests admitted", ["tenant", "band"], registry=r)
        )
        # reason: queue_full, queue_timeout, tokens_per_minute, displaced (made room for a
        # higher band). Every one of them was answered 429.
        self.shed = Children(
            Counter(
                "pdpool_flow_shed",
                "Requests refused with 429, by reason",
                ["tenant", "band", "reason"],
                registry=r,
            )
        )
        self.abandoned = Children(
            Counter(
                "pdpool_flow_abandoned",
                "Requests whose client left while they waited",
                ["tenant", "band"],
                registry=r,
            )
        )
        self.in_flight = Children(
            Gauge("pdpool_flow_in_flight", "Admitted requests not finished", ["tenant"], registry=r)
        )
        # The pending view's bound: the file's maxInFlightPerBackend x backends, else the
        # engines' learned limits summed (concurrency_limit.py); 0: none yet.
        self.concurrency_limit = Gauge(
            "pdpool_flow_concurrency_limit",
            "Requests the pool's engines are let hold at once (0: no bound)",
            registry=r,
        )
        self.saturated = Gauge(
            "pdpool_flow_pool_saturated",
            "The pool's saturation: 0 room, 1 full (pending bound), 2 engines saturated",
            registry=r,
        )
