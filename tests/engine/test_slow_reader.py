"""A reader that falls behind the engine gets every output waiting for it at once, merged:
the same tokens, text and logprobs as the engine made them one step at a time, and the
latency metrics still see one sample per token."""

from __future__ import annotations

import asyncio

from pdpool.engine.core_client import InProcessClient
from pdpool.engine.outputs import merge_deltas, mergeable_runs
from pdpool.engine.config import EngineConfig
from pdpool.engine.engine_core import LLMEngine, RequestOutput
from pdpool.engine.sampling import TokenLogprob
from pdpool.engine.sampling_params import SamplingParams
from pdpool.engine.server.choices import ChoiceRunner
from pdpool.engine.server.metrics import EngineMetrics
from pdpool.engine.server.translator import ChoiceRequest
from pdpool.sidecar.gateway.migration import StreamState


def _out(text, ids, finished=False, lps=None, **kw) -> RequestOutput:
    return RequestOutput(
        "r", text, ids, finished, "length" if finished else None, 5, kw.pop("n", 1), 0,
        logprobs=lps, **kw,
    )  # fmt: skip


def test_merge_joins_deltas_and_keeps_the_last_state():
    lp = [TokenLogprob(t, -0.5, []) for t in (7, 8, 9)]
    merged = merge_deltas(
        [
            _out("a", [7], lps=[lp[0]], n=1, produced_at=1.0),
            _out("b", [8], lps=[lp[1]], n=2, produced_at=2.0),
            _out("c", [9], True, lps=[lp[2]], n=3, produced_at=3.0, kv_transfer_params={"x": 1}),
        ]
    )
    # Exact, logprobs too: merging copies the deltas' objects, it computes nothing.
    assert (merged.new_text, merged.new_token_ids, merged.logprobs) == ("abc", [7, 8, 9], lp)
    assert merged.finished and merged.finish_reason == "length"
    assert (merged.num_output_tokens, merged.produced_at) == (3, 3.0)
    assert merged.kv_transfer_params == {"x": 1}
    one = _out("a", [7])
    assert merge_deltas([one]) is one
    assert merge_deltas([_out("a", [7]), _out("", [8])]).logprobs is None


def test_runs_never_end_in_held_back_tokens_after_emitted_text():
    def texts(outs):
        return [[o.new_text for o in run] for run in mergeable_runs(outs)]

    outs = [_out(t, [i]) for i, t in enumerate(["a", "b", "", "", "c", "d", "", "e"])]
    # Text, then tokens whose text is held back: cut there; held-back tokens, then the text
    # that completes them: one run (as a single-token reader would commit them together).
    assert texts(outs) == [["a", "b"], ["", "", "c", "d"], ["", "e"]]
    assert texts(outs[2:4]) == [["", ""]]
    failed = _out("", [9], True)
    failed.finish_reason = "error"
    assert texts([*outs[2:4], failed]) == [["", ""], [""]]  # sent before the error
    assert texts(outs[:2]) == [["a", "b"]]
    gateway = StreamState("/v1/completions", {"prompt": "x", "stream": True})
    for run in mergeable_runs(outs[:4]):
        merged = merge_deltas(run)
        chunk = {"choices": [{"index": 0, "text": merged.new_text}]}
        chunk["choices"][0]["token_ids"] = merged.new_token_ids
        gateway.observe(chunk, continuation=False)
    # Only tokens whose text was sent count as relayed: a resumed stream regenerates the rest.
    assert (gateway.committed, gateway.pending) == ([0, 1], [2, 3])


def _metric(metrics: EngineMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name, metrics.vllm_labels) or 0.0


def _one_step_at_a_time(engine, prompt, params) -> tuple[list[int], str]:
    engine.add_request("solo", prompt, params)
    ids, text = [], []
    while engine.has_unfinished():
        for o in engine.step():
            ids += o.new_token_ids
            text.append(o.new_text)
    return ids, "".join(text)


def test_a_reader_that_falls_behind_gets_merged_outputs(tiny_qwen3):
    engine = LLMEngine(EngineConfig(model=str(tiny_qwen3), device="cpu", num_kv_blocks=64))
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11] * 5, [12, 13] * 7]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1)
    solo = {i: _one_step_at_a_time(engine, p, params) for i, p in enumerate(prompts)}
    aengine = InProcessClient(engine)
    metrics = EngineMetrics(aengine.view, "m")
    runner = ChoiceRunner(aengine, metrics)
    specs = [
        ChoiceRequest(i, True, f"slow-{i}", p, params, None, None, None)
        for i, p in enumerate(prompts)
    ]

    async def read():
        choices = await runner.start(specs, lambda: lambda lps: {"n": len(lps)})
        seen = {}
        for c in choices:
            await asyncio.sleep(0.5)  # the engine goes on meanwhile
            seen[c.index] = [o async for o in runner.outputs(c)]
        return seen

    try:
        seen = asyncio.run(read())
    finally:
        aengine.shutdown()
    for i, outs in seen.items():
        ids, text = solo[i]
        assert [t for o in outs for t in o.new_token_ids] == ids
        assert [lp.token_id for o in outs for lp in o.logprobs] == ids
        assert "".join(o.new_text for o in outs) == text
        assert outs[-1].finished and outs[-1].num_output_tokens == 40
    # The later readers slept while their requests ran: their outputs came merged.
    assert max(len(o.new_token_ids) for o in seen[2]) > 1
    # One TTFT sample per request and one ITL sample per later token, merged or not.
    assert _metric(metrics, "vllm:time_to_first_token_seconds_count") == len(prompts)
    assert _metric(metrics, "vllm:inter_token_latency_seconds_count") == len(prompts) * 39
    assert _metric(metrics, "vllm:generation_tokens_total") == len(prompts) * 40
