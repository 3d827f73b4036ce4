"""Qwen3.5 (gated attention + Gated DeltaNet) in the engine against transformers.

The recurrent state must survive everything the scheduler does to a request: prompt chunks
split at arbitrary points (not the rule's 64-token chunks), decodes batched with other
requests' chunks, and preemption (the request starts over from a zero state).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.parity import compare, random_prompts, run_engine_recording_first_logits
from pdpool.engine.config import EngineConfig
from pdpool.engine.engine_core import LLMEngine
from pdpool.engine.sampling_params import SamplingParams

MAX_NEW = 8


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """These tiny matmuls gain nothing from threads, and on a shared 2-core CI machine
    two spinning OpenMP threads make them 30x slower; one thread is steady."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class RememberedGenerate:
    """transformers' model whose greedy `generate` runs once per prompt: the scenarios
    below compare against the same references, and CPU time is scarce in CI."""

    def __init__(self, model):
        self.model, self.config, self._done = model, model.config, {}

    def generate(self, input_ids, **kwargs):
        key = (tuple(input_ids[0].tolist()), kwargs["max_new_tokens"])
        if key not in self._done:
            self._done[key] = self.model.generate(input_ids, **kwargs)
        return self._done[key]


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3_5):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_5), dtype=torch.float32)
    return RememberedGenerate(model.eval())


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(10, 1, 200, vocab=512, seed=3)


def test_checkpoint_is_hybrid(tiny_qwen3_5, hf_model):
    types = hf_model.config.layer_types
    assert types.count("linear_attention") == 3 and types.count("full_attention") == 1
    engine = LLMEngine(EngineConfig(model=str(tiny_qwen3_5), device="cpu", num_kv_blocks=8))
    assert engine.model.num_attention_layers == 1
    assert engine.kv_cache.shape[1] == 1  # only the full-attention layer has paged KV
    state = engine.state
    # a slot per schedulable request (at least), 3 linear layers; conv keeps K-1 = 3 inputs
    # of q/k/v (2 key heads x 64 twice, 4 value heads x 64); ssm [Hv=4, Dk=64, Dv=64] in fp32
    assert state.conv.shape[0] == state.ssm.shape[0] >= engine.config.max_num_seqs
    assert tuple(state.conv.shape[1:]) == (3, 2 * 2 * 64 + 4 * 64, 3)
    assert tuple(state.ssm.shape[1:]) == (3, 4, 64, 64)
    assert state.ssm.dtype == torch.float32


@pytest.mark.parametrize(
    "name,knobs",
    [
        # Prompts over 40 tokens are split into chunks that end mid-way through the rule's own
        # 64-token chunks, in steps that also carry other requests' decodes.
        ("chunked", dict(max_num_batched_tokens=40, num_kv_blocks=256)),
        # 20 blocks of 16 tokens cannot hold 10 prompts of up to 200 tokens: requests are
        # preempted and recompute from a zero state.
        ("preempted", dict(max_num_batched_tokens=256, num_kv_blocks=20)),
    ],
)
def test_greedy_parity_with_transformers(tiny_qwen3_5, hf_model, prompts, name, knobs):
    engine = LLMEngine(
        EngineConfig(model=str(tiny_qwen3_5), device="cpu", **knobs), keep_logits=True
    )
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    tokens, first_logits = run_engine_recording_first_logits(engine, prompts, params)
    if name == "preempted":
        assert engine.scheduler.num_preemptions > 0
    else:
        assert engine.stats["steps"] > len(prompts)  # continuous batching, chunked prompts
    report = compare(hf_model, prompts, tokens, first_logits, MAX_NEW)
    assert report.compared == len(prompts)
    for i, step, gap in report.allowed_divergences:
        print(f"allowed divergence: prompt {i} at step {step}, top-2 gap {gap:.2e}")
    assert len(report.allowed_divergences) <= 1  # near ties are rare, not the rule
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    assert not engine.kv.req_slot  # every state slot went back


def test_state_is_per_slot_not_shared(tiny_qwen3_5):
    """The same prompt twice in one batch, next to a different one, decodes identically
    to running it alone: no request reads or writes another's state slot."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt, other = list(range(10, 90)), list(range(200, 237))
    config = dict(
        model=str(tiny_qwen3_5), device="cpu", num_kv_blocks=64, max_num_batched_tokens=32
    )
    alone = LLMEngine(EngineConfig(**config)).generate([prompt], params)[0]
    together = LLMEngine(EngineConfig(**config)).generate([prompt, other, prompt], params)
    assert together[0] == together[2] == alone
    assert together[1] != alone


def test_forward_refuses_a_batch_without_state(tiny_qwen3_5):
    engine = LLMEngine(EngineConfig(model=str(tiny_qwen3_5), device="cpu", num_kv_blocks=8))
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=1))
    out = engine.scheduler.schedule()
    ids, positions, meta = engine.runner.prepare(out)
    with pytest.raises(ValueError, match="recurrent state"):
        engine.model(ids, positions, engine.kv_cache, meta, None)
    meta.state_slots = None
    with pytest.raises(ValueError, match="state_slots"):
        engine.model(ids, positions, engine.kv_cache, meta, engine.state)


@pytest.mark.parametrize(
    "flags,why",
    [
        (["--sliding-window", "8"], "qwen3 only"),
        (["--layers", "1"], "--layers >= 2"),
        (["--head-dim", "12"], "rotary"),
    ],
)
def test_tiny_model_cli_rejects_bad_qwen3_5_specs(tmp_path, flags, why):
    import argparse

    from pdpool.cli import CliError
    from pdpool.engine import tiny_model_cli

    parser = argparse.ArgumentParser()
    tiny_model_cli.add_arguments(parser)
    args = parser.parse_args([str(tmp_path / "m"), "--arch", "qwen3_5", *flags])
    with pytest.raises(CliError, match=why):
        tiny_model_cli.main(args)
    assert not (tmp_path / "m" / "model.safetensors").exists()


def test_prompt_logprobs_match_transformers_across_chunks_and_a_cached_prefix(
    tiny_qwen3_5, hf_model
):
    """A hybrid model's prompt rows scored over 40-token steps; the second request finds
    the prompt cached (state snapshots included) and still computes and scores every row."""
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_qwen3_5), device="cpu", max_num_batched_tokens=40, num_kv_blocks=64
        )
    )
    prompt = [(i * 13 + 7) % 512 for i in range(100)]
    with torch.no_grad():
        logits = hf_model.model(torch.tensor([prompt])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    for rid in ("first", "again"):
        engine.add_request(rid, prompt, params)
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
        (out,) = [o for o in outputs if o.request_id == rid]
        assert out.num_cached_tokens == 0
        scored = out.prompt_logprobs
        assert scored is not None and len(scored) == len(prompt) - 1
        for pos, lp in enumerate(scored, start=1):
            assert lp.token_id == prompt[pos]
            assert abs(lp.logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
            assert [t for t, _ in lp.top] == ref[pos - 1].topk(2).indices.tolist()
    assert engine.stats["steps"] >= 6
