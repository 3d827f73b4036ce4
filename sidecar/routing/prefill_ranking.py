"""Which prefill engine a prefill leg goes to first.

With the prefill engines' KV events (`prefill_kv_events`), the one that would have the
least left to compute: most of the prompt already cached, weighed against the legs in flight
on it (`KVRouter.decide`'s cost, kv_cost.py). Without them, or for a prompt the router
cannot tokenize, the least loaded (`LoadPicker`). A target the request names itself (a trusted
x-prefiller-host-port) always goes first.

The events come from fixed endpoints (`events`), or follow the prefill endpoint set:
`events_port` names the port every prefill engine publishes on, and `sync` keeps one
subscription per engine the set lists (kv/feeds.py).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional, Sequence

from ..kv.feeds import KVFeeds, subscribe_all
from .kv_cost import KVRouter
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
        self.router: Optional[KVRouter] = None
        self.feeds: Optional[KVFeeds] = None
        if events or events_port:
            self.router = KVRouter(block_size, 0.0, load_cost_tokens, tokenizer_file)
            self.feeds = subscribe_all(self.router, events, events_port, events_replay_port)

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
            decision = await self.router.decide_request(body, ids, by_load, self.picker.in_flight)
        except Exception:  # ranking must never fail a request: load order stands
            log.exception("ranking prefill engines by KV events failed")
            return by_load, "load"
        return (decision.order, "kv") if decision.precise else (by_load, "load")

    def close(self) -> None:
        if self.router is not None:
            self.router.close()
