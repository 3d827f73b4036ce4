"""Torch references for the attention kernels, pure torch (the Triton and C kernels are
checked against them); with the C kernels in front (cpu_attention.py) the engine's CPU path.

Cache layout (shared by the engine, the kernels and the NIXL connector): one tensor
`kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`, block-major so a
block of every layer is one contiguous region (one NIXL descriptor per block). A layer's
`k_cache = kv_cache[:, layer, 0]` is a strided view `[num_blocks, block_size, H_kv, D]`.
A slot is `block_id * block_size + offset`.

Speed on CPU (this is the engine's attention there): the blocks a batch reads are gathered
with one `index_select` per cache into a reused per-thread workspace (a fresh multi-MB tensor
per layer costs more in page faults than the copy itself), and attention runs in
`scaled_dot_product_attention`. GQA folds each KV head's query group into SDPA's query
axis, so K/V are never repeated per query head.
"""

from __future__ import annotations

import itertools
import threading
from typing import Optional

import torch
import torch.nn.functional as F


def write_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatters k, v `[T, H_kv, D]` into the caches at `slot_mapping[T]`; slot -1 is skipped."""
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    if not bool((slots >= 0).all()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    index = (torch.div(slots, block_size, rounding_mode="floor"), slots % block_size)
    k_cache.index_put_(index, k.to(k_cache.dtype))
    v_cache.index_put_(index, v.to(v_cache.dtype))


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: Optional[int] = None,
) -> torch.Tensor:
    """Causal attention of a mixed batch over the paged cache.

    q: `[T, H, D]`, the new tokens of all sequences back to back; sequence b owns rows
    `query_start_loc[b]:query_start_loc[b+1]`. seq_lens[b] is its context length including
    the new tokens (already written to the cache), so its query i sits at position
    `seq_lens[b] - q_len + i`. A key at position j is visible to a query at p when j <= p and,
    with a sliding window W, p - j < W. Returns `[T, H, D]` in q's dtype; computed in fp32.
    """
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[b + 1] - starts[b] for b in range(len(lens))]
    decodes = [b for b, n in enumerate(q_lens) if n == 1]
    pure_decode = len(decodes) == len(lens) == q.shape[0]
    position_bytes = 2 * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    groups = _decode_groups(decodes, lens, k_cache.shape[1], position_bytes)
    if len(groups) == 1 and pure_decode:
        # A pure decode step of similar lengths: one batched call, nothing to scatter.
        return _decode_batch(q, k_cache, v_cache, block_tables, lens, scale, sliding_window)
    out = torch.empty_like(q)
    for group in groups:
        rows = torch.tensor([starts[b] for b in group], device=q.device)
        index = torch.tensor(group, device=q.device)
        out.index_copy_(
            0,
            rows,
            _decode_batch(
                q.index_select(0, rows),
                k_cache,
                v_cache,
                block_tables.index_select(0, index),
                [lens[b] for b in group],
                scale,
                sliding_window,
            ),
        )
    for b, (seq_len, q_len) in enumerate(zip(lens, q_lens, strict=True)):
        if q_len <= 1:
            continue
        k, v = _gather_sequence(k_cache, v_cache, block_tables[b], seq_len)
        for lo in range(0, q_len, _QUERY_CHUNK):  # bounds the mask on long prompts
            hi = min(lo + _QUERY_CHUNK, q_len)
            first = seq_len - q_len + lo
            out[starts[b] + lo : starts[b] + hi] = _attend(
                q[starts[b] + lo : starts[b] + hi], k, v, first, scale, sliding_window
            )
    return out


# Decodes are batched by similar length. A batch is padded to its longest sequence, and
# another batched call costs about as much as this many padded key positions (measured on
# CPU: ~60 us vs ~0.1 us per position and sequence at head_dim 32, 4 KV heads). Batches
# of more than _MAX_GROUP_SEQS sequences were measured slower per byte than several
# smaller ones (the gathered K/V of a small batch stays in cache for SDPA).
_GROUP_COST_POSITIONS = 1024
_MAX_GROUP_SEQS = 16
# SDPA reads a group's gathered K and V right after the gather: a group of at most about
# this many bytes is still in the CPU's caches then. Measured with 64 decodes of ~260
# positions, 4 KV heads of 64 (2 KiB of K and V per position): groups of 8 (4 MiB) 3.4 ms
# per layer, of 16 4.2 ms; with 2 heads of 32 (512 B) groups of 16 stay the fastest.
_GROUP_BYTES = 6 << 20


def _decode_groups(
    decodes: list[int], lens: list[int], block_size: int, position_bytes: int = 0
) -> list[list[int]]:
    """Splits the one-token sequences into batches of similar length: equal-count slices
    of the length order, at most _MAX_GROUP_SEQS each (and, given the K+V bytes of one
    position, about _GROUP_BYTES of gathered K and V each), choosing the count that
    minimises the padded work plus the per-call cost. Returns [] when there are no
    decodes."""
    if len(decodes) <= 1:
        return [decodes] if decodes else []
    order = sorted(decodes, key=lambda b: lens[b])
    padded = [(lens[b] + block_size - 1) // block_size * block_size for b in order]
    max_seqs = _MAX_GROUP_SEQS
    if position_bytes:
        max_seqs = max(1, min(max_seqs, _GROUP_BYTES // (position_bytes * padded[-1])))
    least = -(-len(order) // max_seqs)
    best, best_cost = None, None
    for count in range(least, min(least + 3, len(order)) + 1):
        cuts = [len(order) * i // count for i in range(count + 1)]
        cost = sum((hi - lo) * padded[hi - 1] for lo, hi in itertools.pairwise(cuts))
        cost += (count - 1) * _GROUP_COST_POSITIONS
        if best_cost is None or cost < best_cost:
            best_cost = cost
            runs = [order[lo:hi] for lo, hi in itertools.pairwise(cuts)]
            best = [decodes] if count == 1 else runs
    return best


_QUERY_CHUNK = 1024


# --------------------------------------------------------------------------- gathering


class _Workspace(threading.local):
    """Per-thread gather buffers, grown on demand and reused from layer to layer."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device):
        # A buffer made under inference_mode cannot be written outside it (and vice versa
        # would leak autograd state), so each mode has its own.
        key = (name, dtype, device, torch.is_inference_mode_enabled())
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel + numel // 4, dtype=dtype, device=device)
            self.buffers[key] = buf
        return buf[:numel]


_workspace = _Workspace()


def _gather_blocks(cache: torch.Tensor, table: torch.Tensor, name: str) -> torch.Tensor:
    """`cache[table]` as `[n, block_size, H_kv, D]`, copied into the workspace when possible.

    The output aliases the workspace: it is valid until the next gather of the same name.
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    row = block_size * num_kv_heads * head_dim
    if (
        cache.stride(3) != 1
        or cache.stride(2) != head_dim
        or cache.stride(1) != num_kv_heads * head_dim
    ):
        return cache.index_select(0, table)  # an unusual layout: a plain (allocating) gather
    rows = cache.as_strided((num_blocks, row), (cache.stride(0), 1))
    buf = _workspace.get(name, table.shape[0] * row, cache.dtype, cache.device)
    out = buf.view(table.shape[0], row)
    torch.index_select(rows, 0, table, out=out)
    return out.view(table.shape[0], block_size, num_kv_heads, head_dim)


def _gather_sequence(
    k_cache: torch.Tensor, v_cache: torch.Tensor, table_row: torch.Tensor, seq_len: int
):
    """One sequence's first seq_len keys and values as fp32 `[H_kv, L, D]` views."""
    block_size = k_cache.shape[1]
    table = table_row[: (seq_len + block_size - 1) // block_size].long()
    k, v = (
        _gather_blocks(c, table, n).flatten(0, 1)[:seq_len].transpose(0, 1).float()
        for c, n in ((k_cache, "k"), (v_cache, "v"))
    )
    return k, v


# --------------------------------------------------------------------------- attention


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first_pos: int,
    scale: float,
    sliding_window: Optional[int],
) -> torch.Tensor:
    """q `[n, H, D]` at positions first_pos.. over fp32 k, v `[H_kv, L, D]`."""
    n, num_heads, head_dim = q.shape
    num_kv_heads, length = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    # [H_kv, G*n, D]: each KV head's query group stacked on the query axis
    qg = q.float().view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qg = qg.reshape(num_kv_heads, group * n, head_dim)
    q_pos = torch.arange(first_pos, first_pos + n, device=q.device)
    k_pos = torch.arange(length, device=q.device)
    visible = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        visible &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
    mask = visible.repeat(group, 1)  # [G*n, L]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    out = out.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3)
    return out.reshape(n, num_heads, head_dim).to(q.dtype)


def _decode_batch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    scale: float,
    sliding_window: Optional[int],
) -> torch.Tensor:
    """One query per sequence, q `[B, H, D]`; keys gathered up to the longest sequence and
    padding masked out. Returns `[B, H, D]` in q's dtype."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    n_blocks = (max(seq_lens) + block_size - 1) // block_size
    length = n_blocks * block_size
    table = block_tables[:, :n_blocks].long().flatten()
    # [B, H_kv, L, D] strided views of the workspace; SDPA takes them as they are
    k = _gather_blocks(k_cache, table, "k").view(batch, length, num_kv_heads, head_dim)
    v = _gather_blocks(v_cache, table, "v").view(batch, length, num_kv_heads, head_dim)
    k, v = k.transpose(1, 2).float(), v.transpose(1, 2).float()
    lens = torch.tensor(seq_lens, device=q.device)[:, None]
    k_pos = torch.arange(length, device=q.device)[None, :]
    visible = k_pos < lens
    if sliding_window is not None:
        visible &= k_pos > lens - 1 - sliding_window
    qg = q.float().view(batch, num_kv_heads, group, head_dim)  # the group is the query axis
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=visible[:, None, None, :], scale=scale)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)
