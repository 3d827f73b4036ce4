"""The CPU prefill-attention kernel (C, built on first use) against the torch path that gathers
each sequence and runs SDPA with an explicit mask: causal from position zero, chunks over a
cached prefix, GQA ratios, sliding windows, block sizes, lengths that do not fill a block,
batches mixing prefills and decodes, head sizes; its narrower builds on the same CPU (AVX2
where AVX-512 is, plain C); and when the
CPU path (cpu_attention.py) dispatches to it or declines it."""

from __future__ import annotations

import random

import pytest
import torch

from pdpool.kernels import cpu_decode_attention as decode_kernel
from pdpool.kernels import cpu_prefill_attention as native
from pdpool.kernels import cpu_attention, reference

pytestmark = pytest.mark.skipif(
    not native.available(), reason="no C compiler for the kernel (or PDPOOL_CPU_PREFILL_KERNEL=0)"
)


def _case(heads, kv_heads, dim, q_lens, seq_lens, block_size=16, seed=0):
    """q `[T, H, D]` and caches that are strided views of an engine-like kv_cache, with
    block tables scattered at random over it."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    kv = torch.randn(num_blocks, 3, 2, block_size, kv_heads, dim, generator=gen)
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    tables, i = [], 0
    for n in per_seq:
        tables.append(ids[i : i + n])
        i += n
    width = max(per_seq)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return q, kv[:, 1, 0], kv[:, 1, 1], block_tables, starts


def _torch_path(q, k_cache, v_cache, tables, starts, seq_lens, scale, window, monkeypatch):
    """The torch reference (no C kernel in it)."""
    return reference.paged_attention_reference(
        q,
        k_cache,
        v_cache,
        tables,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        scale,
        window,
    )


def _check(heads, kv_heads, dim, q_lens, seq_lens, monkeypatch, window=None, block_size=16):
    q, k_cache, v_cache, tables, starts = _case(heads, kv_heads, dim, q_lens, seq_lens, block_size)
    scale = dim**-0.5
    assert native.usable_for(q, k_cache, v_cache)
    expected = _torch_path(
        q, k_cache, v_cache, tables, starts, seq_lens, scale, window, monkeypatch
    )
    for build, threads in (("native", 1), ("avx2", 1), ("portable", 1), ("native", 3)):
        got = native.paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            tables,
            starts,
            seq_lens,
            scale,
            window,
            build=build,
            threads=threads,
        )
        # float32, the C kernel's online softmax and SIMD sums against SDPA: rounding only
        # (~1e-6); a wrong mask, block or scale is off by ~1e-1. (The same below.)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# GQA ratios 1, 2, 4, 8 and groups wider than a tile's rows (24 with AVX2, 48 with AVX-512:
# taken in slices)
HEADS = [(4, 4), (4, 2), (8, 2), (8, 1), (32, 1), (64, 1)]


@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("dim", [32, 64, 128])
def test_causal_prompts_from_position_zero(heads, kv_heads, dim, monkeypatch):
    lens = [1, 5, 16, 47, 130]  # inside one block, one full block, a few key chunks
    _check(heads, kv_heads, dim, lens, lens, monkeypatch)


@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_chunks_over_a_cached_prefix(heads, kv_heads, monkeypatch):
    # the queries start where the cache ends: mid-block, on a boundary, far in
    q_lens = [3, 16, 40, 100, 1]
    seq_lens = [20, 48, 41, 350, 77]
    _check(heads, kv_heads, 64, q_lens, seq_lens, monkeypatch)


@pytest.mark.parametrize("window", [1, 5, 16, 37, 64, 500])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1)])
def test_sliding_windows(window, heads, kv_heads, monkeypatch):
    q_lens = [60, 130, 7, 1, 200]
    seq_lens = [60, 260, 100, 90, 333]
    _check(heads, kv_heads, 32, q_lens, seq_lens, monkeypatch, window=window)


@pytest.mark.parametrize("block_size", [1, 5, 8, 16, 32])
def test_block_sizes_and_lengths_that_do_not_fill_a_block(block_size, monkeypatch):
    q_lens = [9, 31, 2, 70]
    seq_lens = [9, 33, 40, 101]
    _check(8, 4, 64, q_lens, seq_lens, monkeypatch, block_size=block_size)


@pytest.mark.parametrize("window", [None, 24])
def test_a_batch_mixing_prefills_and_decodes(window, monkeypatch):
    q_lens = [1, 64, 1, 1, 200, 1, 13, 0]  # one sequence without queries this step
    seq_lens = [50, 64, 300, 2, 230, 17, 13, 8]
    _check(8, 2, 64, q_lens, seq_lens, monkeypatch, window=window)


@pytest.mark.parametrize("dim", [6, 8, 48, 80, 256])
def test_head_sizes_without_their_own_instance(dim, monkeypatch):
    _check(4, 2, dim, [33, 1], [60, 9], monkeypatch)


def test_a_strided_query_view_is_read_in_place(monkeypatch):
    # q as the model makes it: a slice of a wider projection
    q, k_cache, v_cache, tables, starts = _case(4, 2, 32, [40, 1], [70, 9])
    wide = torch.randn(q.shape[0], 8, 32)
    wide[:, 2:6] = q
    view = wide[:, 2:6]
    assert not view.is_contiguous()
    got = native.paged_prefill_attention(view, k_cache, v_cache, tables, starts, [70, 9], 0.2, None)
    expected = _torch_path(q, k_cache, v_cache, tables, starts, [70, 9], 0.2, None, monkeypatch)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_cpu_path_uses_it_for_steps_with_prefills(monkeypatch):
    q, k_cache, v_cache, tables, starts = _case(4, 2, 32, [1, 30], [31, 30])
    calls = []
    real = native.paged_prefill_attention
    monkeypatch.setattr(
        native, "paged_prefill_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    lens = torch.tensor([31, 30], dtype=torch.int32)
    starts_t = torch.tensor(starts, dtype=torch.int32)
    cpu_attention.paged_attention_cpu(q, k_cache, v_cache, tables, starts_t, lens, 0.2)
    assert calls == [1]
    reference.paged_attention_reference(q, k_cache, v_cache, tables, starts_t, lens, 0.2)
    assert calls == [1]  # the reference is torch only
    # a pure decode step goes to the decode kernel instead
    decode_q = q[:2]
    one_each = torch.arange(3, dtype=torch.int32)
    cpu_attention.paged_attention_cpu(decode_q, k_cache, v_cache, tables, one_each, lens, 0.2)
    assert calls == [1]


@pytest.mark.parametrize("window", [None, 40])
def test_a_mixed_step_leaves_its_decodes_to_the_decode_kernel(window, monkeypatch):
    q_lens = [1, 90, 1, 33, 1]
    seq_lens = [300, 90, 41, 200, 1]
    q, k_cache, v_cache, tables, starts = _case(8, 2, 64, q_lens, seq_lens)
    decoded = []
    real = decode_kernel.paged_decode_attention
    monkeypatch.setattr(
        decode_kernel, "paged_decode_attention", lambda *a: decoded.append(a[4]) or real(*a)
    )
    got = cpu_attention.paged_attention_cpu(
        q,
        k_cache,
        v_cache,
        tables,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        0.125,
        window,
    )
    assert decoded == [[300, 41, 1]]
    expected = _torch_path(
        q, k_cache, v_cache, tables, starts, seq_lens, 0.125, window, monkeypatch
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_declines_bf16():
    q, k_cache, v_cache, _, _ = _case(4, 2, 32, [20], [20])
    assert not native.usable_for(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16())


def test_shares_its_tiles_over_torch_threads_when_there_are_enough(monkeypatch):
    """By default a call with many tiles runs on as many threads as torch uses, one with
    few tiles on one; the output is the one-thread output either way."""
    q_lens = [300, 1, 700]
    seq_lens = [300, 900, 1000]
    q, k_cache, v_cache, tables, starts = _case(8, 2, 64, q_lens, seq_lens)
    one = native.paged_prefill_attention(
        q, k_cache, v_cache, tables, starts, seq_lens, 0.125, None, threads=1
    )
    parts_used = []
    run_parts = native.cpu_parallel.run_parts
    monkeypatch.setattr(
        native.cpu_parallel,
        "run_parts",
        lambda run, parts: (parts_used.append(parts), run_parts(run, parts)),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        shared = native.paged_prefill_attention(
            q, k_cache, v_cache, tables, starts, seq_lens, 0.125, None
        )
        native.paged_prefill_attention(
            q[:2], k_cache, v_cache, tables[:1], [0, 2], [2], 0.125, None
        )
    finally:
        torch.set_num_threads(threads)
    assert parts_used == [2, 1]
    # Exact on purpose: threads split the work by tiles, each computed whole by one thread in
    # the same order, so the thread count changes no float operation.
    torch.testing.assert_close(shared, one, rtol=0, atol=0)


def test_rows_copied_together_give_what_the_cache_gives_in_place(monkeypatch):
    """A part with three or more tiles of a KV head copies that head's K/V rows together
    first; a part with fewer reads them where they lie in the cache. On one thread every
    head here is copied, on three none is: the outputs are equal to the bit."""
    q_lens, seq_lens = [72, 80], [72, 400]  # three and four tiles per KV head (24 tokens each)
    q, k_cache, v_cache, tables, starts = _case(8, 4, 64, q_lens, seq_lens)
    copied, in_place = (
        native.paged_prefill_attention(
            q, k_cache, v_cache, tables, starts, seq_lens, 0.125, None, threads=threads
        )
        for threads in (1, 3)
    )
    torch.testing.assert_close(copied, in_place, rtol=0, atol=0)
    expected = _torch_path(q, k_cache, v_cache, tables, starts, seq_lens, 0.125, None, monkeypatch)
    torch.testing.assert_close(copied, expected, rtol=1e-5, atol=1e-5)


def test_a_prefix_longer_than_the_copy_takes_is_read_in_place(monkeypatch):
    # over 8192 keys the rows are not copied (the copy would need their size again)
    _check(8, 4, 64, [96, 50], [8300, 8192], monkeypatch)


def test_bad_tables_and_lengths_are_refused_not_read():
    q, k_cache, v_cache, tables, starts = _case(4, 2, 32, [20, 40], [20, 40])
    bad = tables.clone()
    bad[0, 0] = k_cache.shape[0]
    with pytest.raises(ValueError, match="block ids"):
        native.paged_prefill_attention(q, k_cache, v_cache, bad, starts, [20, 40], 0.2, None)
    with pytest.raises(ValueError, match="outruns"):
        native.paged_prefill_attention(q, k_cache, v_cache, tables, starts, [20, 400], 0.2, None)
    with pytest.raises(ValueError, match="queries for"):
        native.paged_prefill_attention(q, k_cache, v_cache, tables, starts, [20, 30], 0.2, None)
    with pytest.raises(ValueError, match="query starts"):
        native.paged_prefill_attention(
            q, k_cache, v_cache, tables, [0, 20, 50], [20, 40], 0.2, None
        )


def test_head_sizes_above_its_limit_are_left_to_torch():
    q, k_cache, v_cache, _, _ = _case(2, 1, native.MAX_DIM + 32, [5], [5])
    assert not native.usable_for(q, k_cache, v_cache)
