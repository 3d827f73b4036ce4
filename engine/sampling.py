"""Turns the last-position logits of a batch into one token per request."""
from __future__ import annotations

from typing import Optional

import torch

from pdpool.engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self):
        # Per-request generators keep a seeded request reproducible whatever its batch.
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, seed: Optional[int], device) -> Optional[torch.Generator]:
        if seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed)
            self._generators[request_id] = gen
        return gen

    def sample(self, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams], suppress: list[Optional[list[int]]]) -> list[int]:
        """logits `[B, V]`; `suppress[b]` lists token ids banned for row b (min_tokens)."""
        logits = logits.float()
        for b, ids in enumerate(suppress):
            if ids:
                logits[b, ids] = float("-inf")
        tokens = logits.argmax(dim=-1).tolist()
        for b, p in enumerate(params):
            if p.greedy:
                continue
            row = logits[b] / p.temperature
            if 0 < p.top_k < row.shape[-1]:
                kth = torch.topk(row, p.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, dim=-1)
            if p.top_p < 1.0:
                sorted_probs, order = probs.sort(descending=True)
                keep = sorted_probs.cumsum(-1) - sorted_probs < p.top_p
                keep[0] = True
                probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
                probs = probs / probs.sum()
            gen = self._generator(request_ids[b], p.seed, logits.device)
            tokens[b] = int(torch.multinomial(probs, 1, generator=gen).item())
        return tokens
