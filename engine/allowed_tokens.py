"""vLLM's `allowed_token_ids`: a request samples only among the listed tokens. Each request's
list becomes a vocabulary-wide mask at its first step, kept until the request is forgotten,
so a step costs one masked_fill per restricted row whatever the list's length."""

from __future__ import annotations

from typing import Optional

import torch


class AllowedTokens:
    def __init__(self) -> None:
        self._masks: dict[str, torch.Tensor] = {}  # True where a token is NOT allowed

    def apply(
        self, logits: torch.Tensor, request_ids: list[str], allowed: list[Optional[list[int]]]
    ) -> None:
        for b, ids in enumerate(allowed):
            if ids:
                logits[b].masked_fill_(self._mask(request_ids[b], ids, logits), float("-inf"))

    def _mask(self, request_id: str, ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        mask = self._masks.get(request_id)
        if mask is None or mask.device != logits.device or mask.shape[0] != logits.shape[-1]:
            mask = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
            mask[torch.tensor(ids, dtype=torch.long, device=logits.device)] = False
            self._masks[request_id] = mask
        return mask

    def forget(self, request_id: str) -> None:
        self._masks.pop(request_id, None)
