"""Qwen3 with sliding-window layers: parity with transformers, blocks released outside the
window, and prefix hits that only need the last window."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.parity import compare, random_prompts, run_engine_recording_first_logits
from pdpool.engine.config import EngineConfig
from pdpool.engine.engine_core import LLMEngine
from pdpool.engine.sampling_params import SamplingParams

MAX_NEW = 8


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3_sliding):
    return AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_sliding), dtype=torch.float32).eval()


def engine(model, **knobs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), device="cpu", **knobs), keep_logits=True)


@pytest.mark.parametrize(
    "knobs",
    [
        dict(max_num_batched_tokens=40, num_kv_blocks=512),  # chunked prefill
        dict(max_num_batched_tokens=256, num_kv_blocks=48),  # preemption
    ],
)
def test_sliding_window_parity(tiny_qwen3_sliding, hf_model, knobs):
    prompts = random_prompts(10, 1, 200, vocab=512, seed=3)  # most longer than the window
    eng = engine(tiny_qwen3_sliding, **knobs)
    assert [g.name for g in eng.groups] == ["full", "sliding32"]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    tokens, first = run_engine_recording_first_logits(eng, prompts, params)
    report = compare(hf_model, prompts, tokens, first, MAX_NEW)
    assert report.compared == len(prompts)
    assert eng.kv.pool.num_used_blocks == 0


def test_blocks_outside_the_window_are_released(tiny_qwen3_sliding):
    eng = engine(
        tiny_qwen3_sliding,
        max_num_batched_tokens=64,
        num_kv_blocks=512,
        enable_prefix_caching=False,
    )
    eng.add_request("r", list(range(3, 203)), SamplingParams(max_tokens=40, ignore_eos=True))
    peak_sliding = 0
    while eng.has_unfinished():
        eng.step()
        tables = eng.kv.req_blocks.get("r")
        if tables:
            live = [b for b in tables[1] if b is not eng.kv.pool.null_block]
            peak_sliding = max(peak_sliding, len(live))
            # The sliding group never holds more than the window (32) plus one chunk.
            assert len(live) <= (32 + 64) // 16 + 2
            assert len(tables[0]) > len(live) or len(tables[0]) <= 4
    assert eng.kv.pool.num_used_blocks == 0


def test_prefix_hit_needs_only_the_last_window(tiny_qwen3_sliding, hf_model):
    eng = engine(tiny_qwen3_sliding, max_num_batched_tokens=512, num_kv_blocks=512)
    prompt = random_prompts(1, 150, 150, vocab=512, seed=9)[0]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    eng.generate([prompt], params)
    longer = prompt + random_prompts(1, 30, 30, vocab=512, seed=10)[0]
    before = eng.stats["computed_tokens"]
    tokens, first = run_engine_recording_first_logits(eng, [longer], params)
    # 144 of the 150 tokens (9 full blocks) come from the cache.
    assert eng.stats["computed_tokens"] - before == len(longer) - 144 + MAX_NEW - 1
    assert eng.kv.last_hit_lengths == {"full": 144, "sliding32": 144}
    compare(hf_model, [longer], tokens, first, MAX_NEW)
