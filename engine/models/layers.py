"""Layers shared by the Qwen families: RMSNorm, rotary embedding, gated MLP, paged attention."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

from pdpool.engine.attention_metadata import AttentionMetadata
from pdpool.kernels import cpu_norm_rope, ops


class RMSNorm(nn.Module):
    """Normalises in float32 like the reference implementation, then casts back."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered  # Qwen3.5 stores weight - 1
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def scale(self) -> torch.Tensor:
        """What the normalised value is multiplied by."""
        return 1.0 + self.weight.float() if self.zero_centered else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_norm_rope.usable(x, self.weight):  # one pass per row, not torch's five
            return cpu_norm_rope.rms_norm(x, self.scale(), self.eps)
        # F.rms_norm is x * rsqrt(mean(x^2) + eps) [* weight] in one call (fewer CPU ops).
        shape = (x.shape[-1],)
        if self.zero_centered:
            h = F.rms_norm(x.float(), shape, eps=self.eps)
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        # Reduced precision: round the normalised value to x's dtype before the weight, as
        # the reference implementation does.
        return self.weight * F.rms_norm(x.float(), shape, eps=self.eps).to(x.dtype)


def rope_theta_of(config: dict) -> float:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding over the first `rotary_dim` dims of each head."""

    def __init__(self, head_dim: int, rotary_dim: int, theta: float, max_positions: int):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.theta = theta
        self.max_positions = max_positions
        self.rebuild_buffers()

    def rebuild_buffers(self) -> None:
        """(Re)computes the float32 tables; called again after loading from the meta device."""
        device = self.cos.device if hasattr(self, "cos") and not self.cos.is_meta else None
        inv_freq = 1.0 / (
            self.theta
            ** (
                torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=device).float()
                / self.rotary_dim
            )
        )
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        emb = torch.outer(t, inv_freq).repeat(1, 2)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def norm_and_rotate(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: RMSNorm,
        k_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward(positions, q_norm(q), k_norm(k))`; on CPU in one pass per head, in place
        on q and k (fresh projections the caller gives up)."""
        if cpu_norm_rope.usable(q, k, q_norm.weight, k_norm.weight, self.cos):
            for x, norm in ((q, q_norm), (k, k_norm)):
                cpu_norm_rope.norm_rope_(
                    x, norm.scale(), norm.eps, positions, self.cos, self.sin, self.rotary_dim
                )
            return q, k
        return self.forward(positions, q_norm(q), k_norm(k))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = (rot.float() * cos + rotated.float() * sin).to(x.dtype)
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In place on the fresh projection: no extra [T, intermediate] tensors per layer.
        h = F.silu(self.gate_proj(x), inplace=True)
        return self.down_proj(h.mul_(self.up_proj(x)))


class PagedAttention(nn.Module):
    """Writes the new K/V into this layer's cache view, then attends through block tables."""

    def __init__(
        self,
        layer_index: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: Optional[int] = None,
    ):
        super().__init__()
        self.layer_index = layer_index  # its layer slot in kv_cache (the engine may reassign)
        self.group = 0  # its KV group: which block table it reads
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        k_cache = kv_cache[:, self.layer_index, 0]
        v_cache = kv_cache[:, self.layer_index, 1]
        slot_mapping, block_tables = meta.group_tables(self.group)
        ops.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return ops.paged_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            self.scale,
            sliding_window=self.sliding_window,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
        )
