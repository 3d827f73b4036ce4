"""Qwen3 dense decoder (`Qwen3ForCausalLM`), parameter names as in the HF checkpoint.

`layer_types` may mark layers `sliding_attention`; those attend only to the last
`sliding_window` positions.
"""

from __future__ import annotations

import torch
from torch import nn

from pdpool.engine.attention_metadata import AttentionMetadata
from pdpool.engine.models.base import PagedCausalLM, head_dim_of
from pdpool.engine.models.layers import GatedMLP, PagedAttention, RMSNorm


def layer_types_of(config: dict) -> list[str]:
    n = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types:
        return list(types)
    if config.get("use_sliding_window") and config.get("sliding_window"):
        first_full = config.get("max_window_layers", n)
        return ["full_attention" if i < first_full else "sliding_attention" for i in range(n)]
    return ["full_attention"] * n


class Qwen3Attention(nn.Module):
    def __init__(self, config: dict, layer_index: int, sliding_window):
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config["num_key_value_heads"]
        self.head_dim = head_dim_of(config)
        bias = config.get("attention_bias", False)
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        eps = config.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)
        self.attn = PagedAttention(
            layer_index, self.num_heads, self.num_kv_heads, self.head_dim, sliding_window
        )

    def forward(self, x, positions, rotary, kv_cache, meta):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary.norm_and_rotate(positions, q, k, self.q_norm, self.k_norm)
        o = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(o.reshape(t, -1))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: dict, layer_index: int, sliding_window):
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        self.self_attn = Qwen3Attention(config, layer_index, sliding_window)
        self.mlp = GatedMLP(config["hidden_size"], config["intermediate_size"])
        self.input_layernorm = RMSNorm(config["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps)

    def forward(self, x, positions, rotary, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        window = config.get("sliding_window")
        types = layer_types_of(config)
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, i, window if types[i] == "sliding_attention" else None)
            for i in range(config["num_hidden_layers"])
        )
        self.norm = RMSNorm(config["hidden_size"], config.get("rms_norm_eps", 1e-6))


class Qwen3ForCausalLM(PagedCausalLM):
    def __init__(self, config: dict):
        super().__init__(config, Qwen3Model(config))

    @property
    def num_attention_layers(self) -> int:
        return len(self.model.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        state=None,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, self.rotary, kv_cache, meta)
        return self.model.norm(x)
