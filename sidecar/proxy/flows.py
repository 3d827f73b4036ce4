"""The P/D flows: which legs one generation request runs, in which order.

    decode-first   try decode with the cache-hit threshold; on `cache_threshold` run the
                   prefill leg remotely (pulling decode's cached prefix), then decode.
                   For an engine that cannot reject: decided by prompt length.
    prefill-first  always prefill remotely first, then decode.
    aggregated     pass through to the decode engine.

A completion with a batch of prompts goes aggregated whatever the mode: one request's KV
handoff carries one prompt.

Whatever the path, a request that some path can still serve is served: when no prefill
engine answers, the decode engine prefills itself (threshold 0). The legs' bodies are
built in legs.py; prefill legs run in prefill_legs.py, decode legs in relay.py.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any, Awaitable, Callable, Optional

from . import legs
from .capability import EngineCapability
from .exchange import Exchange
from ..routing.pd import PD_HEADER, DecodeFirstDecider
from ..net.metrics import SidecarMetrics
from .prefill_legs import PrefillLegs
from .relay import DecodeRelay, relay_buffered
from .settings import SidecarSettings
from .usage import count_computed

Flow = Callable[[Exchange], Awaitable[None]]


@dataclass(eq=False)
class Flows:
    settings: SidecarSettings
    metrics: SidecarMetrics
    _: KW_ONLY
    capability: EngineCapability
    decode: DecodeRelay
    prefill: PrefillLegs

    def for_mode(self, mode: str) -> Flow:
        return {
            "decode-first": self.decode_first,
            "prefill-first": self.prefill_first,
            "aggregated": self.aggregated,
        }[mode]

    async def aggregated(self, ex: Exchange) -> None:
        ex.path_taken = "aggregated"
        self.metrics.legs_by("aggregated").inc()
        await self.decode.final(ex, legs.aggregated_leg(ex.body))

    async def prefill_first(self, ex: Exchange) -> None:
        if legs.served_where_it_lands(ex.body):
            return await self.aggregated(ex)
        await self._remote_prefill_then_decode(ex, pull=None)

    async def decode_first(self, ex: Exchange) -> None:
        # The gateway's precise router may have decided the path already from the engines'
        # KV events: "pd" skips the decode-first attempt. The decision is routing/pd.py's;
        # here its steps are run and counted. Only what is known of the engine now counts:
        # a request never waits for the capability probe.
        hint = ex.headers.pop(PD_HEADER, None)
        if hint and ex.span is not None:
            ex.span.set_attribute("pdpool.kv_path_hint", hint)
        if legs.served_where_it_lands(ex.body):
            return await self.aggregated(ex)
        decider = DecodeFirstDecider(self.settings.prefill_min_prompt_tokens)
        decided = decider.decide(hint, self.capability.known, ex.body)
        if decided.step == "pd":
            if decided.by == "router":
                self.metrics.kv_path_hints.labels("pd", "honoured").inc()
            else:
                self.metrics.length_decisions_by("pd").inc()
            return await self._remote_prefill_then_decode(ex, pull=None)
        if decided.step == "decode":  # an engine that cannot reject, a short prompt
            self.metrics.length_decisions_by("decode").inc()
            ex.path_taken = "decode"
            return await self.decode.final(ex, legs.aggregated_leg(ex.body))
        self.metrics.legs_by("decode_first").inc()
        rejection = await self.decode.first(
            ex, legs.decode_first_leg(ex.body, self.settings.cache_hit_threshold)
        )
        if hint == "decode":  # a rejection is a misprediction of the gateway's index
            self.metrics.kv_path_hints.labels(
                "decode", "correct" if rejection is None else "mispredicted"
            ).inc()
        if rejection is None:
            return
        self.metrics.rejections.inc()
        await self._remote_prefill_then_decode(ex, self._pull_params(ex, rejection))

    def _pull_params(self, ex: Exchange, rejection: dict[str, Any]) -> Optional[dict[str, Any]]:
        """What the prefill leg may pull of decode's cached prefix; when nothing, decode's
        lease on that prefix is ended now."""
        pull = (
            legs.pull_params_from_rejection(rejection, self.settings.kv_pull_threshold)
            if self.settings.pull_from_decode
            else None
        )
        if pull is None and isinstance(rejection, dict) and rejection.get("pdpool_lease"):
            self.prefill.release_decode_lease(
                rejection, ex.span
            )  # decode's prefix will not be pulled
        return pull

    async def _remote_prefill_then_decode(
        self, ex: Exchange, pull: Optional[dict[str, Any]]
    ) -> None:
        if pull:
            self.metrics.pull_offered_tokens.inc(int(pull.get("remote_num_tokens") or 0))
        result = await self.prefill.run(ex, legs.prefill_leg(ex.body, pull))
        if pull:
            # Whatever the prefill leg did, it no longer reads decode's prefix: end the
            # lease now instead of holding those blocks until it expires.
            self.prefill.release_decode_lease(pull, ex.span)
        if result.client_error:
            ex.path_taken = "client_error"
            status, content = result.client_error
            return await relay_buffered(ex, status, content, "application/json")
        if result.kv is None:
            ex.path_taken = "fallback"
            ex.prefill_usage = None
        else:
            ex.path_taken = "pd"
            ex.prefill_usage = result.usage
            count_computed(self.metrics, "prefill", result.usage)
        await self.decode.final(ex, legs.decode_leg(ex.body, result.kv))
