"""A batch of sampled rows' distributions, as vLLM filters them (temperature, then min_p,
top-k, top-p), computed for all rows at once: each filter is one tensor operation over the
batch, a row that does not use it passing through unchanged. Pure functions of the logits
and the rows' parameters."""

from __future__ import annotations

import math

import torch

from pdpool.engine.sampling_params import SamplingParams

# Top-p looks among this many most likely tokens first: a trained model's distribution
# usually puts top_p of its mass there, and finding them costs ~0.8 ms over 150k tokens on
# one core where sorting them all costs ~12.
TOP_P_CANDIDATES = 1024


def sampling_weights(rows: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`rows` ([R, V] logits, overwritten in place) as the rows' sampling weights: not
    normalized, zero where a filter drops a token."""
    device, vocab = rows.device, rows.shape[-1]
    temperatures = [p.temperature for p in params]
    if len(set(temperatures)) > 1:
        rows.div_(torch.tensor(temperatures, dtype=rows.dtype, device=device)[:, None])
    elif temperatures[0] != 1.0:
        rows.div_(temperatures[0])
    if any(p.min_p > 0.0 for p in params):
        drop_below_min_p(rows, [p.min_p for p in params])
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        keep_top_k(rows, top_k)
    weights = rows.sub_(rows.amax(dim=-1, keepdim=True)).exp_()
    cut = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if len(cut) == len(params):
        keep_top_p(weights, [p.top_p for p in params])
    elif cut:
        index = torch.tensor(cut, device=device)
        part = weights[index]
        keep_top_p(part, [params[i].top_p for i in cut])
        weights.index_copy_(0, index, part)
    return weights


def drop_below_min_p(rows: torch.Tensor, min_p: list[float]) -> None:
    """-inf for the tokens whose probability is below min_p times the row's likeliest."""
    probs = torch.softmax(rows, dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, device=rows.device)[:, None]
    rows.masked_fill_(probs < floor, -math.inf)


def keep_top_k(rows: torch.Tensor, top_k: list[int]) -> None:
    """-inf below each row's k-th largest logit (k = 0: the row is left whole)."""
    k = torch.tensor(top_k, device=rows.device)
    largest = torch.topk(rows, max(top_k), dim=-1).values
    kth = largest.gather(1, (k.clamp(min=1) - 1)[:, None])
    kth = torch.where(k[:, None] > 0, kth, torch.full_like(kth, -math.inf))
    rows.masked_fill_(rows < kth, -math.inf)


def keep_top_p(weights: torch.Tensor, top_p: list[float]) -> None:
    """Zeroes in each row of `weights` ([R, V], non-negative, not normalized) all but its
    most likely tokens whose mass before each is below its `top_p` share of the row's
    total (at least the first). They are looked for among the first candidates; a row whose
    candidates hold less than its share is sorted whole. When they hold that much, every
    kept token is among them: a token past them has at least that much mass before it."""
    vocab = weights.shape[-1]
    limit = (
        weights.sum(dim=-1, keepdim=True)
        * torch.tensor(top_p, dtype=weights.dtype, device=weights.device)[:, None]
    )
    values, order = torch.topk(weights, min(TOP_P_CANDIDATES, vocab), dim=-1)
    whole = {}
    if values.shape[-1] < vocab:
        for i in (values.sum(dim=-1) < limit[:, 0]).nonzero()[:, 0].tolist():
            row, row_order = weights[i].sort(descending=True)
            whole[i] = (row_order, row * _kept(row[None], limit[i : i + 1])[0])
    weights.zero_().scatter_(1, order, values * _kept(values, limit))
    for i, (row_order, row) in whole.items():
        weights[i].zero_().scatter_(0, row_order, row)


def _kept(values: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Of each row's values (largest first), those whose sum before is below its limit."""
    keep = values.cumsum(dim=-1) - values < limit
    keep[:, 0] = True
    return keep
