"""Greedy tokens and logits of the engine against transformers on the same checkpoint."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.parity import compare, random_prompts, run_engine_recording_first_logits
from pdpool.engine.config import EngineConfig
from pdpool.engine.engine_core import LLMEngine
from pdpool.engine.sampling_params import SamplingParams

MAX_NEW = 10


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3):
    return AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(16, 1, 300, vocab=512)


@pytest.mark.parametrize(
    "name,knobs",
    [
        # Every prompt over 48 tokens is split into chunks, mixed with other requests' decodes.
        ("chunked", dict(max_num_batched_tokens=48, num_kv_blocks=512)),
        # 40 blocks of 16 cannot hold 16 prompts of up to 300 tokens: requests are preempted.
        ("preempted", dict(max_num_batched_tokens=256, num_kv_blocks=40)),
    ],
)
def test_greedy_parity_with_transformers(tiny_qwen3, hf_model, prompts, name, knobs):
    engine = LLMEngine(EngineConfig(model=str(tiny_qwen3), device="cpu", **knobs), keep_logits=True)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    tokens, first_logits = run_engine_recording_first_logits(engine, prompts, params)
    if name == "preempted":
        assert engine.scheduler.num_preemptions > 0
    assert engine.stats["steps"] > len(prompts)  # continuous batching, not one at a time
    report = compare(hf_model, prompts, tokens, first_logits, MAX_NEW)
    assert report.compared == len(prompts)
    # Divergences are only allowed at near ties, and the test says so.
    for i, step, gap in report.allowed_divergences:
        print(f"allowed divergence: prompt {i} at step {step}, top-2 gap {gap:.2e}")
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_prefix_caching_keeps_parity_and_skips_work(tiny_qwen3, hf_model):
    import random

    rng = random.Random(5)
    system = [rng.randrange(3, 500) for _ in range(100)]
    prompts = [
        system + [rng.randrange(3, 500) for _ in range(rng.randint(1, 60))] for _ in range(8)
    ]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    results = {}
    for caching in (True, False):
        engine = LLMEngine(
            EngineConfig(
                model=str(tiny_qwen3),
                device="cpu",
                num_kv_blocks=256,
                max_num_batched_tokens=128,
                enable_prefix_caching=caching,
            ),
            keep_logits=True,
        )
        engine.generate(prompts[:1], params)  # warm the shared system prompt
        computed_before = engine.stats["computed_tokens"]
        tokens, first_logits = run_engine_recording_first_logits(engine, prompts, params)
        results[caching] = (tokens, first_logits, engine.stats["computed_tokens"] - computed_before)
    assert results[True][0] == results[False][0]
    # 96 of the 100 system tokens come from the cache for each of the 8 prompts.
    assert results[False][2] - results[True][2] >= 8 * 96 - 16
    report = compare(hf_model, prompts, results[True][0], results[True][1], MAX_NEW)
    assert report.compared == len(prompts)
