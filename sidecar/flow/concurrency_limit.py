"""How many requests an engine should hold at once, learned from what it reports: no
number to tune (TCP Vegas / Netflix's gradient limit, with the engine's inter-token latency
as the round-trip time).

An engine batches every request it is sent. Past some batch, a bigger batch adds little
throughput and makes every step, hence every stream's tokens and a
newcomer's first token, slower. The requests beyond that point are better held in the
gateway's fair queues, where tenants' weights apply, than in the engine's batch, where
they do not. That point depends on the model, the GPU and the prompts; it is found here
from the engine's own metrics (vLLM's names), read every scrape:

- ITL: the mean inter-token latency of the tokens made since the last sample (the deltas
  of `vllm:inter_token_latency_seconds` _sum and _count, at least MIN_TOKENS tokens),
  smoothed over about two samples: the engine's step time;
- baseline: the step time of a small batch. Until one is known the limit is at most
  SMALL_BATCH (a slow start: an engine flooded before its first sample drains to a batch
  whose step time can be measured; a first sample from a big batch would make that batch
  look cheap for good), unless no small batch shows in PATIENCE samples (other routers
  keep it busy), when the step time seen is taken. Then measured whenever the engine runs
  at most SMALL_BATCH requests (followed both ways: a slower machine or longer prompts are
  learned); otherwise only lowered by a faster sample, and let rise by DRIFT a sample so
  that a pool never seen idle still learns a lasting change, in minutes;
- ITL <= TOLERANCE x baseline and the limit in use (the engine runs at least 3/4 of it):
  the limit grows (by max(1, limit/10) a sample): batching is still cheap;
- ITL above that: it shrinks in proportion (limit x TOLERANCE x baseline / ITL, at most
  halved a sample): the extra requests mostly slowed everyone;
- the engine keeps requests waiting two scrapes in a row: what it runs is its ceiling (its
  batch or KV limit; beyond it requests wait in the engine's first-come queue, weights
  unused), and the limit stays HEADROOM places below it (a newcomer the fair order lets
  past the bound starts at once); the ceiling is retried upward slowly (CEILING_DRIFT);
- KV usage at the pool's threshold: no growth (the engine is about to preempt);
- never below 1.
With several gateway replicas each has its own limit; all read the same ITL and shrink
together (as TCP flows sharing a link do), so their sum converges too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Kleinrock's optimal operating point (most throughput per unit of latency): for a step
# time linear in the batch, it is where the step takes twice the small batch's. (Measured
# at 10x, within 10% of the most throughput the engine can give: the pool's throughput
# then matched no flow control, but a full engine batch left no free place for a higher
# band or a quiet tenant, and their first tokens waited seconds; docs/flow-control.md.)
TOLERANCE = 2.0
DRIFT = 0.0006  # baseline rise per sample while above it: x2 in ~5 min at 4 samples/s
MIN_TOKENS = 32  # an ITL sample spans at least this many tokens (fewer: noise)
SMALL_BATCH = 2  # running at most this many, the step time is the baseline
SMOOTHING = 0.5
MAX_LIMIT = 4096.0
GROWTH = 0.1  # relative growth per scrape (at least one request)
IN_USE = 0.75  # the limit is in use when the engine runs this share of it
HEADROOM = 4  # batch places kept free below an engine's own limit (the starting bound's)
# The engine's limit, once seen, is retried upward (~x1.6 a minute of use; never while idle:
# a pool that rests between bursts would otherwise meet the next one above that limit).
CEILING_DRIFT = 0.002
PATIENCE = 40  # samples (~10 s) without a small batch before a big batch's ITL is the baseline


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
        self.itl: Optional[float] = None  # smoothed
        self.kv_threshold = kv_threshold
        self._last: Optional[tuple[float, float]] = None  # (itl_sum, itl_count)
        self._waited = False  # the previous scrape saw requests waiting
        self._unmeasured = 0  # samples with tokens but no small batch, before a baseline
        self.ceiling: Optional[float] = None  # the batch the engine ran when it last queued

    @property
    def value(self) -> int:
        return max(1, int(self.limit))

    def observe(self, sample: EngineSample) -> None:
        """Folds one scrape in: the ITL of the interval since the last, then `update`."""
        itl = None
        if sample.itl_sum is not None:
            last = self._last
            if last is None or sample.itl_count < last[1]:  # first read, or a restart
                self._last = (sample.itl_sum, sample.itl_count)
            elif sample.itl_count - last[1] >= MIN_TOKENS:  # else: wait for more tokens
                itl = (sample.itl_sum - last[0]) / (sample.itl_count - last[1])
                self._last = (sample.itl_sum, sample.itl_count)
        self.update(itl, sample.running, sample.waiting, sample.kv_usage)

    def update(self, itl: Optional[float], running: float, waiting: float, kv: float) -> float:
        """One interval: its mean ITL (None: too few tokens to tell) and the gauges."""
        queued = waiting > 0 and self._waited
        self._waited = waiting > 0
        if itl is not None and itl > 0:
            itl = self._learn(itl, running)
        in_use = running + waiting >= IN_USE * self.limit
        if queued and running >= 1:
            self.ceiling = running
            self.limit = min(self.limit, running)
        elif not self.baseline:
            self.limit = min(self.limit, SMALL_BATCH)  # slow start, until a baseline
        elif itl is None:
            pass  # no tokens this interval: nothing learned
        elif itl > TOLERANCE * self.baseline:
            self.limit *= max(0.5, TOLERANCE * self.baseline / itl)
        elif in_use and kv < self.kv_threshold:
            self.limit += max(1.0, GROWTH * self.limit)
        if self.ceiling is not None:
            # Below the engine's own limit by a few places: a request the fair order lets
            # past the bound (a newcomer below its share, a higher band) starts at once
            # instead of waiting in the engine's queue for a stream to end.
            self.limit = min(self.limit, self.ceiling - min(HEADROOM, self.ceiling / 4))
            if in_use and not queued:  # retried only while the limit is in use
                self.ceiling *= 1 + CEILING_DRIFT
        self.limit = min(MAX_LIMIT, max(1.0, self.limit))
        return self.limit

    def _learn(self, itl: float, running: float) -> float:
        """Smooths the ITL and moves the baseline; returns the smoothed ITL."""
        self.itl = itl if self.itl is None else self.itl + SMOOTHING * (itl - self.itl)
        if self.baseline is None:
            if running <= SMALL_BATCH or self._unmeasured >= PATIENCE:
                self.baseline = itl if running <= SMALL_BATCH else self.itl
            else:
                self._unmeasured += 1
        elif (
            running <= SMALL_BATCH
        ):  # this interval's own ITL, not one smoothed with bigger batches'
            self.baseline += SMOOTHING * (itl - self.baseline)
        else:
            self.baseline = min(self.itl, self.baseline * (1 + DRIFT))
        return self.itl
