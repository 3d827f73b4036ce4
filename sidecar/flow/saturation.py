"""Whether the pool can take one more request now, from what the engines themselves report.

Two views:
- the engines' own metrics (vLLM's names): an engine is saturated when its
  `vllm:num_requests_waiting` reaches the queue-depth threshold or its
  `vllm:kv_cache_usage_perc` the KV threshold (GIE's saturation detector, same defaults);
  the pool is saturated when every healthy engine with fresh metrics is, and every healthy
  engine has them. They are read through each decode sidecar's `/metrics/engine`
  (its engine's `/metrics`, passed through) every `interval_s`. This is HARD: nothing more
  is admitted until an engine drains;
- the router's pending view: the requests admitted and not yet finished, against the
  pool's bound. It moves at once, where scraped metrics lag a burst by up to one interval.
  At the bound the pool is FULL: only a tenant below its weighted share of the bound is
  admitted (queues.py), so a tenant that took the whole pool while alone cannot make
  a newcomer wait for its requests to end. The bound is `maxInFlightPerBackend` times the
  healthy backends when the tenants file sets it; else the sum of each engine's adaptive
  limit (concurrency_limit.py: learned from its inter-token latency, running and waiting
  requests), once every healthy engine has one (an engine without an ITL histogram: none).
No healthy backend: not saturated (the front-end answers 503 as it would without flow
control, rather than queueing for a pool that is not there).
No HTTP here: the front-end hands in `fetch(backend) -> text or None`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

from ..net.periodic import Periodic
from .concurrency_limit import AdaptiveLimit, EngineSample
from .tenants import PoolLimits

log = logging.getLogger("pdpool.flow")

# A decode sidecar's passthrough of its engine's /metrics (its own /metrics is the sidecar's).
ENGINE_METRICS_PATH = "/metrics/engine"
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
# The ITL histogram's totals; older vLLM names it time_per_output_token (used when alone).
ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")

Fetch = Callable[[str], Awaitable[Optional[str]]]
ROOM, FULL, HARD = 0, 1, 2  # saturation levels
# Requests admitted per healthy backend that may wait for their first token at once (the
# starting bound, queues.py). A few prompts share one engine step's token budget
# (vLLM's and ours default to 2048 tokens with chunked prefill): a newcomer's prefill then
# waits behind about one step of others' prefills, and a backend whose batch is full holds
# only this many in its own first-come queue (the rest wait in the fair queues here).
STARTING_PER_BACKEND = 4


@dataclass(frozen=True)
class EngineLoad:
    waiting: float
    kv_usage: float
    at: float
    running: float = 0.0
    itl_sum: Optional[float] = None  # None: no ITL histogram
    itl_count: float = 0.0

    def sample(self) -> EngineSample:
        return EngineSample(self.running, self.waiting, self.kv_usage, self.itl_sum, self.itl_count)

    def saturated(self, limits: PoolLimits) -> bool:
        return (
            self.waiting >= limits.queue_depth_threshold
            or self.kv_usage >= limits.kv_cache_usage_threshold
        )


def engine_load(text: str, at: float) -> Optional[EngineLoad]:
    """The gauges and the ITL totals from Prometheus text (summed over their series); None
    when the two gauges are absent. A line scan: the full parser costs far more on a page
    of histograms."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{") if "{" in line else line.partition(" ")
        value = rest.rsplit(" ", 1)[-1] if "{" in line else rest
        try:
            number = float(value)
        except ValueError:
            continue
        if name == KV_USAGE:
            found[name] = max(found.get(name, 0.0), number)
        elif name in _SUMMED:
            found[name] = found.get(name, 0.0) + number
    if WAITING not in found and KV_USAGE not in found:
        return None
    itl = next((n for n in ITL if n + "_count" in found), None)
    return EngineLoad(
        found.get(WAITING, 0.0),
        found.get(KV_USAGE, 0.0),
        at,
        found.get(RUNNING, 0.0),
        found.get(itl + "_sum", 0.0) if itl else None,
        found.get(itl + "_count", 0.0) if itl else 0.0,
    )


_SUMMED = {WAITING, RUNNING} | {n + s for n in ITL for s in ("_sum", "_count")}


class Saturation:
    def __init__(
        self,
        healthy_backends: Callable[[], list[str]],
        fetch: Optional[Fetch] = None,
        interval_s: float = 0.25,
        staleness_s: float = 2.0,
        on_change: Optional[Callable[[], None]] = None,
        clock: Callable[[], float] = time.monotonic,
        pool: Callable[[], PoolLimits] = PoolLimits,
    ) -> None:
        self.healthy_backends, self.fetch = healthy_backends, fetch
        self.interval_s, self.staleness_s, self.clock = interval_s, staleness_s, clock
        self.on_change, self.pool = on_change, pool
        self.loads: dict[str, EngineLoad] = {}
        self.limits: dict[str, AdaptiveLimit] = {}  # engines that export an ITL histogram
        self._scrapes = Periodic(self.scrape_once, lambda: self.interval_s, "engine metrics scrape")

    def level(self, admitted: int, limits: PoolLimits) -> int:
        """ROOM, FULL (the pending view's bound) or HARD (the engines report saturation)."""
        healthy = self.healthy_backends()
        if not healthy:
            return ROOM
        if self.engines_saturated(healthy, limits):
            return HARD
        bound = self._bound(healthy, limits)
        return FULL if bound and admitted >= bound else ROOM

    def bound(self, limits: PoolLimits) -> int:
        """The pending view's bound: admitted requests the healthy backends take (0: none)."""
        return self._bound(self.healthy_backends(), limits)

    def starting_bound(self, limits: PoolLimits) -> int:
        """Admitted requests that may be without their first token at once (0: no bound)."""
        return STARTING_PER_BACKEND * len(self.healthy_backends())

    def _bound(self, healthy: list[str], limits: PoolLimits) -> int:
        """The file's explicit bound, else the engines' learned limits summed (0, no bound,
        while a healthy engine has none: it gives no ITL, or has not been read yet)."""
        if limits.max_in_flight_per_backend:
            return limits.max_in_flight_per_backend * len(healthy)
        total = 0
        for backend in healthy:
            limit = self.limits.get(backend)
            if limit is None:
                return 0
            total += limit.value
        return total

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
        kv_threshold = self.pool().kv_cache_usage_threshold
        for backend, text in zip(backends, texts, strict=True):
            load = engine_load(text, now) if isinstance(text, str) else None
            if load is not None:
                self.loads[backend] = load
                self._learn(backend, load, kv_threshold)
        for gone in set(self.loads) - set(backends):
            del self.loads[gone]
        for gone in set(self.limits) - set(backends):
            del self.limits[gone]
        if self.on_change is not None:
            self.on_change()  # a drained engine frees queued requests without a release

    def _learn(self, backend: str, load: EngineLoad, kv_threshold: float) -> None:
        if load.itl_sum is None:
            return  # no latency to learn from: the engines' queue view alone
        limit = self.limits.get(backend)
        if limit is None:  # starts at what the engine runs now (another router's, a restart)
            limit = self.limits[backend] = AdaptiveLimit(load.running)
        limit.kv_threshold = kv_threshold
        limit.observe(load.sample())

    async def start(self) -> None:
        if self.fetch is not None:  # a failed scrape never stops admission
            self._scrapes.start()

    async def stop(self) -> None:
        await self._scrapes.stop()
