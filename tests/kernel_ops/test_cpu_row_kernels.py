"""The CPU C kernels for RMSNorm, neox rotary and the K/V scatter against the torch paths they
replace (the same layer modules with the kernel switched off)."""

import pytest
import torch

from pdpool.engine.models.layers import RMSNorm, RotaryEmbedding
from pdpool.kernels import cpu_kv_write, cpu_norm_rope, ops
from pdpool.kernels.reference import write_kv_reference

from tests.support.kernel_helpers import paged_cache


def test_the_kernels_build_here():
    # CI has a C compiler; without one the engine runs the torch paths, but the suite fails.
    assert cpu_norm_rope.usable(torch.zeros(1))
    assert cpu_kv_write.usable(*(torch.zeros(1, 1, 4),) * 2, *(torch.zeros(1, 1, 1, 4),) * 2)


def _torch_path(monkeypatch, name):
    monkeypatch.setenv(name, "0")


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 96), (3000, 512)])
def test_rms_norm_matches_torch(monkeypatch, zero_centered, rows, dim):
    gen = torch.Generator().manual_seed(rows + dim)
    norm = RMSNorm(dim, 1e-6, zero_centered=zero_centered)
    norm.weight.data.normal_(generator=gen)
    x = torch.randn(rows, dim, generator=gen) * 3
    fast = norm(x)
    _torch_path(monkeypatch, cpu_norm_rope.DISABLE_ENV)
    slow = norm(x)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    assert fast.shape == x.shape


def test_rms_norm_of_a_strided_view_leaves_it_alone(monkeypatch):
    norm = RMSNorm(32, 1e-6)
    base = torch.randn(10, 64)
    view = base[:, ::2]  # last dim not contiguous
    before = base.clone()
    fast = norm(view)
    assert torch.equal(base, before)
    _torch_path(monkeypatch, cpu_norm_rope.DISABLE_ENV)
    torch.testing.assert_close(fast, norm(view), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rotary_dim", [64, 32, 16])
@pytest.mark.parametrize("tokens", [1, 5, 2000])
def test_norm_and_rotate_matches_torch(monkeypatch, rotary_dim, tokens):
    gen = torch.Generator().manual_seed(rotary_dim * 1000 + tokens)
    rotary = RotaryEmbedding(64, rotary_dim, 1e6, 4096)
    q_norm, k_norm = RMSNorm(64, 1e-6), RMSNorm(64, 1e-6, zero_centered=True)
    q_norm.weight.data.normal_(generator=gen)
    k_norm.weight.data.normal_(generator=gen)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    # q as Qwen3.5 has it: every other head_dim slice of a wider projection (a view)
    q_proj = torch.randn(tokens, 8, 128, generator=gen)
    k = torch.randn(tokens, 4, 64, generator=gen)
    q_fast, k_fast = rotary.norm_and_rotate(
        positions, q_proj.clone()[..., :64], k.clone(), q_norm, k_norm
    )
    _torch_path(monkeypatch, cpu_norm_rope.DISABLE_ENV)
    q_ref, k_ref = rotary.norm_and_rotate(positions, q_proj[..., :64], k, q_norm, k_norm)
    torch.testing.assert_close(q_fast, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_fast, k_ref, rtol=1e-5, atol=1e-5)


def test_norm_rope_writes_only_the_query_half():
    rotary = RotaryEmbedding(16, 16, 1e4, 64)
    proj = torch.randn(3, 2, 32)
    gate = proj[..., 16:].clone()
    rotary.norm_and_rotate(
        torch.tensor([0, 5, 9]),
        proj[..., :16],
        torch.randn(3, 1, 16),
        RMSNorm(16, 1e-6),
        RMSNorm(16, 1e-6),
    )
    assert torch.equal(proj[..., 16:], gate)


@pytest.mark.parametrize(
    "bad",
    [
        dict(positions=torch.tensor([0, 64])),  # past the table
        dict(positions=torch.tensor([-1, 0])),
        dict(positions=torch.tensor([0])),  # one position for two tokens
        dict(rotary_dim=15),
        dict(weight=torch.ones(8)),
    ],
)
def test_norm_rope_refuses_bad_inputs(bad):
    rotary = RotaryEmbedding(16, 16, 1e4, 64)
    args = dict(
        x=torch.randn(2, 2, 16),
        weight=torch.ones(16),
        eps=1e-6,
        positions=torch.tensor([0, 1]),
        cos=rotary.cos,
        sin=rotary.sin,
        rotary_dim=16,
    )
    args.update(bad)
    with pytest.raises(ValueError):
        cpu_norm_rope.norm_rope_(**args)


@pytest.mark.parametrize("tokens,kv_heads,head_dim", [(1, 1, 64), (13, 3, 96), (2048, 4, 64)])
def test_cpu_write_kv_matches_reference(tokens, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(tokens + kv_heads)
    blocks, block_size = max(2, tokens // 8), 16
    cache, k_cache, v_cache = paged_cache(
        blocks, 2, block_size, kv_heads, head_dim, torch.float32, "cpu"
    )
    expected = cache.clone()
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    slots[::3] = -1
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    assert cpu_kv_write.usable(k, v, k_cache, v_cache)
    ops.write_kv(k, v, k_cache, v_cache, slots)
    write_kv_reference(k, v, expected[:, 1, 0], expected[:, 1, 1], slots)
    assert torch.equal(cache, expected)  # and nothing outside the written slots changed


def test_cpu_write_kv_refuses_a_slot_past_the_cache_before_writing():
    cache, k_cache, v_cache = paged_cache(2, 1, 16, 1, 64, torch.float32, "cpu", layer=0)
    before = cache.clone()
    k = torch.randn(2, 1, 64)
    with pytest.raises(IndexError):
        ops.write_kv(k, k, k_cache, v_cache, torch.tensor([0, 32]))
    assert torch.equal(cache, before)
