"""What every model class shares: the decoder stack, the LM head and the rotary table."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pdpool.engine.models.layers import RotaryEmbedding, rope_theta_of


def head_dim_of(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


class PagedCausalLM(nn.Module):
    """`forward()` (in subclasses) takes the flat tokens of a mixed batch and returns hidden
    states; `compute_logits` turns the rows that need a token into logits. Parameter names
    follow the HF checkpoints (`model.*`, `lm_head.weight`)."""

    def __init__(self, config: dict, model: nn.Module, rotary_dim: Optional[int] = None):
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        head_dim = head_dim_of(config)
        self.rotary = RotaryEmbedding(
            head_dim,
            rotary_dim or head_dim,
            rope_theta_of(config),
            config.get("max_position_embeddings", 4096),
        )
        self.tie_word_embeddings = config.get("tie_word_embeddings", False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
