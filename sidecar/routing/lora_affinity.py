"""LoRA adapter residency in routing: send an adapter's request where the adapter is loaded.

An engine holds at most --max-loras adapters in its slots; a request for another one loads
it (evicting an idle one) or, when every slot serves running requests, waits. Each engine's
`vllm:lora_requests_info` (lora_metrics_text.py) says which adapters its running and waiting
requests use and its max_lora; the router also remembers the last max_lora adapters it sent
to each engine (an engine keeps recently used adapters in its slots after their requests end,
which the metric does not show). Scores, GIE's lora-affinity scorer's tiers plus that memory:

    1.0   the adapter is running there
    0.95  the router sent it there lately, and it fits in the slots beside the running ones
    0.8-0.9  a slot is free (fewer than max_lora adapters in use); more free slots score higher,
          so new adapters spread over the pool instead of piling onto one engine
    0.7   the engine's residency is unknown (no fresh LoRA series)
    0.6   only waiting there (the engine's slots are full)
    0.0   every slot holds another adapter

The score never overrides load: only engines under the bounded-load cap (the same cap as
prefix affinity: ceil(balance * (total in flight + 1) / healthy engines)) are reordered by it;
with KV-aware routing it is a cost in tokens added to the KV cost instead, beside prefix hits
and load (`adapter_cost`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from typing import Awaitable, Callable, Mapping, Optional, Sequence

from ..net.periodic import Periodic
from .lora_metrics_text import MAX_NAME_CHARS, LoraInfo, parse_lora_info

log = logging.getLogger("pdpool.routing")

RUNNING, RECENT, UNKNOWN, WAITING, FULL = 1.0, 0.95, 0.7, 0.6, 0.0
FREE, FREE_SPAN = 0.8, 0.1
MAX_KNOWN_ADAPTERS = 4096  # adapter names remembered from the engines' series
# While every engine's page was read and none has LoRA series (a pool without adapters),
# pages are read this seldom.
IDLE_INTERVAL_S = 5.0

Fetch = Callable[[str], Awaitable[Optional[str]]]


def adapter_score(model: str, info: Optional[LoraInfo], recent: Sequence[str] = ()) -> float:
    """How well an engine suits a request for adapter `model` (see the module doc)."""
    if info is None:
        return UNKNOWN
    if model in info.running:
        return RUNNING
    # The slots hold the running adapters; the router's most recent others fill the rest.
    room = max(info.max_lora - len(info.running), 0)
    kept = [name for name in reversed(recent) if name not in info.running][:room]
    if model in kept:
        return RECENT
    in_use = len(info.running | info.waiting | set(kept))
    if in_use < info.max_lora:
        return FREE + FREE_SPAN * (info.max_lora - in_use) / info.max_lora
    if model in info.waiting:
        return WAITING
    return FULL


def residency(score: float) -> str:
    """A score's tier by name (the routing decision's metric label)."""
    names = {RUNNING: "running", RECENT: "recent", UNKNOWN: "unknown", WAITING: "waiting"}
    return "full" if score == FULL else names.get(score, "free")


def load_cap(alive: Sequence[str], load: Callable[[str], float], balance: float) -> float:
    """Bounded load: an engine at or above this many in flight is not preferred for affinity."""
    return math.ceil(balance * (sum(load(b) for b in alive) + 1) / max(len(alive), 1))


def adapter_order(
    order: Sequence[str],
    scores: Mapping[str, float],
    load: Callable[[str], float],
    healthy: Callable[[str], bool],
    balance: float,
) -> list[str]:
    """`order` (prefix affinity's) with the healthy engines under the load cap first, best
    adapter score first (ties keep `order`), then the others as they were (the adapter
    profile of plugins.py)."""
    from .plugins import adapter_profile  # plugins reads this module's scores

    return adapter_profile(scores, load, healthy, balance).order(order)


def adapter_cost(
    scores: Mapping[str, float],
    alive: Sequence[str],
    load: Callable[[str], float],
    balance: float,
    cost_tokens: float,
) -> Callable[[str], float]:
    """The KV router's extra cost of an engine for this adapter, in prompt tokens: none where
    it runs, `cost_tokens` where every slot is taken; an engine over the load cap gets no
    adapter credit (load stays bounded)."""
    cap = load_cap(alive, load, balance)

    def cost(b: str) -> float:
        if load(b) >= cap:
            return cost_tokens
        return cost_tokens * (1.0 - scores.get(b, UNKNOWN))

    return cost


class LoraResidency:
    """Each engine's LoRA series (scraped through `fetch`) and the adapters this router sent
    it lately; answers which engines suit an adapter."""

    def __init__(
        self,
        backends: Callable[[], list[str]],
        interval_s: float = 0.5,
        staleness_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backends, self.interval_s, self.staleness_s = backends, interval_s, staleness_s
        self.clock = clock
        self.infos: dict[str, tuple[LoraInfo, float]] = {}
        self.recent: dict[str, OrderedDict[str, None]] = {}
        self.known: OrderedDict[str, None] = OrderedDict()  # adapters some engine listed
        self.fetch: Optional[Fetch] = None
        self.idle = False  # the last scrape read every page, and none had LoRA series
        self._scrapes = Periodic(self.scrape_once, self.next_interval_s, "LoRA residency scrape")

    # --- what the engines say -----------------------------------------------------------
    def update(self, backend: str, text: Optional[str]) -> None:
        """`backend`'s /metrics text (None: unreadable, its last reading ages out)."""
        info = parse_lora_info(text) if text else None
        if info is None:
            return
        self.infos[backend] = (info, self.clock())
        for name in info.running | info.waiting:
            self.known[name] = None
            self.known.move_to_end(name)
        while len(self.known) > MAX_KNOWN_ADAPTERS:
            self.known.popitem(last=False)

    def info(self, backend: str) -> Optional[LoraInfo]:
        got = self.infos.get(backend)
        if got is None or self.clock() - got[1] > self.staleness_s:
            return None
        return got[0]

    def applies(self, model: Optional[str]) -> bool:
        """Whether `model` is to be routed as an adapter: some engine exports LoRA series
        and no engine names it as its base model."""
        if not model or len(model) > MAX_NAME_CHARS:
            return False
        infos = [i for i in (self.info(b) for b in self.infos) if i is not None]
        return bool(infos) and all(i.base_model != model for i in infos)

    def scores(self, model: str, backends: Sequence[str]) -> dict[str, float]:
        return {
            b: adapter_score(model, self.info(b), tuple(self.recent.get(b, ()))) for b in backends
        }

    def routed(self, backend: str, model: str) -> None:
        """The router sent a request for `model` to `backend`: the engine will hold it in a
        slot. Only names some engine has listed are remembered (a client's made-up names
        never push real adapters out of this memory)."""
        if model not in self.known:
            return
        info = self.info(backend)
        slots = info.max_lora if info is not None else 1
        recent = self.recent.setdefault(backend, OrderedDict())
        recent[model] = None
        recent.move_to_end(model)
        while len(recent) > slots:
            recent.popitem(last=False)

    # --- scraping -----------------------------------------------------------------------
    async def scrape_once(self) -> None:
        if self.fetch is None:
            return
        fetch = self.fetch
        backends = self.backends()
        texts = await asyncio.gather(*(fetch(b) for b in backends), return_exceptions=True)
        for backend, text in zip(backends, texts, strict=True):
            self.update(backend, text if isinstance(text, str) else None)
        read = all(isinstance(t, str) for t in texts)
        self.idle = bool(backends) and read and not (set(self.infos) & set(backends))
        for gone in set(self.infos) - set(backends):
            del self.infos[gone]
        for gone in set(self.recent) - set(backends):
            del self.recent[gone]

    async def start(self, fetch: Optional[Fetch]) -> None:
        """Reads every engine once (the first requests find residency known), then every
        interval; no `fetch`: the router's own memory alone (nothing is scored then). A
        failed scrape never stops routing; the next may work."""
        self.fetch = fetch
        if fetch is not None and not self._scrapes.running:
            try:
                await self.scrape_once()
            except Exception:
                log.exception("LoRA residency scrape failed")
            self._scrapes.start()

    async def stop(self) -> None:
        await self._scrapes.stop()

    def next_interval_s(self) -> float:
        """At least IDLE_INTERVAL_S while no engine has LoRA series (every page read: an
        engine still starting is read again soon), else the interval."""
        return max(self.interval_s, IDLE_INTERVAL_S) if self.idle else self.interval_s
