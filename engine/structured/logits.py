"""The logits hook of a step: every guided row's token mask filled for the batch at once
(xgrammar's batch matcher, on a worker thread started before the model's forward, so the
fill overlaps it) and applied in place before sampling, and `logit_bias` added
(LogitBiases). A batch without guided or biased rows costs one list scan."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch
import xgrammar as xgr

from pdpool.engine.structured.grammar import RequestGrammar


class PendingMask:
    """A batch's bitmask being filled; `apply` waits for it and masks the logits (then the
    tokens that would break UTF-8: utf8_guard.py)."""

    def __init__(
        self,
        future: Future[None],
        bitmask: torch.Tensor,
        rows: list[int],
        grammars: Optional[list[RequestGrammar]] = None,
    ) -> None:
        self.future, self.bitmask, self.rows = future, bitmask, rows
        self.grammars = grammars or []

    def apply(self, logits: torch.Tensor) -> None:
        self.future.result()
        bitmask = self.bitmask[: logits.shape[0]]
        if bitmask.device != logits.device:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=logits.shape[-1], indices=self.rows
        )
        for row, grammar in zip(self.rows, self.grammars, strict=True):
            if grammar.guard is not None:
                grammar.guard.mask(logits, row, grammar.utf8_state)


class GuidedMasks:
    """Fills the token masks of the guided rows of each step."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pdpool-grammar")
        self._matchers = xgr.BatchGrammarMatcher(max_threads=2)
        self._bitmask: Optional[torch.Tensor] = None

    def start(self, grammars: list[Optional[RequestGrammar]]) -> Optional[PendingMask]:
        """Starts filling the masks of the rows whose grammar has not ended; None when the
        batch has none (nothing is allocated or started)."""
        rows = [i for i, g in enumerate(grammars) if g is not None and not g.terminated]
        if not rows:
            return None
        bitmask = self._buffer(len(grammars))
        guided = [g for g in grammars if g is not None and not g.terminated]
        matchers = [g.matcher for g in guided]
        future = self._pool.submit(
            self._matchers.batch_fill_next_token_bitmask, matchers, bitmask, rows
        )
        return PendingMask(future, bitmask, rows, guided)

    def _buffer(self, batch: int) -> torch.Tensor:
        """One bitmask buffer reused step after step (grown when a batch outgrows it)."""
        if self._bitmask is None or self._bitmask.shape[0] < batch:
            self._bitmask = xgr.allocate_token_bitmask(max(batch, 64), self.vocab_size)
        return self._bitmask


class LogitBiases:
    """Each request's logit_bias as an index tensor and a value tensor, built at its first
    step and kept until the request is forgotten: a step adds them with one index_add_ per
    biased row (no Python lists rebuilt per step; the entries are capped at 300)."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def apply(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        biases: list[Optional[dict[int, float]]],
    ) -> None:
        for b, bias in enumerate(biases):
            if bias:
                ids, values = self._tensors(request_ids[b], bias, logits)
                logits[b].index_add_(0, ids, values)

    def _tensors(
        self, request_id: str, bias: dict[int, float], logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._rows.get(request_id)
        if cached is None or cached[1].device != logits.device or cached[1].dtype != logits.dtype:
            cached = (
                torch.tensor(list(bias), dtype=torch.long, device=logits.device),
                torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device),
            )
            self._rows[request_id] = cached
        return cached

    def forget(self, request_id: str) -> None:
        self._rows.pop(request_id, None)
