"""The fast paths of the CPU attention (length-grouped decodes, the gather workspace, the
strided-layout fallback) and the rewritten layers, against from-scratch definitions."""

import pytest
import torch
import torch.nn.functional as F

from pdpool.engine.models.layers import GatedMLP, RMSNorm
from pdpool.kernels import reference
from pdpool.kernels.reference import paged_attention_reference, write_kv_reference

from tests.support.kernel_helpers import batch_tables, paged_cache
from .test_reference import naive_attention


def _check_against_naive(
    q_lens,
    context_lens,
    window=None,
    group=2,
    dtype=torch.float32,
    block_size=8,
    num_kv_heads=2,
    head_dim=16,
    k_cache=None,
    v_cache=None,
):
    seq_lens = [q + c for q, c in zip(q_lens, context_lens, strict=True)]
    num_blocks = sum((s + block_size - 1) // block_size for s in seq_lens) + 2
    if k_cache is None:
        _, k_cache, v_cache = paged_cache(
            num_blocks, 2, block_size, num_kv_heads, head_dim, dtype, "cpu", layer=1
        )
    tables = batch_tables(
        seq_lens, block_size, k_cache.shape[0], "cpu", torch.Generator().manual_seed(3)
    )
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim).to(dtype)
    out = paged_attention_reference(
        q, k_cache, v_cache, tables, starts, torch.tensor(seq_lens, dtype=torch.int32), 0.25, window
    )
    assert out.shape == q.shape and out.dtype == dtype
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        if q_len == 0:
            continue
        slots = [
            int(tables[b, j // block_size]) * block_size + j % block_size for j in range(seq_len)
        ]
        keys = torch.stack([k_cache[s // block_size, s % block_size] for s in slots])
        values = torch.stack([v_cache[s // block_size, s % block_size] for s in slots])
        rows = slice(int(starts[b]), int(starts[b + 1]))
        expected = naive_attention(
            q[rows], keys, values, range(seq_len - q_len, seq_len), 0.25, window
        )
        # against a float64 naive softmax: float32 rounds at ~1e-7 per op (1e-5 over the sums),
        # bfloat16 inputs and output at 7.8e-3 (2e-2); a wrong mask or block is off by ~1e-1.
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[rows].double(), expected, rtol=tol, atol=tol)
    return out


def test_decode_groups_partition_by_length():
    lens = [3, 400, 5, 390, 7, 410, 2, 395] * 4
    decodes = list(range(len(lens)))
    groups = reference._decode_groups(decodes, lens, block_size=16)
    assert len(groups) > 1, "short and long sequences should not share one padded batch"
    assert sorted(b for g in groups for b in g) == decodes
    maxima = [max(lens[b] for b in g) for g in groups]
    minima = [min(lens[b] for b in g) for g in groups]
    assert all(hi <= lo for hi, lo in zip(maxima, minima[1:], strict=False)), (
        "groups follow the length order"
    )
    similar = [100, 101, 103, 99, 102, 100]
    assert reference._decode_groups(list(range(6)), similar, 16) == [list(range(6))]
    assert reference._decode_groups([], [], 16) == []
    assert reference._decode_groups([4], [0, 0, 0, 0, 9], 16) == [[4]]


def test_pure_decode_with_mixed_lengths_matches_naive():
    # several length groups, one batched call each
    lens = [1, 300, 4, 280, 9, 150, 2, 310, 70, 5, 260, 3]
    assert len(reference._decode_groups(list(range(len(lens))), lens, 8)) > 1
    _check_against_naive([1] * len(lens), [n - 1 for n in lens])


def test_mixed_batch_grouped_decodes_and_prefills_with_window():
    q_lens = [1, 20, 1, 1, 13, 1, 1, 1, 0, 1]
    context = [250, 0, 3, 240, 40, 1, 260, 5, 7, 199]
    _check_against_naive(q_lens, context, window=37)


def test_bf16_cache_and_multi_query_heads():
    _check_against_naive([1, 1, 6, 1], [90, 2, 30, 60], group=4, dtype=torch.bfloat16)


def test_output_does_not_alias_the_workspace():
    first = _check_against_naive([1, 1, 1], [40, 3, 17])
    kept = first.clone()
    _check_against_naive([1, 5, 1, 1], [100, 60, 2, 300])  # larger: the workspace grows
    assert torch.equal(first, kept)  # `kept` is a copy: any change is an alias, exact


def test_unusual_cache_layout_uses_the_plain_gather():
    block_size, num_kv_heads, head_dim, num_blocks = 8, 2, 16, 40
    # heads outermost inside a block: rows of a block are not one contiguous run
    storage = torch.randn(num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = storage.permute(0, 2, 1, 3)
    v_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim).permute(0, 2, 1, 3)
    assert not k_cache.is_contiguous()
    _check_against_naive(
        [1, 7, 1],
        [30, 10, 90],
        k_cache=k_cache,
        v_cache=v_cache,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )


def test_write_kv_all_valid_and_with_skips_agree():
    _, k_cache, v_cache = paged_cache(6, 2, 4, 2, 8, torch.float32, "cpu", layer=1)
    other = k_cache.clone(), v_cache.clone()
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([3, 22, 9, 0, 17])
    write_kv_reference(k, v, k_cache, v_cache, slots)
    with_skip = torch.tensor([3, -1, 22, 9, -1, 0, 17])
    pad = torch.zeros(1, 2, 8)
    write_kv_reference(
        torch.cat([k[:1], pad, k[1:3], pad, k[3:]]),
        torch.cat([v[:1], pad, v[1:3], pad, v[3:]]),
        *other,
        with_skip,
    )
    # Writes are copies (no arithmetic): exact.
    assert torch.equal(k_cache, other[0]) and torch.equal(v_cache, other[1])
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(k_cache[s // 4, s % 4], k[i])
        assert torch.equal(v_cache[s // 4, s % 4], v[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_equals_the_reference_formula(dtype, zero_centered):
    norm = RMSNorm(48, 1e-6, zero_centered)
    if not zero_centered:
        norm = norm.to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(7, 48) * 3).to(dtype)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = (
        (h * (1.0 + norm.weight.float())).to(dtype) if zero_centered else norm.weight * h.to(dtype)
    )
    got = norm(x)
    assert got.dtype == expected.dtype
    # The same formula in the same dtypes: only how torch fuses or orders the ops may round
    # differently, ~1e-7 in float32; in bfloat16 both round the same float32 values.
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_gated_mlp_in_place_equals_the_plain_formula():
    torch.manual_seed(0)
    mlp = GatedMLP(32, 80)
    x = torch.randn(9, 32)
    before = x.clone()
    expected = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    with torch.inference_mode():
        got = mlp(x)
    # float32, the same ops done in place: rounding only (~1e-7), far below a wrong operand.
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert torch.equal(x, before)  # the input is untouched


def test_workspace_serves_calls_in_and_out_of_inference_mode():
    with torch.inference_mode():
        _check_against_naive([1, 1, 4], [50, 7, 20])
    _check_against_naive([1, 1, 4], [60, 9, 20])  # the buffers made above are not reused here
    with torch.inference_mode():
        _check_against_naive([1, 3], [70, 1])


def test_decode_groups_hold_about_group_bytes_of_k_and_v():
    lens = [250 + i for i in range(64)]
    per_position = 2 * 4 * 64 * 4  # K and V of 4 heads of 64, float32
    groups = reference._decode_groups(list(range(64)), lens, 16, per_position)
    assert sorted(b for g in groups for b in g) == list(range(64))
    longest = (max(lens) + 15) // 16 * 16
    assert all(len(g) * longest * per_position <= reference._GROUP_BYTES for g in groups)
    assert len(groups) > 64 // reference._MAX_GROUP_SEQS  # the byte cap, not the count, bound
    # Small heads: the count bound applies, as without a byte size.
    small = reference._decode_groups(list(range(64)), lens, 16, 2 * 2 * 32 * 4)
    assert small == reference._decode_groups(list(range(64)), lens, 16)
