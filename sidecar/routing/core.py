"""The routing core: which decode backend serves a request, and which backends are fit to.

It owns the decode set (an EndpointPool, pool.py: discovery, each backend's in-flight
count, health and ejection by outlier.py), prefix affinity (affinity.py), LoRA adapter
residency (lora_affinity.py) and precise KV-aware routing with the up-front P/D decision
(kv_cost.py, pd.py). No HTTP or gRPC
here: the front-ends (the HTTP gateway and the ext_proc endpoint picker) do the talking,
hand this core what they see (probe results, failed and served requests) and ask it for a
`Route`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

from pdpool import tracing

from ..net.discovery import EndpointSet
from ..net.metrics import GatewayMetrics
from .affinity import HashRing, affinity_key, route_order
from .kv_cost import EngineTokenize, KVRouting
from .lora_affinity import Fetch, LoraResidency, adapter_cost, adapter_order, residency
from .outlier import OutlierDetector, endpoint_fault
from .pool import EndpointPool
from .pd import PD_HEADER
from .settings import RoutingSettings

log = logging.getLogger("pdpool.routing")

# PD_HEADER: the header that tells a decode sidecar which P/D path was chosen.
__all__ = ["PD_HEADER", "Route", "Routing"]


@dataclass(frozen=True)
class Route:
    """Backends to try, best first; whether the first is the prompt's affinity owner; the
    P/D path for the sidecar (None: its own decode-first decision) and the predicted hit."""

    order: list[str]
    preferred: bool
    pd_path: Optional[str] = None
    hit_ratio: Optional[float] = None


class Routing:
    def __init__(self, settings: RoutingSettings, metrics: GatewayMetrics) -> None:
        settings.validate_routing()
        self.settings, self.metrics = settings, metrics
        self.pool = EndpointPool(
            EndpointSet(settings.decode_urls, settings.decode_service, settings.refresh_s),
            OutlierDetector(
                consecutive_failures=settings.outlier_failures,
                probe_failures=1,
                base_ejection_s=settings.ejection_s,
                on_eject=self._on_eject,
                on_readmit=self._on_readmit,
            ),
            on_load=self._on_load,
            on_mark=self._on_mark,
        )
        # The pool's parts, under the names the front-ends (and tests) read.
        self.backends, self.outliers = self.pool.endpoints, self.pool.outliers
        self.unhealthy = self.pool.unhealthy
        self._ring = HashRing([])
        self.kv = (
            KVRouting(settings, metrics, load=self.load, healthy=self.healthy)
            if settings.kv_routing
            else None
        )
        self._health_task: Optional[asyncio.Task[None]] = None
        self.lora = (
            LoraResidency(self.healthy_backends, settings.lora_scrape_interval_s)
            if settings.lora_affinity
            else None
        )

    # ------------------------------------------------------------------ lifecycle
    async def start(
        self,
        probe: Callable[[str], Awaitable[bool]],
        engine_tokenize: Optional[EngineTokenize] = None,
        engine_metrics: Optional[Fetch] = None,
    ) -> None:
        """Discovers the backends, probes them once, then keeps probing in the background
        with `probe` (the front-end's readiness check: True when the backend is fit);
        reads their engines' LoRA series through `engine_metrics` (backend -> its engine's
        Prometheus text, or None)."""
        self._probe = probe
        if self.kv is not None:
            self.kv.engine_tokenize = engine_tokenize
        await self.pool.start()
        await self.check_health()
        if self.kv is not None:
            await self.kv.follow(self.backends.current)
        self._health_task = asyncio.create_task(self._health_forever())
        if self.lora is not None:
            await self.lora.start(engine_metrics)

    async def stop(self) -> None:
        if self.lora is not None:
            await self.lora.stop()
        if self._health_task:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        await self.pool.stop()
        if self.kv is not None:
            self.kv.close()

    # ------------------------------------------------------------------ health
    def load(self, backend: str) -> int:
        return self.pool.load(backend)

    def healthy(self, backend: str) -> bool:
        return self.pool.healthy(backend)

    def healthy_backends(self) -> list[str]:
        return self.pool.healthy_endpoints()

    def others_healthy(self, backend: str) -> bool:
        return any(b != backend and b not in self.unhealthy for b in self.backends.current)

    async def check_health(self) -> None:
        await self.pool.probe_all(self._probe)

    async def _health_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            await self.check_health()
            if self.kv is not None:  # the decode set may have changed
                await self.kv.follow(self.backends.current)

    def mark(self, backend: str, ok: bool) -> None:
        """A probe's result: a failure ejects at once; success readmits once the
        ejection time has passed."""
        self.pool.mark(backend, ok)

    def _on_mark(self, backend: str) -> None:
        self.metrics.healthy.labels(backend).set(0 if backend in self.unhealthy else 1)
        # Every backend has its 0/1 series from its first probe on (not only once ejected).
        self.metrics.ejected.labels(backend).set(1 if self.outliers.is_ejected(backend) else 0)

    def failed(self, backend: str, reason: str) -> None:
        """A request to `backend` failed: a refused connection ejects at once, other
        failures count towards `outlier_failures`."""
        if reason == "connect_error":
            self.outliers.eject(backend, reason)
            self.unhealthy.add(backend)
            self.metrics.healthy.labels(backend).set(0)
        else:
            self.outliers.failure(backend, reason)

    def served(self, backend: str) -> None:
        self.outliers.success(backend)

    def answered(self, backend: str, status: int) -> None:
        """`backend` answered a request with `status`: a failure only when that is its own
        fault (outlier.endpoint_fault); below 500 it served; another 5xx (a 500 the request
        may have caused) counts neither way."""
        if endpoint_fault(status):
            self.failed(backend, "server_error")
        elif status < 500:
            self.served(backend)

    def _on_eject(self, backend: str, reason: str) -> None:
        log.warning("decode backend %s ejected (%s)", backend, reason)
        tracing.moment("ejection", {"pdpool.backend": backend, "pdpool.reason": reason})
        self.unhealthy.add(backend)
        self.metrics.ejections.labels(backend, reason).inc()
        self.metrics.ejected.labels(backend).set(1)
        self.metrics.healthy.labels(backend).set(0)

    def _on_readmit(self, backend: str) -> None:
        self.unhealthy.discard(backend)
        self.metrics.ejected.labels(backend).set(0)

    # ------------------------------------------------------------------ routing
    def ring(self) -> HashRing:
        current = self.backends.current
        if sorted(set(current)) != self._ring.backends:
            self._ring = HashRing(current)
        return self._ring

    async def route(self, body: Optional[Any], headers: dict[str, str]) -> Route:
        """Where a request goes: prefix affinity by load, reordered by KV cost when the
        engines' caches are known, and for a LoRA adapter by where it is loaded (within
        the load bound; a cost beside the KV cost when that applies). `body` is a parsed
        generation request (None for any other route); `headers` are the client's (for an
        engine's /tokenize)."""
        key = affinity_key(body, self.settings.prefix_chars) if body is not None else ""
        order, preferred = route_order(
            self.ring(), key, self.load, self.healthy, self.settings.balance
        )
        if order:
            self.metrics.affinity.labels("preferred" if preferred else "spilled").inc()
        adapter = self._adapter(body)
        scores = self.lora.scores(adapter, order) if self.lora and adapter else None
        route, by_cost = Route(order, preferred), False
        if order and self.kv is not None and isinstance(body, dict):
            extra = None
            if scores is not None:
                alive = [b for b in order if self.healthy(b)]
                s = self.settings
                extra = adapter_cost(scores, alive, self.load, s.balance, s.lora_load_cost)
            choice = await self.kv.choose(body, order, headers, extra)
            if choice is not None:
                route = Route(choice.order, preferred, choice.path, choice.hit_ratio)
                by_cost = True  # the adapter's cost is in it
        if scores is not None and not by_cost:
            reordered = adapter_order(order, scores, self.load, self.healthy, self.settings.balance)
            route = Route(reordered, preferred and reordered[:1] == order[:1])
        if scores is not None and adapter is not None and self.lora is not None and route.order:
            self.metrics.lora_routes.labels(residency(scores[route.order[0]])).inc()
            self.lora.routed(route.order[0], adapter)
        return route

    def _adapter(self, body: Optional[Any]) -> Optional[str]:
        """The request's `model` when residency routing applies to it (a LoRA adapter)."""
        model = body.get("model") if isinstance(body, dict) else None
        if self.lora is None or not isinstance(model, str) or not self.lora.applies(model):
            return None
        return model

    def next_backend(self, order: list[str], failed: list[str]) -> str:
        """Healthy backends not yet failed first (in the request's order), then the rest:
        a lone decode path that restarts is tried again."""
        ranked = sorted(order, key=lambda b: (b in self.unhealthy, failed.count(b)))
        return ranked[0]

    def tracked(self, backend: str) -> contextlib.AbstractContextManager[None]:
        """Counts a request in flight on `backend` for as long as the block runs."""
        return self.pool.tracked(backend)

    def _on_load(self, backend: str, change: int) -> None:
        self.metrics.in_flight.labels(backend).inc(change)
