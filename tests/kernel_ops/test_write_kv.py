"""write_kv (Triton) against write_kv_reference, into strided views of the engine's cache."""

import pytest
import torch

from pdpool.kernels import ops
from pdpool.kernels.kv_write import write_kv_triton
from pdpool.kernels.reference import write_kv_reference

from tests.support.kernel_helpers import gpu, paged_cache, requires_cuda


def _write_both(device, dtype, block_size, num_kv_heads, head_dim, num_tokens, cache_dtype=None):
    gen = torch.Generator().manual_seed(block_size * 7 + head_dim + num_kv_heads)
    cache_dtype = cache_dtype or dtype
    num_blocks = 8
    cache, k_cache, v_cache = paged_cache(
        num_blocks, 2, block_size, num_kv_heads, head_dim, cache_dtype, device
    )
    expected = cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1  # padding / uncached tokens are skipped
    slots = slots.to(device)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    write_kv_reference(k, v, expected[:, 1, 0], expected[:, 1, 1], slots)
    write_kv_triton(k, v, k_cache, v_cache, slots)
    return cache, expected, k, slots


@pytest.mark.parametrize(
    "block_size,num_kv_heads,head_dim",
    [
        (16, 1, 64),
        (16, 2, 128),
        (32, 4, 256),
        (32, 8, 128),
        (16, 3, 96),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_matches_reference(device, dtype, block_size, num_kv_heads, head_dim):
    cache, expected, k, slots = _write_both(device, dtype, block_size, num_kv_heads, head_dim, 13)
    # bit-exact, and nothing outside the written slots (other layer, the V half) changed
    assert torch.equal(cache, expected)
    live = slots >= 0
    blocks, offsets = slots[live] // block_size, slots[live] % block_size
    assert torch.equal(cache[blocks, 1, 0, offsets], k[live])


def test_write_kv_casts_to_cache_dtype(device):
    cache, expected, _, _ = _write_both(
        device, torch.float32, 16, 2, 64, 9, cache_dtype=torch.float16
    )
    assert torch.equal(cache, expected)  # a cast rounds one way in both: exact


def test_write_kv_accepts_non_contiguous_inputs(device):
    _, k_cache, v_cache = paged_cache(4, 1, 16, 2, 64, torch.float32, device, layer=0)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    kv = torch.randn(5, 2, 2, 64, device=device)  # a fused qkv-like buffer: k, v are views
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.tensor([3, 17, -1, 40, 63], device=device)
    write_kv_reference(k, v, expected_k, expected_v, slots)
    write_kv_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)  # copies


def test_write_kv_rejects_bad_shapes():
    _, k_cache, v_cache = paged_cache(4, 1, 16, 2, 64, torch.float32, "cpu", layer=0)
    k = torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping has 2 slots for 3 tokens"):
        ops.write_kv(k, k, k_cache, v_cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="k/v must be"):
        ops.write_kv(
            torch.randn(3, 4, 64), torch.randn(3, 4, 64), k_cache, v_cache, torch.tensor([0, 1, 2])
        )
    with pytest.raises(ValueError, match="int32 or int64"):
        ops.write_kv(k, k, k_cache, v_cache, torch.tensor([0.0, 1.0, 2.0]))


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_write_kv_full_size_gpu(dtype):
    device = torch.device("cuda")
    cache, k_cache, v_cache = paged_cache(2048, 4, 16, 8, 128, dtype, device)
    expected = cache.clone()
    slots = torch.randperm(2048 * 16, device=device)[:8192]
    slots[::5] = -1
    k = torch.randn(8192, 8, 128, dtype=dtype, device=device)
    v = torch.randn_like(k)
    write_kv_reference(k, v, expected[:, 1, 0], expected[:, 1, 1], slots)
    ops.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(cache, expected)  # writes are copies: bit-exact
