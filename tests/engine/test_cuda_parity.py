"""The engine on a CUDA device against transformers on the same checkpoint.

On a GPU the engine's attention, KV writes, convolution and Gated DeltaNet decode are the
Triton kernels (kernels/), which the CPU tests run only under the interpreter. The reference
is transformers in float32 on the CPU, except Qwen3.5's: with fla-core installed (the `cuda`
extra) transformers' Gated DeltaNet dispatches to fla's Triton kernels, which need the GPU.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.kernel_helpers import requires_cuda
from tests.support.parity import compare, random_prompts, run_engine_recording_first_logits
from pdpool.engine.config import EngineConfig
from pdpool.engine.engine_core import LLMEngine
from pdpool.engine.sampling_params import SamplingParams

pytestmark = [requires_cuda, pytest.mark.gpu]

MAX_NEW = 8
# Triton's tl.dot takes float32 inputs as TF32 (10-bit mantissa): the logits move by ~1e-3,
# where a wrong block, mask or state would move them by ~1e-1.
GPU_LOGIT_ATOL = 2e-2

SCENARIOS = [
    # prompts split into chunks that share steps with other requests' decodes
    ("chunked", dict(max_num_batched_tokens=40, num_kv_blocks=256)),
    # too few blocks for every prompt at once: requests are preempted and recompute
    ("preempted", dict(max_num_batched_tokens=256, num_kv_blocks=24)),
]


def _engine_on_cuda(model_path, prompts, knobs):
    config = EngineConfig(model=str(model_path), device="cuda", **knobs)
    engine = LLMEngine(config, keep_logits=True)
    assert engine.kv_cache.device.type == "cuda"
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    tokens, first_logits = run_engine_recording_first_logits(engine, prompts, params)
    return engine, tokens, first_logits


def _check(model_path, prompts, name, knobs, reference_device="cpu"):
    hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    hf = hf.to(reference_device).eval()
    engine, tokens, first_logits = _engine_on_cuda(model_path, prompts, knobs)
    if name == "preempted":
        assert engine.scheduler.num_preemptions > 0
    else:
        assert engine.stats["steps"] > len(prompts)
    report = compare(hf, prompts, tokens, first_logits, MAX_NEW, atol=GPU_LOGIT_ATOL)
    assert report.compared == len(prompts)
    for i, step, gap in report.allowed_divergences:
        print(f"allowed divergence: prompt {i} at step {step}, top-2 gap {gap:.2e}")
    assert len(report.allowed_divergences) <= 2
    # every block back but the null block (standing for blocks out of a sliding window)
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_usable_blocks
    print(f"{name}: max first-step logit difference {report.max_logit_diff:.2e}")


@pytest.mark.parametrize("name,knobs", SCENARIOS)
def test_qwen3_on_cuda_matches_transformers(tiny_qwen3, name, knobs):
    _check(tiny_qwen3, random_prompts(12, 1, 200, vocab=512, seed=5), name, knobs)


@pytest.mark.parametrize("name,knobs", SCENARIOS)
def test_sliding_window_on_cuda_matches_transformers(tiny_qwen3_sliding, name, knobs):
    _check(tiny_qwen3_sliding, random_prompts(8, 1, 150, vocab=512, seed=6), name, knobs)


@pytest.mark.parametrize(
    "name,knobs",
    [
        ("chunked", dict(max_num_batched_tokens=40, num_kv_blocks=256)),
        # one paged layer of four: 20 blocks of 16 cannot hold 10 prompts of up to 200 tokens
        ("preempted", dict(max_num_batched_tokens=256, num_kv_blocks=20)),
    ],
)
def test_qwen3_5_on_cuda_matches_transformers(tiny_qwen3_5, name, knobs):
    prompts = random_prompts(10, 1, 200, vocab=512, seed=3)
    _check(tiny_qwen3_5, prompts, name, knobs, reference_device="cuda")


def test_bfloat16_on_cuda_agrees_with_float32(tiny_qwen3):
    """The dtype users serve in: bf16 greedy tokens follow fp32's except near ties."""
    prompts = random_prompts(8, 16, 120, vocab=512, seed=8)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        config = EngineConfig(model=str(tiny_qwen3), device="cuda", dtype=dtype)
        runs[dtype] = LLMEngine(config).generate(prompts, params)
    same_first = sum(a[0] == b[0] for a, b in zip(runs["float32"], runs["bfloat16"], strict=True))
    assert same_first >= len(prompts) // 2, runs
