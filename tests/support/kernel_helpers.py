"""Shared builders for the kernel tests."""

import pytest
import torch

gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# A kernel against its reference computes in another order (tiles, splits, fused steps): the
# outputs differ by rounding, a few units of the dtype's last place (float32 eps 1.2e-7,
# float16 9.8e-4, bfloat16 7.8e-3) over the sums involved; a real bug (a wrong block, mask or
# scale) is off by ~1e-1.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> None:
    """Max abs error within the dtype's tolerance, relative to the expected values' magnitude."""
    bound = TOLERANCE[dtype] * scale * max(1.0, expected.float().abs().max().item())
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= bound, f"max abs error {err:.3g} > {bound:.3g}"


def paged_cache(
    num_blocks: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype,
    device,
    layer: int = 1,
):
    """The engine's cache tensor and one layer's strided K/V views, filled with noise."""
    cache = torch.randn(
        num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
    )
    return cache, cache[:, layer, 0], cache[:, layer, 1]


def batch_tables(seq_lens, block_size: int, num_blocks: int, device, generator=None):
    """Block tables with distinct, shuffled blocks per sequence (unused entries point at
    block 0)."""
    need = [(s + block_size - 1) // block_size for s in seq_lens]
    width = max(1, max(need))
    assert sum(need) <= num_blocks, "test cache too small"
    order = torch.randperm(num_blocks, generator=generator)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = order[used : used + n]
        used += n
    return table.to(device)
