"""Precise KV-aware routing for a front-end: the router fed by the decode engines' KV events
(kv/router.py; static endpoints or, with an events port, whatever discovery lists through
kv/feeds.py), the prompt's token ids (the router's own tokenizer, else the front-end's
`EngineTokenize`: a decode engine's /tokenize), and the affinity order reordered by cost,
with the P/D path the sidecar should take. Routing never fails a request: on any trouble the
affinity order stands."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional, Sequence

from ..net.metrics import GatewayMetrics
from ..net.security import normalize_host_port
from ..kv.events_spec import split_spec
from ..kv.router import KVRouter

if TYPE_CHECKING:
    from ..kv.feeds import KVFeeds
    from .settings import RoutingSettings

log = logging.getLogger("pdpool.routing")

# (request body, backends in preference order, the request's headers) -> prompt ids or None.
EngineTokenize = Callable[[Any, list[str], dict[str, str]], Awaitable[Optional[list[int]]]]


@dataclass(frozen=True)
class KVChoice:
    """The cost order, and the P/D path the sidecar should take for the first backend."""

    order: list[str]
    path: str
    hit_ratio: float


class KVRouting:
    def __init__(
        self,
        settings: RoutingSettings,
        metrics: GatewayMetrics,
        load: Callable[[str], float],
        healthy: Callable[[str], bool],
    ) -> None:
        self.settings, self.metrics = settings, metrics
        self.load, self.healthy = load, healthy
        # Set by a front-end that can ask an engine's /tokenize (None: its own tokenizer only).
        self.engine_tokenize: Optional[EngineTokenize] = None
        s = settings
        self.router = KVRouter(s.kv_block_size, s.kv_threshold, s.kv_load_cost, s.kv_tokenizer)
        for backend, spec in s.kv_events.items():
            self.router.subscribe(normalize_host_port(backend), *split_spec(spec))
        self.feeds = self._feeds()

    def _feeds(self) -> Optional[KVFeeds]:
        """Subscriptions that follow the decode Service (None without --kv-events-port)."""
        s = self.settings
        if s.kv_events_port is None:
            return None
        from ..kv.feeds import KVFeeds

        return KVFeeds(
            self.router,
            s.kv_events_port,
            s.kv_events_replay_port,
            static=[normalize_host_port(b) for b in s.kv_events],
        )

    async def follow(self, backends: Sequence[str]) -> None:
        """Subscribes to the engines of the listed backends, and drops those that left."""
        if self.feeds is not None:
            await self.feeds.refresh(backends)

    def close(self) -> None:
        self.router.close()

    async def choose(
        self,
        body: Any,
        order: list[str],
        headers: dict[str, str],
        extra_cost: Optional[Callable[[str], float]] = None,
    ) -> Optional[KVChoice]:
        """`order` (hash affinity) reordered by cost (plus `extra_cost` per backend, in
        tokens), with the P/D path; None when the prompt's ids or the engines' caches are
        unknown (the affinity order stands)."""
        try:
            ids = await self.router.prompt_token_ids_async(body)
            if ids is None and self.settings.kv_engine_tokenize and self.engine_tokenize:
                ids = await self.engine_tokenize(body, order, headers)
            if ids is None:
                self.metrics.kv_routes.labels("affinity", "none").inc()
                return None
            salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
            model = body.get("model") if isinstance(body.get("model"), str) else None
            d = await self.router.decide_async(
                order, ids, self.load, salt, self.healthy, model, extra_cost
            )
        except Exception:  # routing must not fail a request: affinity order stands
            log.exception("kv routing failed")
            return None
        if not d.precise:
            self.metrics.kv_routes.labels("affinity", "none").inc()
            return None
        self.metrics.kv_routes.labels("precise", d.path).inc()
        self.metrics.kv_predicted_hit_ratio.observe(d.hit_ratio)
        return KVChoice(d.order, d.path, d.hit_ratio)
