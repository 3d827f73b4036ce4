"""The torch attention references (the engine's CPU path) against a from-scratch definition."""

import pytest
import torch

from pdpool.kernels.reference import paged_attention_reference, write_kv_reference

from tests.support.kernel_helpers import batch_tables, paged_cache


def naive_attention(q, keys, values, q_positions, scale, window):
    """Per query, per head: softmax over the visible keys of its own sequence, in fp64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // keys.shape[1]
    for i, pos in enumerate(q_positions):
        for h in range(q.shape[1]):
            lo = 0 if window is None else max(0, pos - window + 1)
            k = keys[lo : pos + 1, h // group].double()
            v = values[lo : pos + 1, h // group].double()
            weights = torch.softmax(k @ q[i, h].double() * scale, dim=0)
            out[i, h] = weights @ v
    return out


@pytest.mark.parametrize(
    "q_lens,context_lens,group,window,dtype",
    [
        ([1, 1, 1], [0, 17, 40], 2, None, torch.float32),  # decode batch
        ([6, 1, 3, 0], [0, 9, 30, 4], 4, None, torch.float32),  # mixed, empty query
        ([12, 1, 1], [5, 33, 2], 1, 4, torch.float32),  # sliding window
        ([5, 1], [20, 18], 2, None, torch.bfloat16),
    ],
)
def test_reference_matches_naive_definition(q_lens, context_lens, group, window, dtype):
    block_size, num_kv_heads, head_dim = 8, 2, 16
    seq_lens = [q + c for q, c in zip(q_lens, context_lens, strict=True)]
    num_blocks = sum((s + block_size - 1) // block_size for s in seq_lens) + 2
    _, k_cache, v_cache = paged_cache(
        num_blocks, 1, block_size, num_kv_heads, head_dim, dtype, "cpu", layer=0
    )
    tables = batch_tables(seq_lens, block_size, num_blocks, "cpu", torch.Generator().manual_seed(1))
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim).to(dtype)
    out = paged_attention_reference(
        q, k_cache, v_cache, tables, starts, torch.tensor(seq_lens, dtype=torch.int32), 0.3, window
    )
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        if q_len == 0:
            continue
        slots = [
            int(tables[b, j // block_size]) * block_size + j % block_size for j in range(seq_len)
        ]
        keys = k_cache.reshape(-1, num_kv_heads, head_dim)[slots]
        values = v_cache.reshape(-1, num_kv_heads, head_dim)[slots]
        rows = slice(int(starts[b]), int(starts[b + 1]))
        expected = naive_attention(
            q[rows], keys, values, range(seq_len - q_len, seq_len), 0.3, window
        )
        # against a float64 naive softmax: float32 rounds at ~1e-7 per op (1e-5 over the sums),
        # bfloat16 inputs and output at 7.8e-3 (2e-2); a wrong mask or block is off by ~1e-1.
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[rows].double(), expected, rtol=tol, atol=tol)


def test_write_kv_reference_places_rows_at_slots():
    _, k_cache, v_cache = paged_cache(3, 1, 4, 1, 2, torch.float32, "cpu", layer=0)
    before = k_cache.clone()
    k = torch.arange(6.0).view(3, 1, 2)
    write_kv_reference(k, -k, k_cache, v_cache, torch.tensor([5, -1, 8]))
    # Writes are copies: exact.
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[2, 0], -k[2])
    changed = (k_cache != before).any(dim=-1).any(dim=-1).nonzero().tolist()
    assert changed == [[1, 1], [2, 0]]
