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
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[b + 1] - starts[b] for b in range(len(lens))]
    decodes = [b for b, n in enumerate(q_lens) if n == 1]
    if decodes:
        # All one-token sequences in one padded batch: the CPU engine's common step.
        rows = torch.tensor([starts[b] for b in decodes], device=q.device)
        index = torch.tensor(decodes, device=q.device)
        out[rows] = _decode_batch(q[rows], k_cache, v_cache, block_tables[index],
                                  seq_lens[index].long(), scale, sliding_window).to(q.dtype)
    for b, (seq_len, q_len) in enumerate(zip(lens, q_lens)):
        if q_len <= 1:
            continue
        n_blocks = (seq_len + block_size - 1) // block_size
        table = block_tables[b, :n_blocks].long()
        # [H_kv, L, D] contiguous fp32, once per sequence
        k = k_cache[table].flatten(0, 1)[:seq_len].transpose(0, 1).float().contiguous()
        v = v_cache[table].flatten(0, 1)[:seq_len].transpose(0, 1).float().contiguous()
        for lo in range(0, q_len, _QUERY_CHUNK):  # bounds the score matrix on long prompts
            hi = min(lo + _QUERY_CHUNK, q_len)
            first = seq_len - q_len + lo
            out[starts[b] + lo:starts[b] + hi] = _attend(
                q[starts[b] + lo:starts[b] + hi], k, v, first, scale, sliding_window
            ).to(q.dtype)
    return out


_QUERY_CHUNK = 1024


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float,
            sliding_window: Optional[int]) -> torch.Tensor:
    """q `[n, H, D]` at positions first_pos.. over fp32 k, v `[H_kv, L, D]`; GQA by reshape."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    qg = q.float().view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
    scores = qg @ k.transpose(-1, -2)[:, None] * scale                      # [Hkv, G, n, L]
    q_pos = torch.arange(first_pos, first_pos + n, device=q.device)
    k_pos = torch.arange(k.shape[1], device=q.device)
    visible = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        visible &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    out = probs @ v[:, None]                                                # [Hkv, G, n, D]
    return out.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)


def _decode_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                  sliding_window: Optional[int]) -> torch.Tensor:
    """One query per sequence, q `[B, H, D]`; keys gathered up to the longest sequence."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    n_blocks = int((seq_lens.max() + block_size - 1) // block_size)
    table = block_tables[:, :n_blocks].long().flatten()
    # [B, H_kv, L, D], contiguous: batched matmuls on CPU are several times faster so
    k = k_cache.index_select(0, table).view(batch, -1, num_kv_heads, head_dim)
    v = v_cache.index_select(0, table).view(batch, -1, num_kv_heads, head_dim)
    k = k.transpose(1, 2).float().contiguous()
    v = v.transpose(1, 2).float().contiguous()
    qg = q.float().view(batch, num_kv_heads, group, head_dim)
    scores = qg @ k.transpose(-1, -2) * scale                              # [B, Hkv, G, L]
    k_pos = torch.arange(k.shape[2], device=q.device)
    q_pos = (seq_lens - 1)[:, None]
    visible = k_pos[None, :] <= q_pos
    if sliding_window is not None:
        visible &= (q_pos - k_pos[None, :]) < sliding_window
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v                                # [B, Hkv, G, D]
    return out.reshape(batch, num_heads, head_dim)
