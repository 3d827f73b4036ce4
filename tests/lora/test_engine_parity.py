"""The engine with LoRA adapters equals transformers + peft on the same tiny checkpoint and
adapters: greedy tokens and first-step logits, per adapter, with several adapters and the
base model batched in the same steps (in-process engine: no server)."""

from __future__ import annotations

import pytest
import torch

from devtools.lora_maker import load_with_adapter
from pdpool.engine.config import EngineConfig
from pdpool.engine.engine_core import LLMEngine
from pdpool.engine.lora.adapter_dir import read_adapter
from pdpool.engine.lora.registry import LoRARef
from pdpool.engine.sampling_params import SamplingParams
from tests.support.parity import LOGIT_ATOL, hf_greedy, random_prompts

MAX_NEW = 6


def _ref(name: str, path, lora_id: int) -> LoRARef:
    files = read_adapter(str(path), 16)
    return LoRARef(name, lora_id, files.path, files.digest)


def _engine(model_dir, max_loras: int) -> LLMEngine:
    cfg = EngineConfig(
        model=str(model_dir),
        device="cpu",
        num_kv_blocks=256,
        enable_lora=True,
        max_loras=max_loras,
        max_cpu_loras=4,
    )
    return LLMEngine(cfg, keep_logits=True)


def _run_mixed(engine, jobs):
    """jobs: (request id, prompt, LoRARef or None), all added before the first step."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for rid, prompt, ref in jobs:
        engine.add_request(rid, prompt, params, lora=ref)
    tokens = {rid: [] for rid, _, _ in jobs}
    first = {}
    mixed_steps = 0
    while engine.has_unfinished():
        adapters_before = {r.lora.name if r.lora else None for r in engine.scheduler.running}
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
        for rid, logits in (engine.last_logits or {}).items():
            first.setdefault(rid, logits)
        adapters_now = {r.lora.name if r.lora else None for r in engine.scheduler.running}
        mixed_steps += len(adapters_before | adapters_now) > 2
    return tokens, first, mixed_steps


def _check(model_dir, adapters, jobs, tokens, first=None):
    hf = {None: None}
    for rid, prompt, ref in jobs:
        if ref is None:
            from transformers import AutoModelForCausalLM

            model = (
                hf.get(None)
                or AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
            )
            hf[None] = model
        else:
            model = hf.get(ref.name) or load_with_adapter(model_dir, adapters[ref.name])
            hf[ref.name] = model
        want, want_logits = hf_greedy(model, prompt, MAX_NEW)
        if first is not None:
            diff = (first[rid] - want_logits[0]).abs().max().item()
            assert diff < LOGIT_ATOL, f"{rid}: first-step logits differ by {diff}"
        assert tokens[rid] == want, f"{rid}: {tokens[rid]} vs transformers+peft {want}"


# Short prompts: every step's LoRA is the masked dense form; long ones: prompt steps go run
# by run (kernels/lora_reference.RUN_MIN_TOKENS), decode steps stay masked.
@pytest.mark.parametrize("lengths", [(5, 40), (40, 90)], ids=["short", "long"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_mixed_adapter_batches_equal_transformers_peft(
    arch, lengths, tiny_qwen3, tiny_qwen3_5, qwen3_adapters, qwen3_5_adapters
):
    model_dir, adapters = (
        (tiny_qwen3, qwen3_adapters) if arch == "qwen3" else (tiny_qwen3_5, qwen3_5_adapters)
    )
    refs = [_ref(n, p, i + 1) for i, (n, p) in enumerate(adapters.items())]
    prompts = random_prompts(2 * (len(refs) + 1), *lengths, 500, seed=7)
    choices = [None, *refs]
    jobs = [(f"r{i}", p, choices[i % len(choices)]) for i, p in enumerate(prompts)]
    engine = _engine(model_dir, max_loras=len(refs))
    try:
        tokens, first, mixed = _run_mixed(engine, jobs)
    finally:
        engine.close()
    assert mixed > 0, "no step batched the base model with two adapters"
    _check(model_dir, adapters, jobs, tokens, first)
    # The adapters change the model's answer (else this test proves nothing).
    plain = _engine(model_dir, max_loras=1)
    try:
        plain_tokens, _, _ = _run_mixed(plain, [(rid, p, None) for rid, p, _ in jobs])
    finally:
        plain.close()
    changed = sum(plain_tokens[rid] != tokens[rid] for rid, _, ref in jobs if ref is not None)
    assert changed >= len(refs), "the adapters hardly change the greedy tokens"
    assert all(plain_tokens[rid] == tokens[rid] for rid, p, ref in jobs if ref is None)


def test_max_loras_limits_distinct_adapters_per_step(tiny_qwen3, qwen3_adapters):
    refs = [_ref(n, p, i + 1) for i, (n, p) in enumerate(qwen3_adapters.items())]
    prompts = random_prompts(6, 5, 20, 500, seed=9)
    jobs = [(f"r{i}", p, refs[i % len(refs)]) for i, p in enumerate(prompts)]
    engine = _engine(tiny_qwen3, max_loras=2)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in jobs}
    try:
        for rid, prompt, ref in jobs:
            engine.add_request(rid, prompt, params, lora=ref)
        while engine.has_unfinished():
            for o in engine.step():
                tokens[o.request_id].extend(o.new_token_ids)
            running = {r.lora.name for r in engine.scheduler.running if r.lora is not None}
            assert len(running) <= 2
    finally:
        engine.close()
    assert all(len(t) == MAX_NEW for t in tokens.values())
    _check(tiny_qwen3, qwen3_adapters, jobs, tokens)
