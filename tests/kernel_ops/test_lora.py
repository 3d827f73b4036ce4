"""LoRA over a batch mixing adapters: the Triton kernel (interpreted without a GPU) and the
CPU's masked dense form against the slot-by-slot torch reference."""

import pytest
import torch

from pdpool.kernels import ops
from pdpool.kernels.lora_kernel import lora_triton
from pdpool.kernels.lora_reference import (
    lora_masked,
    lora_reference,
    lora_runs,
    slot_mask,
    slot_runs,
)


def _case(device, dtype, num_tokens, k, n, num_slots, rank, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=gen).to(device, dtype)
    a = torch.randn(num_slots * rank, k, generator=gen).to(device, dtype)
    b = torch.randn(n, num_slots * rank, generator=gen).to(device, dtype)
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen).to(device)
    y = torch.randn(num_tokens, n, generator=gen).to(device, dtype)
    return y, x, a, b, slots


@pytest.mark.parametrize(
    "num_tokens,k,n,num_slots,rank",
    [(1, 64, 64, 1, 8), (7, 64, 192, 3, 4), (13, 100, 70, 4, 16), (5, 256, 128, 8, 8)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_reference(device, dtype, num_tokens, k, n, num_slots, rank):
    y, x, a, b, slots = _case(device, dtype, num_tokens, k, n, num_slots, rank)
    want = lora_reference(y.clone().float(), x.float(), a.float(), b.float(), slots.cpu(), rank)
    got = lora_triton(y.clone(), x, a, b, slots, rank)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float().cpu(), want.cpu(), rtol=tol, atol=tol * 10)
    base = slots.cpu() < 0  # tokens of the base model are left as they were
    assert torch.equal(got.cpu()[base], y.cpu()[base])


@pytest.mark.parametrize("num_slots,rank", [(1, 8), (3, 4), (8, 16)])
def test_masked_dense_matches_reference(num_slots, rank):
    y, x, a, b, slots = _case("cpu", torch.float32, 11, 64, 96, num_slots, rank, seed=3)
    want = lora_reference(y.clone(), x, a, b, slots, rank)
    got = lora_masked(y.clone(), x, a, b, slot_mask(slots, num_slots, rank, x.dtype))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(want, y), "the case adds nothing: it could not fail"


def test_slot_runs_merge_neighbours_and_skip_base_requests():
    # requests: slot 2 x3 tokens, slot 2 x2, base x4, slot 0 x1, slot 2 x0, slot 0 x2
    runs = slot_runs([2, 2, -1, 0, 2, 0], [3, 2, 4, 1, 0, 2])
    assert runs == [(0, 5, 2), (9, 12, 0)]  # an empty request splits nothing
    assert slot_runs([-1, -1], [3, 4]) == []


@pytest.mark.parametrize("num_slots,rank", [(1, 8), (3, 4), (8, 16)])
def test_runs_match_reference(num_slots, rank):
    gen = torch.Generator().manual_seed(5)
    sizes = [int(n) for n in torch.randint(0, 40, (9,), generator=gen)]
    request_slots = [int(s) for s in torch.randint(-1, num_slots, (9,), generator=gen)]
    slots = torch.tensor(request_slots).repeat_interleave(torch.tensor(sizes))
    y, x, a, b, _ = _case("cpu", torch.float32, len(slots), 64, 96, num_slots, rank, seed=4)
    want = lora_reference(y.clone(), x, a, b, slots, rank)
    got = lora_runs(y.clone(), x, a, b, slot_runs(request_slots, sizes), rank)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(want, y), "the case adds nothing: it could not fail"


def test_ops_refuses_mismatched_shapes():
    y, x, a, b, slots = _case("cpu", torch.float32, 4, 32, 48, 2, 8)
    with pytest.raises(ValueError, match="b must be"):
        ops.lora_apply(y, x, a, b[:, :8], slots, 8)
    with pytest.raises(ValueError, match="token_slots has"):
        ops.lora_apply(y, x, a, b, slots[:3], 8)
    with pytest.raises(ValueError, match="a must be"):
        ops.lora_apply(y, x, a[:5], b, slots, 8)
