"""Qwen3.5 checkpoints as published: `Qwen3_5ForConditionalGeneration`, the text model under
`model.language_model.*` beside a vision tower. The engine loads the text part (the tower is
ignored, with a log line) and computes what it computes from the causal-LM layout: the same
greedy tokens, the same logits up to float32 rounding.

The published-layout checkpoint is written by transformers' own Qwen3_5ForConditionalGeneration
(with a 1-block vision tower), holding the tiny causal LM's weights.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tests.support.parity import LOGIT_ATOL, random_prompts, run_engine_recording_first_logits
from pdpool.engine.config import EngineConfig
from pdpool.engine.engine_core import LLMEngine
from pdpool.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def published(tiny_qwen3_5, tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    out = tmp_path_factory.mktemp("qwen3_5-published")
    lm = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_5), dtype=torch.float32)
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=lm.config.hidden_size,
        num_position_embeddings=16,
    )
    config = Qwen3_5Config(
        text_config=lm.config.to_dict(), vision_config=vision, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    mm = Qwen3_5ForConditionalGeneration(config)
    mm.model.language_model.load_state_dict(lm.model.state_dict())
    mm.lm_head.load_state_dict(lm.lm_head.state_dict())
    mm.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        src = tiny_qwen3_5 / name
        if src.is_file():
            (out / name).write_bytes(src.read_bytes())
    return out


def test_published_layout_is_what_we_think(published):
    from safetensors import safe_open

    config = json.loads((published / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert "text_config" in config and "vision_config" in config
    with safe_open(str(published / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any(k.startswith("model.language_model.layers.") for k in keys)
    assert any(k.startswith("model.visual.") for k in keys)
    assert not any(k.startswith("model.layers.") for k in keys)


def test_published_checkpoint_gives_the_same_tokens(tiny_qwen3_5, published, caplog):
    prompts = random_prompts(4, 5, 90, vocab=512, seed=11)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    runs = []
    for folder in (tiny_qwen3_5, published):
        with caplog.at_level(logging.INFO, logger="pdpool.engine.model_loader"):
            engine = LLMEngine(
                EngineConfig(model=str(folder), device="cpu", num_kv_blocks=64), keep_logits=True
            )
        tokens, logits = run_engine_recording_first_logits(engine, prompts, params)
        runs.append((tokens, logits))
    assert runs[0][0] == runs[1][0]
    # The same weights in two engines: two computations, so equal only up to float32
    # rounding (LOGIT_ATOL, the bound against transformers); a weight loaded from the wrong
    # tensor, or not at all, moves logits by far more.
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=LOGIT_ATOL)
    assert "vision tower" in caplog.text and "model.visual.*" in caplog.text
