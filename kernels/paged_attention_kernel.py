"""Triton paged attention for a batch that mixes prefills and decodes.

One kernel family, the semantics of `reference.paged_attention_reference`:

- A program owns one KV head and a tile of BLOCK_Q query tokens of one sequence; the GQA group
  of query heads that share the KV head is packed into the rows of the tile
  (`BLOCK_M = BLOCK_Q * GROUP_PAD`), so every K/V tile is read once per KV head.
- Query tiles of all sequences are numbered back to back without a host sync: sequence b's
  first tile is `query_start_loc[b] // BLOCK_Q + b` (an upper bound of the tiles before it);
  a program finds its sequence by binary search and exits when its tile is past the end.
- K/V are read through the block table key by key (`block = table[pos // block_size]`), so a
  KV tile may span cache blocks; strides come from the caller (the cache is a strided view).
- Causal and sliding-window limits bound the key range of a tile, so masked-out tiles are
  never read; online softmax in fp32 (exp2).
- Split-KV (decode): with few sequences the key range is cut into NUM_SPLITS parts, each
  program writes an unnormalised partial output and its (max, sum); a merge kernel combines
  them, so that small batches with long contexts still fill the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Largest b with `query_start_loc[b] // BLOCK_Q + b <= tile`."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,
    num_seqs,
    window,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt_seq,
    num_heads,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if DECODE_ONLY:
        seq = tile_id
        q_tile = 0
    else:
        seq = _find_sequence(query_start_loc_ptr, num_seqs, tile_id, BLOCK_Q)
        q_tile = tile_id - (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # position of the sequence's first new token

    rows = tl.arange(0, BLOCK_M)
    token = q_tile * BLOCK_Q + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_valid = (token < q_len) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    q_pos = context_len + token
    dims = tl.arange(0, D_PAD)
    dim_valid = dims < HEAD_DIM

    q_offsets = (
        (q_start + token).to(tl.int64)[:, None] * stride_qt
        + head[:, None] * stride_qh
        + dims[None, :] * stride_qd
    )
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if UPCAST:  # the interpreter's tl.dot is wrong for bf16: compute in fp32 there
        q = q.to(tl.float32)

    # Keys this tile can see: up to its last query, and (window) from its first query's horizon.
    first_pos = context_len + q_tile * BLOCK_Q
    kv_end = tl.minimum(first_pos + BLOCK_Q, seq_len)
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(first_pos - window + 1, 0)
        kv_begin = (kv_begin // TILE_N) * TILE_N
    if NUM_SPLITS > 1:
        num_tiles = tl.cdiv(kv_end - kv_begin, TILE_N)
        tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        split_begin = kv_begin + split * tiles_per_split * TILE_N
        split_end = tl.minimum(split_begin + tiles_per_split * TILE_N, kv_end)
    else:
        split_begin = kv_begin
        split_end = kv_end

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for start in range(split_begin, split_end, TILE_N):
        key_pos = start + tl.arange(0, TILE_N)
        key_valid = key_pos < split_end
        block = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        offset = key_pos % BLOCK_SIZE
        k_offsets = (
            block[None, :] * stride_kb
            + offset[None, :] * stride_ks
            + kv_head * stride_kh
            + dims[:, None] * stride_kd
        )
        k = tl.load(
            k_cache_ptr + k_offsets, mask=key_valid[None, :] & dim_valid[:, None], other=0.0
        )
        scores = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale_log2
        visible = (key_pos[None, :] <= q_pos[:, None]) & key_valid[None, :]
        if USE_WINDOW:
            visible = visible & ((q_pos[:, None] - key_pos[None, :]) < window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_offsets = (
            block[:, None] * stride_vb
            + offset[:, None] * stride_vs
            + kv_head * stride_vh
            + dims[None, :] * stride_vd
        )
        v = tl.load(
            v_cache_ptr + v_offsets, mask=key_valid[:, None] & dim_valid[None, :], other=0.0
        )
        acc = acc * alpha[:, None] + tl.dot(
            p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION
        )
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offsets = (
            (q_start + token).to(tl.int64)[:, None] * stride_ot
            + head[:, None] * stride_oh
            + dims[None, :] * stride_od
        )
        tl.store(
            out_ptr + o_offsets,
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        # partials are [T, H, NUM_SPLITS, (D_PAD)] contiguous fp32
        part_row = ((q_start + token).to(tl.int64) * num_heads + head) * NUM_SPLITS + split
        tl.store(part_max_ptr + part_row, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part_row, l_i, mask=row_valid)
        tl.store(
            part_out_ptr + part_row[:, None] * D_PAD + dims[None, :], acc, mask=row_valid[:, None]
        )


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    stride_ot,
    stride_oh,
    stride_od,
    num_heads,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = (token * num_heads + head) * NUM_SPLITS
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, D_PAD)
    maxes = tl.load(part_max_ptr + row + splits)
    sums = tl.load(part_sum_ptr + row + splits)
    top = tl.max(maxes, 0)
    weights = tl.where(maxes == float("-inf"), 0.0, tl.exp2(maxes - top))
    total = tl.sum(weights * sums, 0)
    parts = tl.load(part_out_ptr + (row + splits)[:, None] * D_PAD + dims[None, :])
    out = tl.sum(parts * weights[:, None], 0) / total
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def _interpreting() -> bool:
    """True when the kernels were decorated under TRITON_INTERPRET=1 (CPU tests)."""
    return type(_paged_attention_kernel).__name__ == "InterpretedFunction"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _num_splits(sms: int, num_seqs: int, num_kv_heads: int, max_seq_len: int, tile_n: int) -> int:
    """Enough KV splits that decode programs cover the GPU about twice; each split >= 4 tiles."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = -(-2 * sms // programs)
    cap = max(1, max_seq_len // (4 * tile_n))
    return min(_next_pow2(max(1, min(wanted, cap))), 64)


@dataclass(frozen=True)
class AttentionPlan:
    """How one batch is launched: grid, compile-time constants, warps. Pure, host-side."""

    num_q_tiles: int
    num_splits: int
    constexprs: dict
    num_warps: int
    num_stages: int


def plan_attention(
    *,
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: Optional[int],
    sms: int,
    num_splits: Optional[int] = None,
    interpreting: bool = False,
) -> AttentionPlan:
    group = num_heads // num_kv_heads
    group_pad = _next_pow2(group)
    d_pad = _next_pow2(head_dim)
    tile_n = 32 if d_pad >= 256 or dtype == torch.float32 else 64
    decode_only = max_query_len <= 1
    if decode_only:
        block_q = 1
        group_pad = max(group_pad, 16)  # tl.dot needs at least 16 rows
        if num_splits is None:
            num_splits = _num_splits(sms, num_seqs, num_kv_heads, max_seq_len, tile_n)
        num_q_tiles = num_seqs
    else:
        block_m = 64 if d_pad <= 128 and dtype != torch.float32 else 32
        block_q = max(1, block_m // group_pad)
        group_pad = max(group_pad, 16 // block_q)
        num_splits = 1 if num_splits is None else num_splits
        num_q_tiles = num_tokens // block_q + num_seqs
    num_splits = _next_pow2(max(1, num_splits))
    upcast = dtype == torch.bfloat16 and interpreting  # the interpreter's bf16 tl.dot is wrong
    window = 0 if sliding_window is None else int(sliding_window)
    constexprs = dict(
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        NUM_SPLITS=num_splits,
        DECODE_ONLY=decode_only,
        USE_WINDOW=window > 0,
        DOT_PRECISION="ieee" if dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast,
    )
    return AttentionPlan(
        num_q_tiles, num_splits, constexprs, num_warps=4 if d_pad <= 128 else 8, num_stages=2
    )


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter: still exercise the split path on long contexts


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: Optional[int] = None,
    max_query_len: Optional[int] = None,
    max_seq_len: Optional[int] = None,
    num_splits: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Triton version of `paged_attention_reference` (same arguments and result).

    `max_query_len` / `max_seq_len` are host-side hints that avoid a device sync; when the batch
    is decode only (max_query_len == 1) the KV range is split `num_splits` ways (default: from
    the GPU size). Inputs are assumed validated by `ops.paged_attention`.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len <= 1 and num_splits is None and max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    plan = plan_attention(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        num_heads=num_heads,
        num_kv_heads=k_cache.shape[2],
        head_dim=head_dim,
        block_size=k_cache.shape[1],
        dtype=q.dtype,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len or 0,
        sliding_window=sliding_window,
        sms=_sm_count(q.device),
        num_splits=num_splits,
        interpreting=_interpreting(),
    )
    num_splits, d_pad = plan.num_splits, plan.constexprs["D_PAD"]
    if num_splits > 1:
        part_out = torch.empty(
            num_tokens, num_heads, num_splits, d_pad, dtype=torch.float32, device=q.device
        )
        part_max = torch.empty(
            num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device
        )
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = out  # unused
    window = 0 if sliding_window is None else int(sliding_window)
    grid = (plan.num_q_tiles, k_cache.shape[2], num_splits)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_max,
        part_sum,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * math.log2(math.e),
        num_seqs,
        window,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.stride(3),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        v_cache.stride(3),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        block_tables.stride(0),
        num_heads,
        **plan.constexprs,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out,
            part_out,
            part_max,
            part_sum,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            num_heads,
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            NUM_SPLITS=num_splits,
        )
    return out
