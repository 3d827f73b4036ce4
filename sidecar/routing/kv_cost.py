"""Precise KV-aware routing: the KV index's costs (kv/costs.py) composed with the routing
plugins, in four steps that `KVRouter.decide` runs in turn:

    score    what each engine would compute of the prompt (KVCosts.costs)
    pick     plugins.precise_profile: the healthy engines by cost + load, ties in the
             affinity order, the unhealthy ones last
    P/D      pd.PrefixHitDecider on the chosen engine's hit (the one P/D decision module)
    expect   the prompt's blocks pending on the chosen engine (KVCosts.expect)

`KVRouting` is a front-end's use of it (the gateway's and the EPP's decode set): the router
fed by the decode engines' KV events (static endpoints or, with an events port, whatever
discovery lists through kv/feeds.py), the prompt's token ids (the router's own tokenizer,
else the front-end's `EngineTokenize`: a decode engine's /tokenize), and the affinity
order reordered by cost, with the P/D path the sidecar should take. Routing never fails a
request: on any trouble the affinity order stands. The sidecar's prefill ranking uses the
same router over the prefill engines (prefill_ranking.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional, Sequence

from ..kv.costs import TIER_COST, KVCosts
from ..kv.feeds import subscribe_all
from ..net.metrics import GatewayMetrics, KVBlocksCollector
from .pd import PrefixHitDecider
from .plugins import precise_profile

if TYPE_CHECKING:
    from .settings import RoutingSettings

log = logging.getLogger("pdpool.routing")

# (request body, backends in preference order, the request's headers) -> prompt ids or None.
EngineTokenize = Callable[[Any, list[str], dict[str, str]], Awaitable[Optional[list[int]]]]


@dataclass
class RouteDecision:
    order: list[str]
    hit_tokens: int  # predicted cached tokens on order[0]
    prompt_tokens: int
    path: str  # "pd" or "decode"
    precise: bool  # False: no engine known, affinity order kept

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class KVRouter(KVCosts):
    def __init__(
        self,
        block_size: int,
        threshold: float = 0.0,
        load_cost_tokens: float = 64.0,
        tokenizer_file: Optional[str] = None,
        max_blocks_per_engine: int = 1_000_000,
        expect_s: float = 5.0,
        tier_cost: float = TIER_COST,
    ):
        super().__init__(block_size, tokenizer_file, max_blocks_per_engine, expect_s, tier_cost)
        self.decider = PrefixHitDecider(threshold)
        self.load_cost_tokens = load_cost_tokens

    @property
    def threshold(self) -> float:
        return self.decider.threshold

    def decide(
        self,
        order: Sequence[str],
        token_ids: Sequence[int],
        load: Callable[[str], float],
        cache_salt: Optional[str] = None,
        healthy: Callable[[str], bool] = lambda b: True,
        model: Optional[str] = None,
        extra_cost: Optional[Callable[[str], float]] = None,
    ) -> RouteDecision:
        """Reorders `order` (today's affinity order) by cost; unhealthy backends stay last.
        `extra_cost`: more cost per backend, in tokens (an adapter not loaded there)."""
        costs = self.costs(order, token_ids, cache_salt, model)
        n = costs.prompt_tokens
        if not costs.known:
            return RouteDecision(list(order), 0, n, "decode", False)
        profile = precise_profile(costs, load, self.load_cost_tokens, healthy, extra_cost)
        ranked = profile.order(order)
        best = costs.hits[ranked[0]]
        path = self.decider.decide(best, n)
        self.expect(ranked[0], costs)
        return RouteDecision(ranked, best, n, path, True)

    async def decide_async(
        self, order: Sequence[str], token_ids: Sequence[int], *args: Any
    ) -> RouteDecision:
        """`decide`, off the event loop for a long prompt (it hashes every block)."""
        return await self.off_loop_if_long(len(token_ids), self.decide, order, token_ids, *args)

    async def decide_request(
        self,
        body: dict[str, Any],
        token_ids: Sequence[int],
        order: Sequence[str],
        load: Callable[[str], float],
        healthy: Callable[[str], bool] = lambda b: True,
        extra_cost: Optional[Callable[[str], float]] = None,
    ) -> RouteDecision:
        """`decide_async` for a request body: its cache_salt and model count."""
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        model = body.get("model") if isinstance(body.get("model"), str) else None
        return await self.decide_async(order, token_ids, load, salt, healthy, model, extra_cost)


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
        metrics.registry.register(
            KVBlocksCollector(
                "pdpool_gateway_kv_blocks",
                "Blocks each backend's engine holds, as its KV events told the gateway",
                "backend",
                self.router.index.block_counts,
            )
        )
        # The feeds follow the decode Service (None without --kv-events-port).
        self.feeds = subscribe_all(
            self.router, s.kv_events, s.kv_events_port, s.kv_events_replay_port
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
            d = await self.router.decide_request(
                body, ids, order, self.load, self.healthy, extra_cost
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
