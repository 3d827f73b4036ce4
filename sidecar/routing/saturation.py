"""Whether the pool can take one more request now, from what the engines themselves report.

Two views:
- the engines' own metrics (vLLM's names): an engine is saturated when its
  `vllm:num_requests_waiting` reaches the queue-depth threshold or its
  `vllm:kv_cache_usage_perc` the KV threshold (GIE's saturation detector, same defaults);
  the pool is saturated when every healthy engine with fresh metrics is, and every healthy
  engine has them. They are read through each decode sidecar's `/metrics/engine`
  (its engine's `/metrics`, passed through) every `interval_s`. This is HARD: nothing more
  is admitted until an engine drains;
- the router's pending view: the requests admitted and not yet finished, against the bound
  `maxInFlightPerBackend` times the healthy backends. It moves at once, where scraped
  metrics lag a burst by up to one interval. At the bound the pool is FULL: only a tenant
  below its weighted share of the bound is admitted (flow_control.py), so a tenant that
  took the whole pool while alone cannot make a newcomer wait for its requests to end.
No healthy backend: not saturated (the front-end answers 503 as it would without flow
control, rather than queueing for a pool that is not there).
No HTTP here: the front-end hands in `fetch(backend) -> text or None`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

from .tenants import PoolLimits

log = logging.getLogger("pdpool.flow")

# A decode sidecar's passthrough of its engine's /metrics (its own /metrics is the sidecar's).
ENGINE_METRICS_PATH = "/metrics/engine"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"

Fetch = Callable[[str], Awaitable[Optional[str]]]
ROOM, FULL, HARD = 0, 1, 2  # saturation levels


@dataclass(frozen=True)
class EngineLoad:
    waiting: float
    kv_usage: float
    at: float

    def saturated(self, limits: PoolLimits) -> bool:
        return (
            self.waiting >= limits.queue_depth_threshold
            or self.kv_usage >= limits.kv_cache_usage_threshold
        )


def engine_load(text: str, at: float) -> Optional[EngineLoad]:
    """The two gauges from Prometheus text (summed over their series); None when absent.
    A line scan: the full parser costs far more on a page of histograms."""
    waiting: Optional[float] = None
    kv: Optional[float] = None
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{") if "{" in line else line.partition(" ")
        value = rest.rsplit(" ", 1)[-1] if "{" in line else rest
        try:
            number = float(value)
        except ValueError:
            continue
        if name == WAITING:
            waiting = (waiting or 0.0) + number
        elif name == KV_USAGE:
            kv = max(kv or 0.0, number)
    if waiting is None and kv is None:
        return None
    return EngineLoad(waiting or 0.0, kv or 0.0, at)


class Saturation:
    def __init__(
        self,
        healthy_backends: Callable[[], list[str]],
        fetch: Optional[Fetch] = None,
        interval_s: float = 0.25,
        staleness_s: float = 2.0,
        on_change: Optional[Callable[[], None]] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.healthy_backends, self.fetch = healthy_backends, fetch
        self.interval_s, self.staleness_s, self.clock = interval_s, staleness_s, clock
        self.on_change = on_change
        self.loads: dict[str, EngineLoad] = {}
        self._task: Optional[asyncio.Task[None]] = None

    def level(self, admitted: int, limits: PoolLimits) -> int:
        """ROOM, FULL (the pending view's bound) or HARD (the engines report saturation)."""
        healthy = self.healthy_backends()
        if not healthy:
            return ROOM
        if self.engines_saturated(healthy, limits):
            return HARD
        bound = limits.max_in_flight_per_backend * len(healthy)
        return FULL if bound and admitted >= bound else ROOM

    def bound(self, limits: PoolLimits) -> int:
        """The pending view's bound: admitted requests the healthy backends take (0: none)."""
        return limits.max_in_flight_per_backend * len(self.healthy_backends())

    def saturated(self, admitted: int, limits: PoolLimits) -> bool:
        return self.level(admitted, limits) != ROOM

    def engines_saturated(self, healthy: list[str], limits: PoolLimits) -> bool:
        now = self.clock()
        for backend in healthy:
            load = self.loads.get(backend)
            if load is None or now - load.at > self.staleness_s or not load.saturated(limits):
                return False
        return True

    async def scrape_once(self) -> None:
        if self.fetch is None:
            return
        fetch = self.fetch
        backends = self.healthy_backends()
        texts = await asyncio.gather(*(fetch(b) for b in backends), return_exceptions=True)
        now = self.clock()
        for backend, text in zip(backends, texts, strict=True):
            load = engine_load(text, now) if isinstance(text, str) else None
            if load is not None:
                self.loads[backend] = load
        for gone in set(self.loads) - set(backends):
            del self.loads[gone]
        if self.on_change is not None:
            self.on_change()  # a drained engine frees queued requests without a release

    async def start(self) -> None:
        if self.fetch is not None and self._task is None:
            self._task = asyncio.create_task(self._forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _forever(self) -> None:
        while True:
            try:
                await self.scrape_once()
            except Exception:  # a scrape never stops admission; the next one may work
                log.exception("engine metrics scrape failed")
            await asyncio.sleep(self.interval_s)
