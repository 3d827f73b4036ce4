"""paged_attention (Triton, through ops) against paged_attention_reference."""

import math

import pytest
import torch

from pdpool.kernels import ops
from pdpool.kernels.paged_attention_kernel import paged_attention_triton
from pdpool.kernels.reference import paged_attention_reference

from tests.support.kernel_helpers import assert_close, batch_tables, gpu, paged_cache, requires_cuda

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture
def force_triton(monkeypatch):
    """Route ops to the Triton kernels on any device (the interpreter on CPU)."""
    monkeypatch.setattr(ops, "use_triton", lambda device: True)


def _batch(device, dtype, block_size, num_kv_heads, group, head_dim, q_lens, context_lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, context_lens, strict=True)]
    num_blocks = sum((s + block_size - 1) // block_size for s in seq_lens) + 3
    _, k_cache, v_cache = paged_cache(
        num_blocks, 2, block_size, num_kv_heads, head_dim, dtype, device
    )
    tables = batch_tables(seq_lens, block_size, num_blocks, device, gen)
    starts = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, dtype=dtype, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables, starts, lens


CASES = [
    # block, H_kv, group, D, q_lens, context_lens, window, dtype
    pytest.param(16, 2, 1, 64, [7], [0], None, F32, id="prefill-empty-prefix"),
    pytest.param(16, 2, 2, 64, [5, 1, 17], [0, 20, 3], None, F32, id="mixed-gqa2"),
    pytest.param(32, 1, 4, 128, [40], [33], None, F32, id="prefix-partial-blocks-gqa4"),
    pytest.param(16, 2, 1, 256, [3, 0, 1], [60, 5, 7], None, F32, id="d256-empty-query"),
    pytest.param(16, 2, 2, 64, [20, 1], [11, 50], 7, F32, id="window7-mixed"),
    pytest.param(32, 2, 4, 128, [9, 1, 1], [70, 3, 90], 40, F16, id="window40-fp16"),
    pytest.param(16, 4, 2, 128, [12, 1], [5, 37], None, F16, id="fp16-mixed"),
    pytest.param(32, 2, 2, 64, [6, 1], [26, 64], None, BF16, id="bf16-mixed"),
    pytest.param(16, 1, 2, 256, [4, 1], [13, 30], 16, BF16, id="bf16-d256-window"),
    pytest.param(16, 2, 1, 80, [3, 1], [14, 9], None, F32, id="d80-padded-dims"),
    pytest.param(16, 3, 1, 64, [18], [0], 100, F32, id="window-longer-than-seq"),
]

DECODE_CASES = [
    # block, H_kv, group, D, context_lens, window, dtype, num_splits (None = heuristic)
    pytest.param(16, 2, 2, 64, [0, 20, 300], None, F32, None, id="decode-auto-split"),
    pytest.param(16, 2, 1, 128, [130, 7], None, F32, 4, id="decode-4-splits"),
    pytest.param(32, 1, 4, 64, [250, 31, 64], 50, F32, 8, id="decode-window-8-splits"),
    pytest.param(16, 2, 2, 64, [3, 5], None, F32, 16, id="decode-more-splits-than-tiles"),
    pytest.param(32, 2, 2, 128, [200, 45], None, F16, 4, id="decode-fp16-splits"),
    pytest.param(16, 2, 4, 256, [99, 140], 64, BF16, 2, id="decode-bf16-d256-window"),
    pytest.param(16, 4, 1, 64, [40, 1], None, BF16, 1, id="decode-no-split"),
]


@pytest.mark.parametrize(
    "block_size,num_kv_heads,group,head_dim,q_lens,context_lens,window,dtype", CASES
)
def test_mixed_batch_matches_reference(
    device,
    force_triton,
    block_size,
    num_kv_heads,
    group,
    head_dim,
    q_lens,
    context_lens,
    window,
    dtype,
):
    q, k_cache, v_cache, tables, starts, lens = _batch(
        device, dtype, block_size, num_kv_heads, group, head_dim, q_lens, context_lens
    )
    scale = head_dim**-0.5
    expected = paged_attention_reference(q, k_cache, v_cache, tables, starts, lens, scale, window)
    out = ops.paged_attention(q, k_cache, v_cache, tables, starts, lens, scale, window)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close(out, expected, dtype)


@pytest.mark.parametrize(
    "block_size,num_kv_heads,group,head_dim,context_lens,window,dtype,splits", DECODE_CASES
)
def test_decode_split_kv_matches_reference(
    device, block_size, num_kv_heads, group, head_dim, context_lens, window, dtype, splits
):
    q_lens = [1] * len(context_lens)
    q, k_cache, v_cache, tables, starts, lens = _batch(
        device, dtype, block_size, num_kv_heads, group, head_dim, q_lens, context_lens
    )
    scale = 1.0 / math.sqrt(head_dim)
    expected = paged_attention_reference(q, k_cache, v_cache, tables, starts, lens, scale, window)
    out = paged_attention_triton(
        q,
        k_cache,
        v_cache,
        tables,
        starts,
        lens,
        scale,
        window,
        max_query_len=1,
        max_seq_len=int(lens.max()),
        num_splits=splits,
    )
    assert_close(out, expected, dtype)


def test_mixed_batch_with_forced_splits(device):
    """The split-KV path also serves prefill tiles (partials are indexed by token)."""
    q, k_cache, v_cache, tables, starts, lens = _batch(device, F32, 16, 2, 2, 64, [9, 1], [40, 77])
    expected = paged_attention_reference(q, k_cache, v_cache, tables, starts, lens, 0.125)
    out = paged_attention_triton(q, k_cache, v_cache, tables, starts, lens, 0.125, num_splits=4)
    assert_close(out, expected, F32)


def test_each_query_sees_only_its_own_sequence(device, force_triton):
    """Identical queries over different caches give different rows: no cross-sequence reads."""
    q, k_cache, v_cache, tables, starts, lens = _batch(device, F32, 16, 1, 1, 64, [1, 1], [30, 30])
    q[1] = q[0]
    out = ops.paged_attention(q, k_cache, v_cache, tables, starts, lens, 0.125)
    assert not torch.allclose(out[0], out[1])
    tables[1] = tables[0]
    out = ops.paged_attention(q, k_cache, v_cache, tables, starts, lens, 0.125)
    # float32 defaults written out: the rows read the same blocks, so only rounding may tell
    # them apart (a row that read another sequence's blocks differs by ~1e-1, as above).
    torch.testing.assert_close(out[0], out[1], rtol=1.3e-6, atol=1e-5)


def test_rejects_bad_inputs():
    q, k_cache, v_cache, tables, starts, lens = _batch("cpu", F32, 16, 2, 2, 64, [3], [4])
    with pytest.raises(ValueError, match="multiple of KV heads"):
        ops.paged_attention(q[:, :3], k_cache, v_cache, tables, starts, lens, 0.1)
    with pytest.raises(ValueError, match="q must be"):
        ops.paged_attention(q[..., :32], k_cache, v_cache, tables, starts, lens, 0.1)
    with pytest.raises(ValueError, match="B\\+1"):
        ops.paged_attention(q, k_cache, v_cache, tables, starts[:1], lens, 0.1)
    with pytest.raises(ValueError, match="sliding_window must be positive"):
        ops.paged_attention(q, k_cache, v_cache, tables, starts, lens, 0.1, sliding_window=0)
    with pytest.raises(ValueError, match="int32 or int64"):
        ops.paged_attention(q, k_cache, v_cache, tables.float(), starts, lens, 0.1)


@gpu
@requires_cuda
@pytest.mark.parametrize(
    "head_dim,group,window", [(128, 2, None), (64, 4, None), (256, 4, 512), (128, 1, 1024)]
)
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_full_size_gpu(dtype, head_dim, group, window):
    """Qwen3-sized heads: 2 long prefills with cached prefixes and 62 long decodes."""
    device = torch.device("cuda")
    q_lens = [1500, 700] + [1] * 62
    context_lens = [0, 2300] + [3000 + 37 * i for i in range(62)]
    q, k_cache, v_cache, tables, starts, lens = _batch(
        device, dtype, 16, 8, group, head_dim, q_lens, context_lens
    )
    scale = head_dim**-0.5
    expected = paged_attention_reference(q, k_cache, v_cache, tables, starts, lens, scale, window)
    out = ops.paged_attention(
        q,
        k_cache,
        v_cache,
        tables,
        starts,
        lens,
        scale,
        window,
        max_query_len=1500,
        max_seq_len=int(lens.max()),
    )
    assert_close(out, expected, dtype)
    decodes = slice(2200, None)
    dec_starts = starts[2:] - starts[2]
    out = ops.paged_attention(
        q[decodes],
        k_cache,
        v_cache,
        tables[2:],
        dec_starts,
        lens[2:],
        scale,
        window,
        max_query_len=1,
    )
    assert_close(out, expected[decodes], dtype)


def _plan(**overrides):
    from pdpool.kernels.paged_attention_kernel import plan_attention

    args = dict(
        num_tokens=64,
        num_seqs=64,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype=torch.bfloat16,
        max_query_len=1,
        max_seq_len=8192,
        sliding_window=None,
        sms=132,
    )
    args.update(overrides)
    return plan_attention(**args)


def test_split_plan_fills_the_gpu_only_when_needed():
    assert _plan().num_splits == 1  # 512 programs already
    assert _plan(num_tokens=1, num_seqs=1, max_seq_len=32768).num_splits == 64
    assert _plan(num_tokens=1, num_seqs=1, max_seq_len=300).num_splits == 1  # short: no split
    assert _plan(num_tokens=4, num_seqs=4, max_seq_len=4096).num_splits == 16  # 4 tiles each
    assert _plan(max_query_len=7, num_tokens=70).num_splits == 1  # prefills never split


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize(
    "head_dim,max_query_len", [(64, 1), (128, 1), (256, 1), (128, 300), (256, 300)]
)
def test_plan_tiles_are_dot_sized(group, head_dim, max_query_len):
    """Every tile has >= 16 rows (tl.dot's minimum) and room for the whole GQA group."""
    ce = _plan(
        num_heads=8 * group, head_dim=head_dim, max_query_len=max_query_len, num_tokens=300
    ).constexprs
    assert ce["BLOCK_Q"] * ce["GROUP_PAD"] >= 16
    assert ce["GROUP_PAD"] >= group and ce["D_PAD"] >= head_dim
    assert ce["DECODE_ONLY"] == (max_query_len == 1)
