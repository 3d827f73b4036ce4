"""float32 linears on CPU run through oneDNN with packed weights: the same answers as
F.linear (any input shape, with a bias), only layers big enough are packed, the switch
turns it off, and a model whose projections are packed keeps greedy parity with
transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from tests.support.parity import compare, random_prompts, run_engine_recording_first_logits
from pdpool.engine.config import EngineConfig
from pdpool.engine.engine_core import LLMEngine
from pdpool.engine.models.cpu_linear import (
    CPU_LINEAR_ENV,
    MIN_PACKED_WEIGHT,
    PackedLinear,
    pack_cpu_linears,
    packing_works,
)
from pdpool.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not packing_works(), reason="no oneDNN in this torch build")


@pytest.fixture(scope="module")
def wide_qwen3(tmp_path_factory):
    from pdpool.engine.tiny_model import TinyModelSpec, write_tiny_model

    out = tmp_path_factory.mktemp("wide") / "wide-qwen3"
    spec = TinyModelSpec(arch="qwen3", seed=3, hidden_size=256, intermediate_size=512, head_dim=64)
    write_tiny_model(out, spec)
    return out


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 256), (37, 256), (2, 5, 256)])
def test_packed_linear_matches_f_linear(bias, shape):
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(256, 384, bias=bias)
    nn.init.normal_(linear.weight, std=0.05, generator=gen)
    if bias:
        nn.init.normal_(linear.bias, generator=gen)
    weight = linear.weight.detach().clone()
    x = torch.randn(*shape, generator=gen)
    expected = F.linear(x, weight, linear.bias)
    got = PackedLinear(linear)(x)
    assert got.shape == expected.shape
    # float32: the packed kernel sums the 256 products in another order than F.linear, so
    # the two differ by rounding only (~1e-6); a wrong row, column or bias is off by ~1e-1.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # A strided view (every other row) is read as such (the same rounding-only tolerance).
    if x.dim() == 2 and x.shape[0] > 1:
        strided = PackedLinear(linear)(x[::2])
        torch.testing.assert_close(strided, expected[::2], rtol=1e-5, atol=1e-5)


def _model():
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64), nn.Linear(64, 64))


def test_only_float32_cpu_layers_with_enough_weights_are_packed(monkeypatch):
    monkeypatch.delenv(CPU_LINEAR_ENV, raising=False)
    assert 256 * 256 >= MIN_PACKED_WEIGHT > 64 * 256
    model = _model()
    assert pack_cpu_linears(model, torch.device("cpu"), torch.float32) == 1
    assert [type(m).__name__ for m in model] == ["PackedLinear", "ReLU", "Linear", "Linear"]
    assert model[0].weight.dtype == torch.float32  # still answers for its dtype
    assert pack_cpu_linears(_model(), torch.device("cpu"), torch.bfloat16) == 0
    assert pack_cpu_linears(_model(), torch.device("cuda"), torch.float32) == 0


def test_the_switch_keeps_nn_linear(monkeypatch):
    monkeypatch.setenv(CPU_LINEAR_ENV, "torch")
    model = _model()
    assert pack_cpu_linears(model, torch.device("cpu"), torch.float32) == 0
    assert type(model[0]) is nn.Linear


def test_greedy_parity_with_transformers_through_packed_linears(wide_qwen3, monkeypatch):
    monkeypatch.delenv(CPU_LINEAR_ENV, raising=False)
    engine = LLMEngine(
        EngineConfig(model=str(wide_qwen3), device="cpu", max_num_batched_tokens=64),
        keep_logits=True,
    )
    packed = [n for n, m in engine.model.named_modules() if isinstance(m, PackedLinear)]
    # q, o, gate, up, down of both layers and the LM head; k and v (128 x 256) stay nn.Linear.
    assert len(packed) == 2 * 5 + 1, packed
    assert type(engine.model.model.layers[0].self_attn.k_proj) is nn.Linear
    prompts = random_prompts(8, 1, 120, vocab=512, seed=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens, first_logits = run_engine_recording_first_logits(engine, prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(str(wide_qwen3), dtype=torch.float32).eval()
    report = compare(hf, prompts, tokens, first_logits, 8)
    assert report.compared == len(prompts)
