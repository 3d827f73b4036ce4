"""A prefill leg runs only on engines whose KV means the same to the decode engine.

During a rollout (a new model revision, dtype, block size or KV layout) old and new engines
serve side by side. KV computed by a prefill engine of the other revision would be refused
by decode (the signed lease carries the producer's fingerprint; a mismatch is recomputed),
so sending the leg there wastes a prefill and adds its latency. Each engine lists its KV
fingerprint in its /v1/models base card (`kv_fingerprint`); prefill engines with another
one are left out (those with decode's go first), and when none is left decode serves alone.

Fingerprints are read in the background, at each round of the prefill probes and when
stale (`adapter_models_ttl_s`): a request never waits on a /v1/models. An engine whose
fingerprint is not known yet, or that lists none (stock vLLM), stays a candidate after the
known ones: the lease check still refuses a mismatch.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from ..net.metrics import SidecarMetrics
from .adapter_legs import read_models
from .settings import SidecarSettings


MAX_FINGERPRINT_CHARS = 256
UNKNOWN = ""


def base_fingerprint(payload: Any) -> str:
    """The base model card's `kv_fingerprint` from a /v1/models answer ("" if none)."""
    data = payload.get("data") if isinstance(payload, dict) else None
    for card in data if isinstance(data, list) else []:
        if isinstance(card, dict) and card.get("parent") is None:
            fp = card.get("kv_fingerprint")
            if isinstance(fp, str) and len(fp) <= MAX_FINGERPRINT_CHARS:
                return fp
            return UNKNOWN
    return UNKNOWN


@dataclass(eq=False)
class RevisionLegs:
    settings: SidecarSettings
    metrics: SidecarMetrics
    next_client: Callable[[], httpx.AsyncClient]
    clock: Callable[[], float] = time.monotonic
    # base URL -> (expiry, fingerprint); the decode engine under its own URL.
    _known: dict[str, tuple[float, str]] = field(default_factory=dict, init=False)
    _reading: dict[str, asyncio.Task[None]] = field(default_factory=dict, init=False)

    def same_revision(self, candidates: list[str]) -> list[str]:
        """The candidates whose KV decode can use: those of its fingerprint first, then
        those not known yet (in their order); [] means decode alone."""
        if not candidates:
            return candidates
        mine = self._fingerprint(self.settings.decode_url)
        if mine == UNKNOWN:
            return candidates
        same, unknown = [], []
        for endpoint in candidates:
            theirs = self._fingerprint(self._base(endpoint))
            if theirs == mine:
                same.append(endpoint)
            elif theirs == UNKNOWN:
                unknown.append(endpoint)
        skipped = len(candidates) - len(same) - len(unknown)
        if skipped:
            self.metrics.other_revision_skipped.inc(skipped)
        return same + unknown

    def refresh(self, endpoints: list[str]) -> None:
        """Reads, in the background, what is not known or is stale (the prefill probes'
        round calls it), and drops engines that left: a new engine is usually known
        before its first leg."""
        keep = {self._base(e) for e in endpoints} | {self.settings.decode_url}
        for base in [b for b in self._known if b not in keep]:
            del self._known[base]
        if not endpoints:  # no prefill leg can run: nothing to ask anyone
            return
        for base in keep:
            self._fingerprint(base)

    def _base(self, endpoint: str) -> str:
        return f"{self.settings.upstream_scheme}://{endpoint}"

    def _fingerprint(self, base: str) -> str:
        cached = self._known.get(base)
        if (cached is None or self.clock() >= cached[0]) and base not in self._reading:
            task = asyncio.ensure_future(self._read(base))
            self._reading[base] = task
            task.add_done_callback(lambda _: self._reading.pop(base, None))
        return UNKNOWN if cached is None else cached[1]

    async def _read(self, base: str) -> None:
        payload = await read_models(self.next_client(), base)
        expiry = self.clock() + float(self.settings.adapter_models_ttl_s)
        if payload is None:
            # Unreachable: keep what was known (or unknown) and ask again after the TTL.
            previous = self._known.get(base, (0.0, UNKNOWN))[1]
            self._known[base] = (expiry, previous)
            return
        self._known[base] = (expiry, base_fingerprint(payload))
