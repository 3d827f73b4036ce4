"""How many requests an engine should hold at once, learned from what it reports: no
number to tune (TCP Vegas / Netflix's gradient limit, with the engine's inter-token latency
as the round-trip time).

An engine batches every request it is sent. Past some batch, a bigger batch no longer adds
throughput: it only makes every step, hence every stream's tokens and a newcomer's first
token, slower. The requests beyond that point are better held in the gateway's fair queues,
where tenants' weights apply, than in the engine's batch, where they do not. That point
depends on the model, the GPU and the prompts; it is found here from the engine's own
metrics (vLLM's names), read every scrape:

- ITL: the mean inter-token latency of the tokens made since the last scrape
  (`vllm:inter_token_latency_seconds` _sum and _count deltas), i.e. the engine's step time;
- baseline: the lowest ITL seen (the step time of a small batch). It rises by DRIFT a
  sample while the ITL stays above it, so a lasting change (longer prompts, a slower
  neighbour) is learned in minutes rather than holding the limit at 1 for ever;
- ITL <= TOLERANCE x baseline and the limit in use (the engine runs at least 3/4 of it):
  the limit grows (by max(1, limit/10) a scrape): batching is still nearly free;
- ITL above that: it shrinks in proportion (limit x TOLERANCE x baseline / ITL, at most
  halved a scrape): the extra requests only slowed everyone;
- the engine keeps requests waiting two scrapes in a row: at most what it runs (its batch
  or KV limit; beyond it requests wait in the engine's first-come queue, weights unused);
- KV usage at the pool's threshold: no growth (the engine is about to preempt).
- never below 1.
With several gateway replicas each has its own limit; all read the same ITL and shrink
together (as TCP flows sharing a link), so their sum converges too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# A newcomer's first token costs about one step: at 1.5x the unloaded step time its TTFT is
# within 1.5x of the pool alone (the isolation goal); also Netflix's gradient default.
TOLERANCE = 1.5
DRIFT = 0.0006  # baseline rise per scrape while above it: x2 in ~5 min at 4 scrapes/s
MIN_TOKENS = 4  # fewer tokens in an interval: its mean ITL says too little
MAX_LIMIT = 4096.0
GROWTH = 0.1  # relative growth per scrape (at least one request)
IN_USE = 0.75  # the limit is in use when the engine runs this share of it


@dataclass(frozen=True)
class EngineSample:
    """One scrape of an engine: its gauges and its ITL histogram's running totals."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    itl_sum: Optional[float] = None  # None: the engine exports no ITL histogram
    itl_count: float = 0.0


class AdaptiveLimit:
    """One engine's concurrency limit. `observe` each scrape; `value` is the limit."""

    def __init__(self, initial: float = 1.0, kv_threshold: float = 0.8) -> None:
        self.limit = max(1.0, float(initial))
        self.baseline: Optional[float] = None
        self.kv_threshold = kv_threshold
        self._last: Optional[tuple[float, float]] = None  # (itl_sum, itl_count)
        self._waited = False  # the previous scrape saw requests waiting

    @property
    def value(self) -> int:
        return max(1, int(self.limit))

    def observe(self, sample: EngineSample) -> None:
        """Folds one scrape in: the ITL of the interval since the last, then `update`."""
        itl = None
        if sample.itl_sum is not None:
            if self._last is not None and sample.itl_count >= self._last[1]:
                tokens = sample.itl_count - self._last[1]
                if tokens >= MIN_TOKENS:
                    itl = (sample.itl_sum - self._last[0]) / tokens
            self._last = (sample.itl_sum, sample.itl_count)  # a restart's reset starts over
        self.update(itl, sample.running, sample.waiting, sample.kv_usage)

    def update(self, itl: Optional[float], running: float, waiting: float, kv: float) -> float:
        """One interval: its mean ITL (None: too few tokens to tell) and the gauges."""
        queued = waiting > 0 and self._waited
        self._waited = waiting > 0
        if itl is not None and itl > 0:
            self.baseline = itl if self.baseline is None else min(itl, self.baseline * (1 + DRIFT))
        in_use = running + waiting >= IN_USE * self.limit
        if queued and running >= 1:
            self.limit = min(self.limit, running)
        elif itl is None or not self.baseline:
            pass  # no tokens this interval: nothing learned
        elif itl > TOLERANCE * self.baseline:
            self.limit *= max(0.5, TOLERANCE * self.baseline / itl)
        elif in_use and kv < self.kv_threshold:
            self.limit += max(1.0, GROWTH * self.limit)
        self.limit = min(MAX_LIMIT, max(1.0, self.limit))
        return self.limit


def weighted_shares(limit: float, weights: dict[str, float]) -> dict[str, float]:
    """Each active tenant's share of `limit` by weight (a lone tenant: all of it)."""
    total = sum(weights.values())
    return {name: limit * w / total for name, w in weights.items()} if total > 0 else {}
