"""Torch references for the attention kernels; also the engine's CPU path.

Cache layout (shared by the engine, the kernels and the NIXL connector): one tensor
`kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`, block-major so a
block of every layer is one contiguous region (one NIXL descriptor per block). A layer's
`k_cache = kv_cache[:, layer, 0]` is a strided view `[num_blocks, block_size, H_kv, D]`.
A slot is `block_id * block_size + offset`.
"""
from __future__ import annotations

from typing import Optional

import torch


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatters k, v `[T, H_kv, D]` into the caches at `slot_mapping[T]`; slot -1 is skipped."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                              seq_lens: torch.Tensor, scale: float,
                              sliding_window: Optional[int] = None) -> torch.Tensor:
    """Causal attention of a mixed batch over the paged cache.

    q: `[T, H, D]`, the new tokens of all sequences back to back; sequence b owns rows
    `query_start_loc[b]:query_start_loc[b+1]`. seq_lens[b] is its context length including
    the new tokens (already written to the cache), so its query i sits at position
    `seq_lens[b] - q_len + i`. A key at position j is visible to a query at p when j <= p and,
    with a sliding window W, p - j < W. Returns `[T, H, D]` in q's dtype.
    """
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        n_blocks = (seq_len + block_size - 1) // block_size
        table = block_tables[b, :n_blocks].long()
        k = k_cache[table].reshape(-1, num_kv_heads, k_cache.shape[-1])[:seq_len]
        v = v_cache[table].reshape(-1, num_kv_heads, v_cache.shape[-1])[:seq_len]
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        qb = q[lo:hi].float()
        q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        visible = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        scores = scores.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
