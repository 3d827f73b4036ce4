"""Turns the last-position logits of a batch into one token per request.

Each row is sampled under its own guard: an error in one request's logits processing or
sampling (a bad parameter, an injected test fault) is returned for that row alone and the
other rows of the batch are sampled as usual.

Logprobs follow vLLM v1's default (`logprobs_mode="raw_logprobs"`): the log-softmax of the
model's raw logits, before min_tokens masking, temperature, top-k and top-p.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from pdpool.engine.allowed_tokens import AllowedTokens
from pdpool.engine.bad_words import banned
from pdpool.engine.outputs import RequestError, TokenLogprob  # re-exported
from pdpool.engine.penalties import apply_penalties
from pdpool.engine.sampling_filters import sampling_weights
from pdpool.engine.sampling_params import SamplingParams
from pdpool.engine.structured.logits import LogitBiases

# Test-only fault injection: `SUBSTRING[@K][,...]`: a request whose id contains SUBSTRING
# fails inside its own sampling once it has sampled K tokens (default 0: at its first).
# Only the environment of the engine process can arm it (tests, an operator reproducing an
# incident); nothing a client sends can.
FAIL_SAMPLING_ENV = "PDPOOL_TEST_FAIL_SAMPLING_FOR"


def _fault_specs(value: Optional[str]) -> list[tuple[str, int]]:
    specs = []
    for part in (value or "").split(","):
        if part:
            sub, _, k = part.partition("@")
            specs.append((sub, int(k or 0)))
    return specs


@dataclass
class SampleResult:
    tokens: list[Optional[int]]  # None where the row failed
    logprobs: list[Optional[TokenLogprob]]  # None where not asked for (or failed)
    errors: dict[int, Exception]  # row -> what went wrong


class Sampler:
    def __init__(self) -> None:
        # Per-request generators keep a seeded request reproducible whatever its batch.
        self._generators: dict[str, torch.Generator] = {}
        self.fail_for = _fault_specs(os.environ.get(FAIL_SAMPLING_ENV))
        self._sampled: dict[str, int] = {}  # tokens sampled per request, while armed
        self.logit_biases = LogitBiases()
        self.allowed_tokens = AllowedTokens()

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._sampled.pop(request_id, None)
        self.logit_biases.forget(request_id)
        self.allowed_tokens.forget(request_id)

    def _injected_fault(self, request_id: str) -> None:
        done = self._sampled.get(request_id, 0)
        self._sampled[request_id] = done + 1
        for sub, k in self.fail_for:
            if sub in request_id and done >= k:
                raise RuntimeError(f"injected sampling failure ({FAIL_SAMPLING_ENV})")

    def _generator(self, request_id: str, seed: Optional[int], device) -> Optional[torch.Generator]:
        if seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed)
            self._generators[request_id] = gen
        return gen

    def sample(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        suppress: list[Optional[list[int]]],
        histories: Optional[list[Optional[tuple[list[int], list[int]]]]] = None,
    ) -> SampleResult:
        """logits `[B, V]`; `suppress[b]` lists token ids banned for row b (min_tokens);
        `histories[b]`: row b's prompt and output token ids, where its params penalize or
        ban words."""
        logits = logits.float()
        want = [b for b, p in enumerate(params) if p.logprobs is not None]
        raw = torch.log_softmax(logits[want], dim=-1) if want else None
        raw_row = {b: i for i, b in enumerate(want)}
        errors: dict[int, Exception] = {}
        self._bias_and_restrict(logits, request_ids, params)
        _ban_bad_words(logits, params, histories)
        _suppress(logits, suppress, errors)
        # As vLLM: the penalties after min_tokens and logit_bias, before the greedy choice.
        for b, history in enumerate(histories or ()):
            if history is not None and params[b].penalized and b not in errors:
                try:
                    apply_penalties(logits[b], history[0], history[1], params[b])
                except Exception as exc:  # this row only
                    errors[b] = exc
        tokens: list[Optional[int]] = [None] * len(params)
        logprobs: list[Optional[TokenLogprob]] = [None] * len(params)
        rows = self._rows_to_sample(request_ids, errors)
        greedy = [b for b in rows if params[b].greedy]
        if greedy:  # the argmax of the rows that want it (a row of 150k costs ~0.1 ms)
            picked = logits if len(greedy) == len(params) else logits[greedy]
            for b, token in zip(greedy, picked.argmax(dim=-1).tolist(), strict=True):
                tokens[b] = token
        drawn = [b for b in rows if not params[b].greedy]
        if drawn:
            for b, token in self._draw(logits, drawn, params, request_ids, errors).items():
                tokens[b] = token
        if want:
            self._logprobs(raw, raw_row, tokens, params, logprobs, errors)
        return SampleResult(tokens, logprobs, errors)

    def _rows_to_sample(self, request_ids: list[str], errors: dict[int, Exception]) -> list[int]:
        """The rows without an error (a test fault, when armed, fails its row here)."""
        rows = []
        for b, request_id in enumerate(request_ids):
            if b in errors:
                continue
            try:
                if self.fail_for:
                    self._injected_fault(request_id)
                rows.append(b)
            except Exception as exc:  # this row only
                errors[b] = exc
        return rows

    def _bias_and_restrict(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> None:
        """As vLLM: logit_bias and allowed_token_ids after the raw logprobs, before
        min_tokens and temperature."""
        if any(p.logit_bias for p in params):
            self.logit_biases.apply(logits, request_ids, [p.logit_bias for p in params])
        if any(p.allowed_token_ids for p in params):
            self.allowed_tokens.apply(logits, request_ids, [p.allowed_token_ids for p in params])

    @staticmethod
    def _logprobs(raw, raw_row, tokens, params, logprobs, errors) -> None:
        """Fills `logprobs` for the rows that asked: one gather and one top-k for the
        batch; should that fail, row by row under each row's own guard."""
        rows = [b for b in raw_row if tokens[b] is not None]
        if not rows:
            return
        try:
            dev = raw.device
            sub = raw[torch.tensor([raw_row[b] for b in rows], device=dev)]
            picked = torch.tensor([tokens[b] for b in rows], device=dev)
            sampled_col = sub.gather(1, picked[:, None])
            sampled = sampled_col[:, 0].tolist()
            # vLLM's rank of the sampled token: how many are at least as likely, itself too
            ranks = (sub >= sampled_col).sum(dim=1).tolist()
            k_max = max(params[b].logprobs for b in rows)
            top_v, top_i = torch.topk(sub, k_max) if k_max else (None, None)
            top_v = top_v.tolist() if k_max else None
            top_i = top_i.tolist() if k_max else None
            for j, b in enumerate(rows):
                k = params[b].logprobs
                top = list(zip(top_i[j][:k], top_v[j][:k], strict=True)) if k else []
                logprobs[b] = TokenLogprob(tokens[b], sampled[j], top, rank=ranks[j])
            return
        except Exception:
            pass
        for b in rows:
            try:
                logprobs[b] = _token_logprob(raw[raw_row[b]], tokens[b], params[b].logprobs)
            except Exception as exc:
                tokens[b], logprobs[b] = None, None
                errors[b] = exc

    def _draw(
        self,
        logits: torch.Tensor,
        rows: list[int],
        params: list[SamplingParams],
        request_ids: list[str],
        errors: dict[int, Exception],
    ) -> dict[int, int]:
        """A token drawn from each row's distribution, all in one inverse-CDF draw over
        the rows' filtered weights (`sampling_filters`, one batch). A seeded row takes its
        uniform from its own generator (reproducible whatever the batch), the others from
        torch's."""
        dev = logits.device
        weights = torch.empty(len(rows), logits.shape[-1], dtype=logits.dtype, device=dev)
        index = torch.tensor(rows, device=dev)
        torch.index_select(logits, 0, index, out=weights)
        try:
            sampling_weights(weights, [params[b] for b in rows])
        except Exception:  # row by row then, each under its own guard
            torch.index_select(logits, 0, index, out=weights)
            for i, b in enumerate(rows):
                try:
                    sampling_weights(weights[i : i + 1], [params[b]])
                except Exception as exc:  # this row only
                    errors[b] = exc
                    weights[i] = 0.0
        uniform = torch.rand(len(rows), device=dev)
        for i, b in enumerate(rows):
            if params[b].seed is not None:
                gen = self._generator(request_ids[b], params[b].seed, dev)
                uniform[i] = torch.rand(1, generator=gen, device=dev)[0]
        picked = inverse_cdf_draw(weights, uniform).tolist()
        out = {}
        for b, token in zip(rows, picked, strict=True):
            if b in errors:
                continue
            if token < 0:
                errors[b] = RequestError("the sampling distribution is not finite")
            else:
                out[b] = token
        return out


def inverse_cdf_draw(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """For each row of `weights` ([R, V] float32, non-negative, not necessarily normalized;
    overwritten by its running sums) the token whose running sum first exceeds `uniform`
    ([R], in [0, 1)) times the row's total.

    One cumulative sum and one binary search a row: on CPU many times cheaper than
    torch.multinomial, which costs milliseconds a row over a vocabulary of 150k. Searching
    for the first sum strictly above the target never lands on a token of zero weight (its
    sum equals the one before it); a target that rounding puts at the total takes the last
    token of weight (the first whose sum reaches the total). A row whose total is not a
    positive finite number (NaN logits) gets -1."""
    sums = weights.cumsum_(-1)
    total = sums[:, -1:].contiguous()
    last = torch.searchsorted(sums, total)
    picked = torch.minimum(torch.searchsorted(sums, uniform[:, None] * total, right=True), last)
    valid = (total > 0) & (total < math.inf)  # NaN fails both
    return picked.masked_fill_(~valid, -1)[:, 0]


def _ban_bad_words(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: Optional[list[Optional[tuple[list[int], list[int]]]]],
) -> None:
    """As vLLM: after allowed_token_ids, each row's bad words (bad_words.py) from its
    output so far."""
    for b, history in enumerate(histories or ()):
        sequences = params[b].bad_words_token_ids
        if history is not None and sequences:
            tokens = banned(sequences, history[1])
            if tokens:
                logits[b, tokens] = float("-inf")


def _suppress(
    logits: torch.Tensor, suppress: list[Optional[list[int]]], errors: dict[int, Exception]
) -> None:
    """Bans each row's `suppress` ids (an id outside the vocabulary fails that row)."""
    vocab = logits.shape[-1]
    for b, ids in enumerate(suppress):
        if ids:
            if any(not 0 <= t < vocab for t in ids):
                errors[b] = RequestError(f"stop_token_ids must be in [0, {vocab})")
                continue
            logits[b, ids] = float("-inf")


def _token_logprob(row: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if num_top > 0:
        values, ids = torch.topk(row, num_top)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    rank = int((row >= row[token]).sum())
    return TokenLogprob(token, float(row[token]), top, rank=rank)
