"""Causal conv1d: references against Hugging Face's Qwen3.5 code, Triton update against them."""

import importlib.util

import pytest
import torch

from pdpool.kernels import gdn_reference as ref
from pdpool.kernels import ops
from pdpool.kernels.gated_delta import causal_conv1d_update_triton

from tests.support.kernel_helpers import assert_close, gpu, requires_cuda

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# float32 outputs computed by another expression (HF's conv, chunks, a varlen batch): a 4-tap
# conv and a silu round differently in another order, by ~1e-7; torch's float32 defaults,
# written out. States are copies of inputs (a shift), compared exactly.
RTOL, ATOL = 1.3e-6, 1e-5


@pytest.fixture(scope="module")
def hf():
    if importlib.util.find_spec("causal_conv1d") is not None:
        pytest.skip("causal_conv1d (a CUDA extra) is installed: HF would dispatch to it")
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


def _conv(batch, channels, width, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(channels, width, generator=gen) * 0.5).to(dtype).to(device)
    bias = torch.randn(channels, generator=gen).to(dtype).to(device)
    return weight, bias, gen


@pytest.mark.parametrize("seq_len", [1, 3])
@pytest.mark.parametrize("activation", ["silu", None])
def test_update_reference_matches_hf(hf, seq_len, activation):
    weight, bias, gen = _conv(2, 24, 4, F32)
    x = torch.randn(2, 24, seq_len, generator=gen)
    state = torch.randn(2, 24, 4, generator=gen)  # HF keeps `kernel` inputs
    hf_state = state.clone()
    expected = hf.causal_conv1d_update(x, hf_state, weight, bias, activation)
    out = ref.causal_conv1d_update_reference(x, state, weight, bias, activation)
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
    assert torch.equal(state, hf_state)  # both shift the inputs in: a copy, exact


def test_prefill_reference_matches_hf(hf):
    weight, bias, gen = _conv(2, 16, 4, F32)
    x = torch.randn(2, 16, 11, generator=gen)
    expected = hf.causal_conv1d_fn(x, weight, bias, activation="silu")
    out, final = ref.causal_conv1d_prefill_reference(x, weight, bias, None, "silu")
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
    assert torch.equal(final, x[..., -3:])  # the last inputs, copied: exact


@pytest.mark.parametrize("state_len", [3, 4])
def test_prefill_then_updates_equal_one_pass(state_len):
    """Chunked prefill + token-by-token updates == the conv over the whole sequence."""
    weight, bias, gen = _conv(2, 10, 4, F32)
    x = torch.randn(2, 10, 14, generator=gen)
    full, _ = ref.causal_conv1d_prefill_reference(x, weight, bias, None, "silu")
    first, state = ops.causal_conv1d_prefill(
        x[..., :5], weight, bias, None, "silu", state_len=state_len
    )
    second, state = ops.causal_conv1d_prefill(x[..., 5:9], weight, bias, state, "silu")
    pieces = [first, second]
    for t in range(9, 14):
        pieces.append(ops.causal_conv1d_update(x[..., t], state, weight, bias, "silu")[..., None])
    torch.testing.assert_close(torch.cat(pieces, dim=-1), full, rtol=RTOL, atol=ATOL)


def test_prefill_varlen_equals_separate():
    weight, bias, gen = _conv(1, 8, 4, F32)
    lens = [6, 2, 9]
    xs = [torch.randn(1, 8, n, generator=gen) for n in lens]
    init = torch.randn(3, 8, 3, generator=gen)
    cu = torch.tensor([0, 6, 8, 17])
    out, final = ref.causal_conv1d_prefill_reference(
        torch.cat(xs, -1), weight, bias, init, "silu", cu_seqlens=cu
    )
    for n, x in enumerate(xs):
        one, one_state = ref.causal_conv1d_prefill_reference(
            x, weight, bias, init[n : n + 1], "silu"
        )
        torch.testing.assert_close(out[..., cu[n] : cu[n + 1]], one, rtol=RTOL, atol=ATOL)
        assert torch.equal(final[n], one_state[0])  # the last inputs, copied: exact


@pytest.mark.parametrize(
    "batch,channels,width,state_len,seq_len,dtype",
    [
        (3, 200, 4, 3, 1, F32),
        (2, 130, 4, 4, 1, F16),
        (4, 64, 4, 3, 2, BF16),
        (1, 300, 2, 1, 1, F32),
        (2, 96, 4, 6, 3, F32),
    ],
)
def test_update_triton_matches_reference(device, batch, channels, width, state_len, seq_len, dtype):
    weight, bias, gen = _conv(batch, channels, width, dtype, device)
    x = torch.randn(batch, channels, seq_len, generator=gen).to(dtype).to(device)
    state = torch.randn(batch, channels, state_len, generator=gen).to(dtype).to(device)
    expected_state = state.clone()
    expected = ref.causal_conv1d_update_reference(x, expected_state, weight, bias, "silu")
    out = causal_conv1d_update_triton(x, state, weight, bias, "silu")
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, expected, dtype)
    assert torch.equal(state, expected_state)  # the shift is a copy: exact


def test_update_triton_pool_padding_no_bias_no_activation(device):
    weight, _, gen = _conv(3, 40, 4, F32, device)
    x = torch.randn(3, 40, generator=gen).to(device)  # [B, C]: one token each
    pool = torch.randn(5, 40, 3, generator=gen).to(device)
    indices = torch.tensor([2, -1, 0], device=device)
    expected_pool = pool.clone()
    expected = ref.causal_conv1d_update_reference(x, expected_pool, weight, None, None, indices)
    out = causal_conv1d_update_triton(x, pool, weight, None, None, indices)
    assert out.shape == (3, 40)
    assert_close(out, expected, F32)
    assert torch.all(out[1] == 0)
    assert torch.equal(pool, expected_pool)  # shifted rows are copies: exact


def test_update_triton_through_ops(device, monkeypatch):
    monkeypatch.setattr(ops, "use_triton", lambda device: True)
    weight, bias, gen = _conv(2, 33, 4, F32, device)
    x = torch.randn(2, 33, 1, generator=gen).to(device)
    state = torch.randn(2, 33, 3, generator=gen).to(device)
    expected_state = state.clone()
    expected = ref.causal_conv1d_update_reference(x, expected_state, weight, bias, "silu")
    out = ops.causal_conv1d_update(x, state, weight, bias, "silu")
    assert_close(out, expected, F32)
    assert torch.equal(state, expected_state)  # the shift is a copy: exact


def test_conv_ops_reject_bad_inputs():
    weight, bias, _gen = _conv(2, 8, 4, F32)
    x = torch.randn(2, 8, 1)
    with pytest.raises(ValueError, match="needs >= 3"):
        ops.causal_conv1d_update(x, torch.zeros(2, 8, 2), weight, bias)
    with pytest.raises(ValueError, match="squeeze"):
        ops.causal_conv1d_update(x, torch.zeros(2, 8, 3), weight[:, None], bias)
    with pytest.raises(ValueError, match="unsupported activation"):
        ops.causal_conv1d_update(x, torch.zeros(2, 8, 3), weight, bias, "gelu")
    with pytest.raises(ValueError, match="initial_state must be"):
        ops.causal_conv1d_prefill(torch.randn(2, 8, 5), weight, bias, torch.zeros(1, 8, 3))


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_update_full_size_gpu(dtype):
    """Qwen3.5-sized conv channels (2*16*128 + 32*128), batch 128 out of a 200-row pool."""
    channels = 2 * 16 * 128 + 32 * 128
    weight, bias, _gen = _conv(128, channels, 4, dtype, "cuda")
    x = torch.randn(128, channels, device="cuda", dtype=dtype)
    pool = torch.randn(200, channels, 3, device="cuda", dtype=dtype)
    indices = torch.randperm(200, device="cuda")[:128]
    expected_pool = pool.clone()
    expected = ref.causal_conv1d_update_reference(x, expected_pool, weight, bias, "silu", indices)
    out = ops.causal_conv1d_update(x, pool, weight, bias, "silu", indices)
    assert_close(out, expected, dtype)
    assert torch.equal(pool, expected_pool)  # the shift is a copy: exact
