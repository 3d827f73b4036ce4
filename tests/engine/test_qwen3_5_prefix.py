"""Prefix hits on the hybrid Qwen3.5 model resume from state snapshots: fewer tokens are
computed and the greedy tokens stay identical (to the engine without caching, and to
transformers)."""

from __future__ import annotations

import random

import torch
from transformers import AutoModelForCausalLM

from tests.support.parity import compare, run_engine_recording_first_logits
from pdpool.engine.config import EngineConfig
from pdpool.engine.engine_core import LLMEngine
from pdpool.engine.sampling_params import SamplingParams

MAX_NEW = 8


def test_qwen3_5_prefix_hit_skips_recomputation(tiny_qwen3_5):
    rng = random.Random(11)
    system = [rng.randrange(3, 500) for _ in range(70)]  # 4 full blocks + 6
    prompts = [
        system + [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))] for _ in range(6)
    ]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    runs = {}
    for caching in (True, False):
        eng = LLMEngine(
            EngineConfig(
                model=str(tiny_qwen3_5),
                device="cpu",
                num_kv_blocks=256,
                max_num_batched_tokens=96,
                max_num_seqs=8,
                enable_prefix_caching=caching,
            ),
            keep_logits=True,
        )
        eng.generate([[*system, 7]], params)  # warm: snapshot at 64 tokens
        before = eng.stats["computed_tokens"]
        tokens, first = run_engine_recording_first_logits(eng, prompts, params)
        runs[caching] = (tokens, first, eng.stats["computed_tokens"] - before, eng)
    assert runs[True][0] == runs[False][0]
    # Each of the 6 prompts resumed from the 64-token snapshot instead of recomputing it.
    assert runs[False][2] - runs[True][2] == 6 * 64
    eng = runs[True][3]
    assert eng.kv.last_hit_lengths["state"] == 64
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_5), dtype=torch.float32).eval()
    compare(hf, prompts, runs[True][0], runs[True][1], MAX_NEW)
    assert eng.kv.pool.num_used_blocks == 0
