"""A whole Qwen3.5 Gated DeltaNet layer built on our ops equals Hugging Face's layer.

This is how the engine composes the ops: prefill a prompt chunk (conv + chunked rule, states
out), then decode token by token from those states. The result must match transformers'
`Qwen3_5GatedDeltaNet` run over the whole sequence at once.
"""

import copy
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from pdpool.kernels import ops


@pytest.fixture(scope="module")
def hf_layer():
    if importlib.util.find_spec("fla") or importlib.util.find_spec("causal_conv1d"):
        pytest.skip("the CUDA extras are installed: HF would dispatch to fla / causal_conv1d")
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = Qwen3_5TextConfig(
        hidden_size=64,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
    )
    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(config, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    return layer


def _projections(layer, hidden):
    batch, seq_len, _ = hidden.shape
    mixed = layer.in_proj_qkv(hidden)
    z = layer.in_proj_z(hidden).reshape(batch, seq_len, layer.num_v_heads, layer.head_v_dim)
    beta = layer.in_proj_b(hidden).sigmoid()
    g = -layer.A_log.float().exp() * F.softplus(layer.in_proj_a(hidden).float() + layer.dt_bias)
    return mixed, z, beta, g


def _split(layer, mixed):
    batch, seq_len, _ = mixed.shape
    q, k, v = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    return (
        q.reshape(batch, seq_len, -1, layer.head_k_dim),
        k.reshape(batch, seq_len, -1, layer.head_k_dim),
        v.reshape(batch, seq_len, -1, layer.head_v_dim),
    )


def _output(layer, o, z):
    batch, seq_len = o.shape[:2]
    o = layer.norm(o.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(o.reshape(batch, seq_len, -1))


def our_prefill(layer, hidden):
    mixed, z, beta, g = _projections(layer, hidden)
    weight = layer.conv1d.weight.squeeze(1)
    conv_out, conv_state = ops.causal_conv1d_prefill(
        mixed.transpose(1, 2), weight, layer.conv1d.bias, None, "silu"
    )
    q, k, v = _split(layer, conv_out.transpose(1, 2))
    o, state = ops.gated_delta_rule_prefill(q, k, v, g, beta, None)
    return _output(layer, o, z), conv_state, state


def our_decode(layer, hidden, conv_state, state, pool_rows):
    """One token per request; states live in pools addressed by `pool_rows`."""
    mixed, z, beta, g = _projections(layer, hidden)
    conv_out = ops.causal_conv1d_update(
        mixed[:, 0],
        conv_state,
        layer.conv1d.weight.squeeze(1),
        layer.conv1d.bias,
        "silu",
        state_indices=pool_rows,
    )
    q, k, v = _split(layer, conv_out[:, None])
    o, _ = ops.gated_delta_rule_decode(q, k, v, g, beta, state, state_indices=pool_rows)
    return _output(layer, o, z)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_prefill_then_decode_matches_hf_layer(hf_layer, kernels, monkeypatch):
    # the Triton variant runs compiled on a GPU, through the interpreter on a CPU
    device = "cuda" if kernels == "triton" and torch.cuda.is_available() else "cpu"
    if kernels == "triton":
        monkeypatch.setattr(ops, "use_triton", lambda device: True)
    layer = copy.deepcopy(hf_layer).to(device)
    torch.manual_seed(1)
    hidden = torch.randn(2, 12, 64).to(device)
    with torch.no_grad():
        expected = layer(hidden)
        prompt, conv_state, state = our_prefill(layer, hidden[:, :9])
        # float32, our ops against HF's layer (chunked vs recurrent sums, another order):
        # rounding only, growing over 12 steps; far below a wrong gate, norm or projection.
        torch.testing.assert_close(prompt, expected[:, :9], rtol=1e-4, atol=1e-4)
        # the engine keeps states in pools: rows 3 and 0 of 5, decoding in that order
        rows = torch.tensor([3, 0], device=device)
        conv_pool = torch.zeros(5, *conv_state.shape[1:], device=device)
        state_pool = torch.zeros(5, *state.shape[1:], device=device)
        conv_pool[rows], state_pool[rows] = conv_state, state
        for t in range(9, 12):
            out = our_decode(layer, hidden[:, t : t + 1], conv_pool, state_pool, rows)
            torch.testing.assert_close(out, expected[:, t : t + 1], rtol=1e-4, atol=1e-4)
