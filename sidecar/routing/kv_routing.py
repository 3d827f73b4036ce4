"""The gateway's precise KV-aware routing: the router fed by the decode engines' KV events
(kv_router.py; static endpoints or, with an events port, whatever discovery lists through
kv_feeds.py), the prompt's token ids (the router's own tokenizer, else a decode engine's
/tokenize: engine_tokenize.py), and the affinity order reordered by cost, with the P/D path
the sidecar should take in a header. Routing never fails a request: on any trouble the
affinity order stands."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import httpx

from ..routing.engine_tokenize import token_ids_of, tokenize_body
from ..routing.kv_events_spec import split_spec
from ..routing.kv_router import PD_HEADER, KVRouter
from ..net.metrics import GatewayMetrics
from ..net.security import normalize_host_port

if TYPE_CHECKING:
    from .app import GatewaySettings
    from ..routing.kv_feeds import KVFeeds

log = logging.getLogger("pdpool.gateway")


class GatewayKVRouting:
    def __init__(
        self,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
        load: Callable[[str], float],
        healthy: Callable[[str], bool],
        scheme: str,
    ) -> None:
        self.settings, self.metrics = settings, metrics
        self.load, self.healthy, self.scheme = load, healthy, scheme
        self.client: Optional[httpx.AsyncClient] = None  # the gateway's, once it has started
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
        from ..routing.kv_feeds import KVFeeds

        return KVFeeds(
            self.router,
            s.kv_events_port,
            s.kv_events_replay_port,
            static=[normalize_host_port(b) for b in s.kv_events],
        )

    async def follow(self, backends: Sequence[str]) -> None:
        """Subscribes to the engines of the listed sidecars, and drops those that left."""
        if self.feeds is not None:
            await self.feeds.refresh(backends)

    def close(self) -> None:
        self.router.close()

    async def reorder(self, body: Any, order: list[str], headers: dict[str, str]) -> list[str]:
        """`order` (hash affinity) reordered by cost; sets the P/D path header for the
        sidecar. The affinity order when the prompt's ids or the engines' caches are unknown."""
        try:
            ids = await self.router.prompt_token_ids_async(body)
            if ids is None and self.settings.kv_engine_tokenize:
                ids = await self._engine_token_ids(body, order, headers)
            if ids is None:
                self.metrics.kv_routes.labels("affinity", "none").inc()
                return order
            salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
            d = await self.router.decide_async(order, ids, self.load, salt, self.healthy)
        except Exception:  # routing must not fail a request: affinity order stands
            log.exception("kv routing failed")
            return order
        if not d.precise:
            self.metrics.kv_routes.labels("affinity", "none").inc()
            return order
        self.metrics.kv_routes.labels("precise", d.path).inc()
        self.metrics.kv_predicted_hit_ratio.observe(d.hit_ratio)
        headers[PD_HEADER] = d.path
        return d.order

    async def _engine_token_ids(
        self, body: Any, order: list[str], headers: dict[str, str]
    ) -> Optional[list[int]]:
        """The prompt's ids from the first healthy backend's engine (its sidecar passes
        /tokenize through); None when that cannot be had in time."""
        ask = tokenize_body(body)
        backend = next((b for b in order if self.healthy(b)), None)
        if ask is None or backend is None or self.client is None:
            return None
        passed = {k: v for k, v in headers.items() if k in ("authorization", "x-request-id")}
        try:
            resp = await self.client.post(
                f"{self.scheme}://{backend}/tokenize",
                json=ask,
                headers=passed,
                timeout=self.settings.kv_tokenize_timeout_s,
            )
            ids = token_ids_of(resp.json()) if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("tokenize on %s failed: %s", backend, exc)
            ids = None
        self.metrics.kv_engine_tokenize.labels("ok" if ids is not None else "failed").inc()
        return ids
