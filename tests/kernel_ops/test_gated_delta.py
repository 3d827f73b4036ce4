"""Gated DeltaNet: references against Hugging Face's Qwen3.5 code, Triton decode against them."""

import importlib.util

import pytest
import torch

from pdpool.kernels import gdn_reference as ref
from pdpool.kernels import ops
from pdpool.kernels.gated_delta import gated_delta_rule_decode_triton

from tests.support.kernel_helpers import assert_close, gpu, requires_cuda

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture(scope="module")
def hf():
    """transformers' Qwen3.5 module; its functions are the torch ones unless fla is installed."""
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("fla (the CUDA extra) is installed: HF's functions would dispatch to it")
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


def _inputs(batch, seq_len, num_k_heads, num_v_heads, dk, dv, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q = rnd(batch, seq_len, num_k_heads, dk).to(dtype).to(device)
    k = rnd(batch, seq_len, num_k_heads, dk).to(dtype).to(device)
    v = rnd(batch, seq_len, num_v_heads, dv).to(dtype).to(device)
    # Qwen3.5's gates: g = -exp(A_log) * softplus(a + dt_bias) (fp32), beta = sigmoid(b)
    g = (
        -torch.rand(num_v_heads, generator=gen).exp()
        * torch.nn.functional.softplus(rnd(batch, seq_len, num_v_heads))
    ).to(device)
    beta = torch.sigmoid(rnd(batch, seq_len, num_v_heads)).to(dtype).to(device)
    state = (rnd(batch, num_v_heads, dk, dv) * 0.1).to(device)
    return q, k, v, g, beta, state


def _heads_as_values(q, k, v):
    """q and k repeated to v's heads: HF's functions take them so in transformers <= 5.17
    (the layer repeats before calling) and accept them so in later ones."""
    ratio = v.shape[2] // k.shape[2]
    return q.repeat_interleave(ratio, dim=2), k.repeat_interleave(ratio, dim=2)


# ----------------------------------------------------------------------------- references vs HF


@pytest.mark.parametrize("num_k_heads,num_v_heads", [(2, 2), (2, 4)])
def test_recurrent_reference_matches_hf(hf, num_k_heads, num_v_heads):
    q, k, v, g, beta, state = _inputs(2, 9, num_k_heads, num_v_heads, 32, 16, F32)
    expected, expected_state = hf.torch_recurrent_gated_delta_rule(
        *_heads_as_values(q, k, v),
        v,
        g,
        beta,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    out, final = ref.gated_delta_rule_recurrent_reference(q, k, v, g, beta, state)
    # float32, the same recurrence written another way: rounding only, over 9 steps.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, expected_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seq_len,chunk", [(70, 64), (5, 64), (33, 16)])
def test_chunked_reference_matches_hf_and_recurrent(hf, seq_len, chunk):
    q, k, v, g, beta, state = _inputs(2, seq_len, 2, 4, 32, 24, F32, seed=1)
    hf_out, hf_state = hf.torch_chunk_gated_delta_rule(
        *_heads_as_values(q, k, v),
        v,
        g,
        beta,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    out, final = ref.gated_delta_rule_chunked_reference(q, k, v, g, beta, state, chunk_size=chunk)
    rec_out, rec_state = ref.gated_delta_rule_recurrent_reference(q, k, v, g, beta, state)
    # float32: chunked (matrix form within a chunk) against step-by-step sums in another
    # order, and the rounding grows over up to 70 steps: 1e-4, far below a wrong decay or mask.
    for a, b in ((out, hf_out), (final, hf_state), (out, rec_out), (final, rec_state)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_chunked_varlen_equals_separate_sequences():
    q, k, v, g, beta, state = _inputs(3, 20, 2, 2, 16, 16, F32, seed=2)
    lens = [20, 7, 13]
    pieces = [(x[b, :n]) for x in (q, k, v, g, beta) for b, n in enumerate(lens)]
    packed = [torch.cat(pieces[i * 3 : (i + 1) * 3])[None] for i in range(5)]
    cu = torch.tensor([0, 20, 27, 40], dtype=torch.int32)
    out, final = ref.gated_delta_rule_chunked_reference(*packed, state, cu_seqlens=cu, chunk_size=8)
    for b, n in enumerate(lens):
        one, one_state = ref.gated_delta_rule_recurrent_reference(
            q[b : b + 1, :n],
            k[b : b + 1, :n],
            v[b : b + 1, :n],
            g[b : b + 1, :n],
            beta[b : b + 1, :n],
            state[b : b + 1],
        )
        lo = sum(lens[:b])
        # float32, chunked varlen against recurrent: the same 1e-4 as above, for the same reason.
        torch.testing.assert_close(out[0, lo : lo + n], one[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final[b], one_state[0], rtol=1e-4, atol=1e-4)


def test_prefill_then_decode_equals_one_pass():
    """The engine's split: a prompt chunk through prefill, the next tokens through decode."""
    q, k, v, g, beta, state = _inputs(2, 12, 1, 2, 16, 8, F32, seed=3)
    full, full_state = ref.gated_delta_rule_recurrent_reference(q, k, v, g, beta, state)
    out, carry = ops.gated_delta_rule_prefill(
        q[:, :9], k[:, :9], v[:, :9], g[:, :9], beta[:, :9], state
    )
    # float32, prefill + decode steps against one recurrent pass: rounding only (as above).
    torch.testing.assert_close(out, full[:, :9], rtol=1e-4, atol=1e-4)
    for t in range(9, 12):
        o, carry = ops.gated_delta_rule_decode(
            q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], carry
        )
        torch.testing.assert_close(o, full[:, t], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(carry, full_state, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- Triton decode


@pytest.mark.parametrize(
    "num_k_heads,num_v_heads,dk,dv,dtype",
    [
        (2, 2, 64, 64, F32),
        (2, 4, 128, 128, F32),
        (1, 4, 64, 32, F16),
        (2, 4, 128, 128, BF16),
        (4, 8, 256, 64, F32),
        (1, 1, 48, 40, F32),
    ],
)
def test_decode_triton_matches_reference(device, num_k_heads, num_v_heads, dk, dv, dtype):
    q, k, v, g, beta, state = _inputs(3, 1, num_k_heads, num_v_heads, dk, dv, dtype, device)
    q, k, v, g, beta = q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]
    expected_state = state.clone()
    expected, _ = ref.gated_delta_rule_decode_reference(q, k, v, g, beta, expected_state)
    out, new_state = gated_delta_rule_decode_triton(q, k, v, g, beta, state)
    assert new_state.data_ptr() == state.data_ptr()  # in place
    assert out.dtype == dtype and out.shape == (3, num_v_heads, dv)
    assert_close(out, expected, dtype)
    assert_close(state, expected_state, F32)


@pytest.mark.parametrize("use_l2norm,scale", [(False, None), (True, 0.3)])
def test_decode_triton_options(device, use_l2norm, scale):
    q, k, v, g, beta, state = _inputs(2, 1, 2, 2, 32, 32, F32, device, seed=5)
    q, k, v, g, beta = q[:, 0], k[:, 0] * 0.2, v[:, 0], g[:, 0], beta[:, 0]
    expected_state = state.clone()
    expected, _ = ref.gated_delta_rule_decode_reference(
        q, k, v, g, beta, expected_state, use_l2norm, scale
    )
    out, _ = gated_delta_rule_decode_triton(q, k, v, g, beta, state, use_l2norm, scale)
    assert_close(out, expected, F32)
    assert_close(state, expected_state, F32)


def test_decode_triton_state_pool_with_padding(device):
    """state_indices address pool rows in place; -1 rows are skipped and give zeros."""
    q, k, v, g, beta, _ = _inputs(3, 1, 2, 4, 64, 32, BF16, device, seed=6)
    q, k, v, g, beta = q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]
    pool = torch.randn(6, 4, 64, 32, device=device)
    indices = torch.tensor([4, -1, 1], dtype=torch.int32, device=device)
    expected_pool = pool.clone()
    expected, _ = ref.gated_delta_rule_decode_reference(
        q, k, v, g, beta, expected_pool, state_indices=indices
    )
    before = pool.clone()
    out, _ = gated_delta_rule_decode_triton(q, k, v, g, beta, pool, state_indices=indices)
    assert_close(out, expected, BF16)
    assert torch.all(out[1] == 0)
    assert_close(pool, expected_pool, F32)
    untouched = [0, 2, 3, 5]
    assert torch.equal(pool[untouched], before[untouched])  # not written: exact


def test_decode_accepts_hf_layout(device, monkeypatch):
    monkeypatch.setattr(ops, "use_triton", lambda device: True)
    q, k, v, g, beta, state = _inputs(2, 1, 2, 2, 32, 16, F32, device, seed=7)
    expected, expected_state = ref.gated_delta_rule_recurrent_reference(q, k, v, g, beta, state)
    out, new_state = ops.gated_delta_rule_decode(q, k, v, g, beta, state.clone())
    assert out.shape == (2, 1, 2, 16)
    assert_close(out, expected, F32)
    assert_close(new_state, expected_state, F32)


def test_gdn_ops_reject_bad_inputs():
    q, k, v, g, beta, state = _inputs(2, 4, 2, 3, 16, 16, F32)
    with pytest.raises(ValueError, match="multiple of key heads"):
        ops.gated_delta_rule_prefill(q, k, v, g, beta)
    q, k, v, g, beta, state = _inputs(2, 4, 2, 4, 16, 16, F32)
    with pytest.raises(ValueError, match="initial_state must be"):
        ops.gated_delta_rule_prefill(q, k, v, g, beta, state[:1])
    with pytest.raises(ValueError, match="one token per request"):
        ops.gated_delta_rule_decode(q, k, v, g, beta, state)
    with pytest.raises(ValueError, match=r"g .* must be"):
        ops.gated_delta_rule_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0, :2], beta[:, 0], state)
    with pytest.raises(ValueError, match="state_indices has 1 entries"):
        ops.gated_delta_rule_decode(
            q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, state_indices=torch.tensor([0])
        )


# ----------------------------------------------------------------------------- GPU, full size


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_decode_full_size_gpu(dtype):
    """Qwen3.5-sized linear attention: 16 key heads, 32 value heads, 128x128 states, batch 64."""
    q, k, v, g, beta, _ = _inputs(64, 1, 16, 32, 128, 128, dtype, "cuda")
    q, k, v, g, beta = q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]
    pool = torch.randn(80, 32, 128, 128, device="cuda") * 0.1
    indices = torch.randperm(80, device="cuda")[:64]
    expected_pool = pool.clone()
    expected, _ = ref.gated_delta_rule_decode_reference(
        q, k, v, g, beta, expected_pool, state_indices=indices
    )
    out, _ = ops.gated_delta_rule_decode(q, k, v, g, beta, pool, state_indices=indices)
    assert_close(out, expected, dtype)
    assert_close(pool, expected_pool, F32, scale=10)


@gpu
@requires_cuda
def test_prefill_full_size_gpu():
    """The CUDA prefill path (fla-core when installed) against the recurrent reference."""
    q, k, v, g, beta, _state = _inputs(1, 3000, 16, 32, 128, 128, BF16, "cuda")
    cu = torch.tensor([0, 1000, 1100, 3000], dtype=torch.int32, device="cuda")
    init = torch.randn(3, 32, 128, 128, device="cuda") * 0.1
    out, final = ops.gated_delta_rule_prefill(q, k, v, g, beta, init, cu_seqlens=cu)
    bounds = cu.tolist()
    for n in range(3):
        lo, hi = bounds[n], bounds[n + 1]
        one, one_state = ref.gated_delta_rule_chunked_reference(
            q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], init[n : n + 1]
        )
        # fla runs its chunk matmuls in bf16: compare relative (Frobenius) errors
        for got, want in ((out[:, lo:hi], one), (final[n], one_state[0])):
            rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert rel < 2e-2, f"sequence {n}: relative error {rel:.3g}"
