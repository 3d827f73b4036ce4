"""Comparing the engine with Hugging Face transformers on the same checkpoint."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

# float32 on CPU: the engine and transformers differ only by summation order.
LOGIT_ATOL = 2e-4


@dataclass
class ParityReport:
    compared: int = 0
    max_logit_diff: float = 0.0
    # (prompt index, step, top-2 gap): divergences explained by a near tie.
    allowed_divergences: list = field(default_factory=list)


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [lo, hi] + [rng.randint(lo, hi) for _ in range(n - 2)]
    return [[rng.randrange(3, vocab) for _ in range(k)] for k in lengths]


def hf_greedy(model, prompt: list[int], max_new: int):
    """Greedy tokens and the logits of every step, from transformers' generate."""
    out = model.generate(
        torch.tensor([prompt], device=getattr(model, "device", "cpu")),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [step[0].float().cpu() for step in out.logits]


def run_engine_recording_first_logits(engine, prompts, params):
    """Runs prompts concurrently; returns output tokens and each one's first-token logits."""
    ids = [f"p{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    tokens = {rid: [] for rid in ids}
    first_logits = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
        for rid, logits in (engine.last_logits or {}).items():
            first_logits.setdefault(rid, logits)
    return [tokens[r] for r in ids], [first_logits[r] for r in ids]


def compare(
    hf_model, prompts, engine_tokens, engine_first_logits, max_new, atol: float = LOGIT_ATOL
) -> ParityReport:
    report = ParityReport()
    for i, (prompt, got) in enumerate(zip(prompts, engine_tokens, strict=True)):
        ref, ref_logits = hf_greedy(hf_model, prompt, max_new)
        diff = (engine_first_logits[i].float().cpu() - ref_logits[0]).abs().max().item()
        report.max_logit_diff = max(report.max_logit_diff, diff)
        assert diff < atol, f"prompt {i} (len {len(prompt)}): first-step logits differ by {diff}"
        report.compared += 1
        if got == ref:
            continue
        step = next(j for j, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b)
        top2 = ref_logits[step].topk(2).values
        gap = (top2[0] - top2[1]).item()
        assert gap < atol, (
            f"prompt {i} (len {len(prompt)}) diverges at step {step} "
            f"with a clear winner (gap {gap}): {got} vs {ref}"
        )
        report.allowed_divergences.append((i, step, gap))
    return report
