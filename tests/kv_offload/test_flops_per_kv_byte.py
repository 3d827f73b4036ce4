"""benchmarks/kv_offload.py's FLOPs per KV byte: what a recompute costs per byte a tier
reads instead, checked against sums worked by hand for known shapes."""

from __future__ import annotations

import importlib.util

import pytest

from tests.support.prerequisites import REPO

LARGE = dict(  # engine_vs_vllm.py's large random Qwen3
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=1024,
)
LLAMA_3_8B = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
)  # no head_dim: hidden / heads = 128


@pytest.fixture(scope="module")
def ratio():
    spec = importlib.util.spec_from_file_location(
        "kv_offload_bench", REPO / "benchmarks" / "kv_offload.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.flops_per_kv_byte


def test_large_shape_by_hand(ratio):
    got = ratio(LARGE, 3000, 4)
    # K and V, 4 layers, 4 KV heads of 64, float32.
    assert got["kv_bytes_per_token"] == 2 * 4 * 4 * 64 * 4 == 8192
    # Per layer q 512x512, k and v 512x256, o 512x512, MLP 3x512x1024; 2 FLOPs a weight.
    weights = 2 * 4 * (512 * 512 * 2 + 512 * 256 * 2 + 3 * 512 * 1024)
    assert got["weights"] == weights / 8192 == 2304
    attention = 4 * 4 * 512 * 3001 / 2
    assert got["with_attention"] == pytest.approx((weights + attention) / 8192)


def test_real_model_is_far_above_the_random_ones(ratio):
    llama = ratio(LLAMA_3_8B, 3000, 2)
    assert llama["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    assert llama["weights"] == 106496
    assert llama["weights"] > 40 * ratio(LARGE, 3000, 4)["weights"]


def test_attention_grows_with_the_prefix_and_weights_do_not(ratio):
    short, long = ratio(LARGE, 100, 4), ratio(LARGE, 3000, 4)
    assert short["weights"] == long["weights"]
    assert short["with_attention"] < long["with_attention"]


def test_a_config_without_the_fields_is_refused(ratio):
    with pytest.raises(KeyError):
        ratio({"hidden_size": 8}, 3000, 4)
