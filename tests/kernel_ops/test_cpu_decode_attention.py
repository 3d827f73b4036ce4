"""The CPU decode-attention kernel (C, built on first use) against the torch path that
gathers blocks and runs SDPA: GQA, sliding windows, partial blocks, one-token sequences,
caches that are strided views of the engine's kv_cache; and when it declines to run."""

from __future__ import annotations

import random

import pytest
import torch

from pdpool.kernels import cpu_decode_attention as native
from pdpool.kernels import cpu_attention, reference

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler for the kernel")


def _case(heads, kv_heads, dim, lens, block_size=16, layers=3, seed=0):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    per_seq = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(per_seq) + 5
    kv = torch.randn(num_blocks, layers, 2, block_size, kv_heads, dim, generator=gen)
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    tables, i = [], 0
    for n in per_seq:
        tables.append(ids[i : i + n])
        i += n
    width = max(per_seq)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lens), heads, dim, generator=gen)
    return q, kv[:, 1, 0], kv[:, 1, 1], block_tables


@pytest.mark.parametrize(
    "heads,kv_heads,dim,window",
    [
        (4, 2, 32, None),
        (8, 4, 64, None),
        (8, 8, 64, None),
        (6, 2, 48, 37),
        (4, 1, 80, 5),
        # wide groups: many query heads read one KV head
        (8, 1, 64, None),
        (6, 1, 32, 9),
        (16, 2, 128, None),
        (2, 1, 256, None),
    ],
)
def test_native_matches_the_gather_and_sdpa_path(heads, kv_heads, dim, window):
    lens = [1, 2, 15, 16, 17, 40, 200, 333]
    q, k_cache, v_cache, tables = _case(heads, kv_heads, dim, lens)
    assert native.usable_for(q, k_cache, v_cache)
    got = native.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5, window)
    for threads in (2, 3):
        shared = native.paged_decode_attention(
            q, k_cache, v_cache, tables, lens, dim**-0.5, window, threads=threads
        )
        # Exact on purpose: threads split the batch by sequences, each computed whole by one
        # thread in the same order, so the thread count changes no float operation.
        torch.testing.assert_close(shared, got, rtol=0, atol=0)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    expected = reference.paged_attention_reference(
        q, k_cache, v_cache, tables, qsl, seq_lens, dim**-0.5, window
    )
    # float32, the C kernel's SIMD sums against gather + SDPA: rounding only (~1e-6); a wrong
    # block, window or scale is off by ~1e-1. (The same below.)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 5, 8, 12, 32])
def test_block_sizes_that_do_not_hold_eight_positions_evenly(block_size):
    lens = [1, 7, 8, 9, 31, 64, 101]
    q, k_cache, v_cache, tables = _case(8, 4, 64, lens, block_size=block_size)
    got = native.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, None)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    expected = reference.paged_attention_reference(
        q, k_cache, v_cache, tables, qsl, seq_lens, 0.125, None
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_cpu_path_uses_it_for_pure_decode_steps(monkeypatch):
    lens = [30, 31]
    q, k_cache, v_cache, tables = _case(4, 2, 32, lens)
    calls = []
    real = native.paged_decode_attention
    monkeypatch.setattr(native, "paged_decode_attention", lambda *a: calls.append(1) or real(*a))
    qsl = torch.arange(3, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cpu_attention.paged_attention_cpu(q, k_cache, v_cache, tables, qsl, seq_lens, 0.2)
    assert calls == [1]
    reference.paged_attention_reference(q, k_cache, v_cache, tables, qsl, seq_lens, 0.2)
    assert calls == [1]  # the reference is torch only


def test_declines_bf16():
    q, k_cache, v_cache, _ = _case(4, 2, 32, [20])
    assert not native.usable_for(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16())


@pytest.mark.parametrize(
    "lens,threads,bounds",
    [
        ([100] * 10, 3, [0, 4, 7, 10]),  # about equal positions per run
        ([5000, 1, 1, 1], 2, [0, 1, 4]),
        ([1, 1, 1, 5000], 2, [0, 4]),  # one sequence is never split
        ([3], 4, [0, 1]),
        ([], 2, [0, 0]),
        ([10, 10], None, [0, 2]),  # too few positions to hand a run to another thread
    ],
)
def test_batch_runs_per_thread(lens, threads, bounds):
    assert native._batch_parts(lens, threads) == bounds


def test_a_big_batch_may_use_the_threads_allowed_beyond_torchs(monkeypatch):
    """A decode step runs torch on fewer threads than a prompt step; a batch with enough K/V
    to stream may still use the prompt steps' count."""
    monkeypatch.setattr(native.cpu_parallel, "_threads_for_big_calls", 1)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        big = [native.BIG_CALL_POSITIONS // 4] * 4
        middling = [native.MIN_POSITIONS_TO_SPLIT] * 4
        assert native._batch_parts(big, None) == [0, 4]
        native.cpu_parallel.allow_big_calls(2)
        assert native._batch_parts(big, None) == [0, 2, 4]
        assert native._batch_parts(middling, None) == [0, 4]
    finally:
        torch.set_num_threads(before)


def test_out_of_range_tables_and_lengths_are_refused_not_read():
    q, k_cache, v_cache, tables = _case(4, 2, 32, [20, 40])
    bad = tables.clone()
    bad[0, 0] = k_cache.shape[0]
    with pytest.raises(ValueError, match="block ids"):
        native.paged_decode_attention(q, k_cache, v_cache, bad, [20, 40], 0.2, None)
    with pytest.raises(ValueError, match="outruns"):
        native.paged_decode_attention(q, k_cache, v_cache, tables, [20, 40 + 16 * 9], 0.2, None)


def test_head_sizes_above_its_limit_are_left_to_torch():
    q, k_cache, v_cache, tables = _case(2, 1, native.MAX_DIM + 32, [5])
    assert not native.usable_for(q, k_cache, v_cache)
    with pytest.raises(ValueError, match="head size"):
        native.paged_decode_attention(q, k_cache, v_cache, tables, [5], 0.1, None)
