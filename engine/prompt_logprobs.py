"""The logprobs of a prompt's own tokens (vLLM's `prompt_logprobs`): the row at position i
scores the prompt token at i + 1, as vLLM v1 reports them (`raw_logprobs`: the log-softmax
of the model's logits, before any sampling parameter)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from pdpool.engine.outputs import TokenLogprob

# Rows scored at once: each takes the whole vocabulary's logits in float32.
ROWS_PER_PASS = 64


def score_prompt_rows(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    next_tokens: list[int],
    num_top: int,
) -> list[TokenLogprob]:
    """Each row of `hidden` scoring its next prompt token: the token's logprob and rank
    (how many tokens are at least as likely, itself included, as vLLM counts), and the
    `num_top` likeliest tokens there, best first."""
    scored: list[TokenLogprob] = []
    for start in range(0, len(next_tokens), ROWS_PER_PASS):
        targets = next_tokens[start : start + ROWS_PER_PASS]
        logprobs = torch.log_softmax(
            compute_logits(hidden[start : start + len(targets)]).float(), dim=-1
        )
        picked_ids = torch.tensor(targets, device=logprobs.device)[:, None]
        picked = logprobs.gather(1, picked_ids)
        ranks = (logprobs >= picked).sum(dim=1).tolist()
        top: Any = [[] for _ in targets]
        if num_top:
            values, ids = torch.topk(logprobs, num_top)
            top = [
                list(zip(i, v, strict=True))
                for i, v in zip(ids.tolist(), values.tolist(), strict=True)
            ]
        for j, token in enumerate(targets):
            scored.append(TokenLogprob(token, float(picked[j, 0]), top[j], rank=int(ranks[j])))
    return scored
