"""Which prefill engine a prefill leg goes to first.

With the prefill engines' KV events (`prefill_kv_events`), the one that would have the
least left to compute: most of the prompt already cached, weighed against the legs in flight
on it (`KVRouter.decide`'s cost). Without them, or for a prompt the router cannot tokenize,
the least loaded (`LoadPicker`). A target the request names itself (a trusted
x-prefiller-host-port) always goes first.

The events come from fixed endpoints (`events`), or follow the prefill endpoint set:
`events_port` names the port every prefill engine publishes on, and `sync` keeps one
subscription per engine the set lists (kv/feeds.py).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional, Sequence

from .picker import LoadPicker

log = logging.getLogger(__name__)


class PrefillRanking:
    def __init__(
        self,
        picker: LoadPicker,
        events: dict[str, str],
        block_size: int,
        tokenizer_file: Optional[str] = None,
        load_cost_tokens: float = 64.0,
        events_port: Optional[int] = None,
        events_replay_port: Optional[int] = None,
    ):
        self.picker = picker
        self.router = None
        self.feeds = None
        if events or events_port:
            from ..kv.events_spec import split_spec
            from ..kv.router import KVRouter
            from ..net.security import normalize_host_port

            self.router = KVRouter(block_size, 0.0, load_cost_tokens, tokenizer_file)
            static = {normalize_host_port(t): spec for t, spec in events.items()}
            for target, spec in static.items():
                self.router.subscribe(target, *split_spec(spec))
            if events_port:
                from ..kv.feeds import KVFeeds

                self.feeds = KVFeeds(self.router, events_port, events_replay_port, static)

    async def sync(self, endpoints: Iterable[str]) -> None:
        """Follows the prefill endpoint set (with `events_port`); cheap when it did not
        change, and never raises."""
        if self.feeds is not None:
            await self.feeds.refresh(endpoints)

    async def order(
        self, available: Sequence[str], preferred: Optional[str], body: Any
    ) -> tuple[list[str], str]:
        """(endpoints to try in order, how they were ranked: "kv", "load" or "named")."""
        by_load = self.picker.order(available, preferred=preferred)
        if preferred or self.router is None or len(by_load) < 2:
            return by_load, "named" if preferred else "load"
        try:
            ids = await self.router.prompt_token_ids_async(body)
            if ids is None:
                return by_load, "load"
            salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
            model = body.get("model") if isinstance(body.get("model"), str) else None
            decision = await self.router.decide_async(
                by_load, ids, self.picker.in_flight, salt, lambda b: True, model
            )
        except Exception:  # ranking must never fail a request: load order stands
            log.exception("ranking prefill engines by KV events failed")
            return by_load, "load"
        return (decision.order, "kv") if decision.precise else (by_load, "load")

    def close(self) -> None:
        if self.router is not None:
            self.router.close()
