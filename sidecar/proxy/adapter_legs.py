"""A P/D request for a LoRA adapter runs its prefill leg under that adapter, or not at all.

The decode engine may serve an adapter no prefill engine serves (loaded at runtime with
/v1/load_lora_adapter, or engines started with different adapters). A prefill engine
without it answers 404, or, worse, a router that maps unknown models to the base would
hand decode KV computed under another model (the lease's content check refuses that, but
the prefill was wasted). So before a prefill leg:

1. keep, in ranking order, the prefill engines whose /v1/models lists the adapter;
2. none: when the pool allows runtime updates (`lora_allowed_dirs`), load it on the
   best-ranked engine with the decode engine's name and path (its /v1/models `root`), only
   when that path lies under an allowed folder: the decode engine's answer is not trusted;
3. else decode alone serves the request (logged, counted), never a prefill under another
   model.

`/v1/models` answers are cached a few seconds per engine (`adapter_models_ttl_s`); a load
updates the cache, a leg that finds the adapter gone (404) drops it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import httpx

from pdpool.lora_paths import is_under_allowed_dir, resolved_dirs

from ..net.metrics import SidecarMetrics
from .settings import SidecarSettings

log = logging.getLogger("pdpool.sidecar")

MODELS_TIMEOUT_S = 2.0
LOAD_TIMEOUT_S = 30.0
MAX_LOAD_TRIES = 2  # prefill engines asked to load before decode serves alone
MAX_MODELS = 4096  # cards read from one /v1/models answer
# outcome label of pdpool_sidecar_adapter_prefill_total
RESIDENT, LOADED, DECODE_ONLY = "resident", "loaded", "decode_only"


async def read_models(client: httpx.AsyncClient, base: str) -> Any:
    """An engine's /v1/models answer, or None when it gives none (logged)."""
    try:
        answer = await client.get(f"{base}/v1/models", timeout=MODELS_TIMEOUT_S)
        return answer.json() if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as exc:
        log.info("reading %s/v1/models failed: %r", base, exc)
        return None


@dataclass(frozen=True)
class AdapterCard:
    name: str
    root: str  # the path the engine loaded it from (vLLM's /v1/models `root`)


def adapter_cards(payload: Any) -> tuple[set[str], dict[str, AdapterCard]]:
    """(every model id listed, the adapters among them: cards with a `parent`) from a
    /v1/models answer; anything malformed is skipped."""
    data = payload.get("data") if isinstance(payload, dict) else None
    ids: set[str] = set()
    adapters: dict[str, AdapterCard] = {}
    for card in (data if isinstance(data, list) else [])[:MAX_MODELS]:
        if not isinstance(card, dict) or not isinstance(card.get("id"), str):
            continue
        ids.add(card["id"])
        parent, root = card.get("parent"), card.get("root")
        if isinstance(parent, str) and parent and isinstance(root, str):
            adapters[card["id"]] = AdapterCard(card["id"], root)
    return ids, adapters


@dataclass(eq=False)
class AdapterLegs:
    settings: SidecarSettings
    metrics: SidecarMetrics
    next_client: Callable[[], httpx.AsyncClient]
    clock: Callable[[], float] = time.monotonic
    _models: dict[str, tuple[float, set[str]]] = field(default_factory=dict, init=False)
    _decode: tuple[float, dict[str, AdapterCard]] = field(default=(-1e18, {}), init=False)
    _loading: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict, init=False)

    async def prefill_targets(self, model: Any, candidates: list[str]) -> list[str]:
        """The candidates that can prefill `model` (in their order); [] means decode alone.
        A base-model request (or one decode does not know as an adapter) is left as it is."""
        if not isinstance(model, str) or not candidates:
            return candidates
        card = await self._decode_adapter(model)
        if card is None:
            return candidates
        listed = await asyncio.gather(*(self._lists(e, model) for e in candidates))
        resident = [e for e, ok in zip(candidates, listed, strict=True) if ok]
        if resident:
            self.metrics.adapter_prefill(RESIDENT).inc()
            return resident
        loaded = await self._load_somewhere(card, candidates)
        if loaded is not None:
            self.metrics.adapter_prefill(LOADED).inc()
            return [loaded]
        self.metrics.adapter_prefill(DECODE_ONLY).inc()
        return []

    def _expiry(self) -> float:
        return self.clock() + float(self.settings.adapter_models_ttl_s)

    def is_adapter(self, model: Any) -> bool:
        """`model` is an adapter the decode engine served at its last /v1/models."""
        return isinstance(model, str) and model in self._decode[1]

    def forget(self, endpoint: str) -> None:
        """The engine's /v1/models is read again at its next leg."""
        self._models.pop(endpoint, None)

    async def _decode_adapter(self, model: str) -> Optional[AdapterCard]:
        expires, adapters = self._decode
        if model not in adapters or self.clock() >= expires:
            payload = await self._get_models(self.settings.decode_url)
            if payload is not None:
                adapters = adapter_cards(payload)[1]
                self._decode = (self._expiry(), adapters)
        return adapters.get(model)

    async def _lists(self, endpoint: str, model: str) -> bool:
        cached = self._models.get(endpoint)
        if cached is None or self.clock() >= cached[0] or model not in cached[1]:
            base = f"{self.settings.upstream_scheme}://{endpoint}"
            payload = await self._get_models(base)
            if payload is None:
                return False
            cached = (
                self._expiry(),
                adapter_cards(payload)[0],
            )
            self._models[endpoint] = cached
        return model in cached[1]

    async def _get_models(self, base: str) -> Any:
        return await read_models(self.next_client(), base)

    async def _load_somewhere(self, card: AdapterCard, candidates: list[str]) -> Optional[str]:
        dirs = resolved_dirs(self.settings.lora_allowed_dirs)
        if not dirs:
            log.warning(
                "no prefill engine serves adapter %r and the pool allows no runtime loads: "
                "decode serves it alone",
                card.name,
            )
            return None
        if not is_under_allowed_dir(card.root, dirs):
            log.warning(
                "adapter %r: the decode engine's path %r is outside --lora-allowed-dir: not "
                "loaded on a prefill engine, decode serves it alone",
                card.name,
                card.root[:200],
            )
            return None
        for endpoint in candidates[:MAX_LOAD_TRIES]:
            if await self._load(endpoint, card):
                return endpoint
        log.warning("adapter %r could not be loaded on a prefill engine: decode alone", card.name)
        return None

    async def _load(self, endpoint: str, card: AdapterCard) -> bool:
        key = (endpoint, card.name)
        lock = self._loading.setdefault(key, asyncio.Lock())
        try:
            async with lock:  # concurrent requests for one adapter load it once
                return await self._load_once(endpoint, card)
        finally:
            # Engines come and go; their locks should not pile up. A newcomer after this
            # may load again: the engine answers "already been loaded", taken as success.
            if not lock.locked():
                self._loading.pop(key, None)

    async def _load_once(self, endpoint: str, card: AdapterCard) -> bool:
        if await self._lists(endpoint, card.name):
            return True
        url = f"{self.settings.upstream_scheme}://{endpoint}/v1/load_lora_adapter"
        try:
            answer = await self.next_client().post(
                url,
                json={"lora_name": card.name, "lora_path": card.root},
                timeout=LOAD_TIMEOUT_S,
            )
        except httpx.HTTPError as exc:
            log.warning("loading adapter %r on %s failed: %r", card.name, endpoint, exc)
            return False
        # "already been loaded": another sidecar was first; either way it is there now.
        ok = answer.status_code == 200 or "already been loaded" in answer.text
        if not ok:
            log.warning(
                "loading adapter %r on %s: %s %s",
                card.name,
                endpoint,
                answer.status_code,
                answer.text[:200],
            )
            return False
        log.info("loaded adapter %r on prefill engine %s", card.name, endpoint)
        expires, models = self._models.get(endpoint, (self._expiry(), set()))
        self._models[endpoint] = (expires, models | {card.name})
        return True
