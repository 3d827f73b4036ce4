"""Prompt logprobs, part by part without a model server: the scoring of rows, the shapes of
the answer (vLLM's), the scheduler's rules for such requests, the request checks and the
sidecar's path. Served end to end: test_prompt_logprobs.py and tests/vllm."""

from __future__ import annotations

import math

import pytest
import torch

from pdpool.engine import scheduler as scheduler_module
from pdpool.engine.kv.manager import KVCacheManager
from pdpool.engine.outputs import RequestOutput, TokenLogprob, merge_deltas
from pdpool.engine.prompt_logprobs import score_prompt_rows
from pdpool.engine.request import Request, RequestStatus
from pdpool.engine.sampling_params import SamplingParams
from pdpool.engine.scheduler import Scheduler, SchedulerConfig
from pdpool.engine.server.echo import prompt_echo
from pdpool.engine.server.logprobs import (
    MAX_PROMPT_LOGPROB_ENTRIES,
    TokenText,
    after_prompt,
    check_prompt_logprobs_size,
    echoed_prompt_logprobs,
    vllm_prompt_logprobs,
)
from pdpool.protocol import ChatFields, CompletionFields, RequestError, validate_request
from pdpool.sidecar.proxy import legs


class Letters:
    """A tokenizer whose token i is the i-th letter; 30 and 31 are the two bytes of "é"."""

    def decode(self, ids: list[int]) -> str:
        raw = b"".join(b"\xc3" if i == 30 else b"\xa9" if i == 31 else bytes([97 + i]) for i in ids)
        return raw.decode("utf-8", errors="replace")


text_of = TokenText(Letters())


def test_a_row_scores_the_next_token_with_its_rank_and_the_likeliest():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [3.0, 0.0, 0.0, 1.0]])
    scored = score_prompt_rows(lambda h: h, logits, [2, 0], 2)
    want = torch.log_softmax(logits, dim=-1)
    assert [s.token_id for s in scored] == [2, 0]
    assert math.isclose(scored[0].logprob, float(want[0, 2]), rel_tol=1e-6)
    assert scored[0].rank == 3  # two tokens likelier
    assert scored[1].rank == 1
    assert [t for t, _ in scored[0].top] in ([1, 3], [3, 1])  # a tie: either order
    assert [t for t, _ in scored[1].top] == [0, 3]
    assert score_prompt_rows(lambda h: h, logits, [1, 3], 0)[0].top == []
    # a tie with the token counts with it: rank 2 for either of the two best
    assert score_prompt_rows(lambda h: h, logits[:1], [1], 0)[0].rank == 2


def test_rows_are_scored_in_passes_with_the_same_result(monkeypatch):
    logits = torch.randn(10, 7, generator=torch.Generator().manual_seed(0))
    targets = [i % 7 for i in range(10)]
    whole = score_prompt_rows(lambda h: h, logits, targets, 3)
    monkeypatch.setattr("pdpool.engine.prompt_logprobs.ROWS_PER_PASS", 3)
    assert score_prompt_rows(lambda h: h, logits, targets, 3) == whole


def test_vllm_layout_puts_the_prompt_token_first_then_ranks_one_to_k():
    entries = [
        TokenLogprob(2, -1.5, [(1, -0.5), (2, -1.5)], rank=2),
        TokenLogprob(3, float("-inf"), [(0, -0.1), (1, -2.0)], rank=26),
    ]
    rows = vllm_prompt_logprobs([0, 2, 3], entries, text_of)
    assert rows[0] is None and len(rows) == 3
    assert list(rows[1]) == ["2", "1"]  # the prompt token among the likeliest: once
    assert rows[1]["2"] == {"logprob": -1.5, "rank": 2, "decoded_token": "c"}
    assert rows[1]["1"] == {"logprob": -0.5, "rank": 1, "decoded_token": "b"}
    assert list(rows[2]) == ["3", "0", "1"]
    assert rows[2]["3"]["logprob"] == -9999.0  # JSON has no -inf (vLLM clamps the same)
    assert rows[2]["1"]["rank"] == 2
    assert vllm_prompt_logprobs([], [], text_of) == []
    # a prompt token that ranks among the likeliest takes its top-k rank there (vLLM's dict)
    tied = vllm_prompt_logprobs([0, 1], [TokenLogprob(1, -0.5, [(2, -0.5), (1, -0.5)], 2)], text_of)
    assert tied[1]["1"]["rank"] == 2 and list(tied[1]) == ["1", "2"]


def test_a_split_character_is_read_with_the_prompt_tokens_before_it():
    """As vLLM: the piece that completes "é" shows it, the piece before it shows ""; the
    first prompt token is no context (it has no row)."""
    entries = [TokenLogprob(30, -1.0, [(31, -0.5)], 2), TokenLogprob(31, -0.1, [(30, -3.0)], 1)]
    rows = vllm_prompt_logprobs([0, 30, 31], entries, text_of)
    assert rows[1]["30"]["decoded_token"] == "" and rows[1]["31"]["decoded_token"] == ""
    assert rows[2]["31"]["decoded_token"] == "é"
    assert rows[2]["30"]["decoded_token"] == ""
    echoed = echoed_prompt_logprobs([0, 30, 31], entries, text_of, 1)
    assert echoed["tokens"] == ["a", "", "é"]
    assert echoed["text_offset"] == [0, 1, 1]
    # the first prompt token is no context: it shows as it decodes alone, and the piece
    # after it with no context before it shows "" (vLLM's)
    alone = echoed_prompt_logprobs([30, 31], [entries[1]], text_of, 0)
    assert alone["tokens"] == ["\ufffd", ""]


def test_an_echoed_prompt_has_no_logprob_first_then_up_to_k_plus_one_likeliest():
    entries = [
        TokenLogprob(2, -1.5, [(1, -0.5), (4, -1.0), (2, -1.5)], rank=3),
        TokenLogprob(1, -0.2, [(1, -0.2), (0, -3.0), (5, -4.0)], rank=1),
    ]
    part = echoed_prompt_logprobs([0, 2, 1], entries, text_of, 1)
    assert part["tokens"] == ["a", "c", "b"]
    assert part["token_logprobs"] == [None, -1.5, -0.2]
    assert part["top_logprobs"] == [None, {"c": -1.5, "b": -0.5}, {"b": -0.2, "a": -3.0}]
    assert part["text_offset"] == [0, 1, 2]
    generated = {
        "tokens": ["xy", "z"],
        "token_logprobs": [-1.0, -2.0],
        "top_logprobs": [{"xy": -1.0}, {"z": -2.0}],
        "text_offset": [0, 2],
    }
    joined = after_prompt(part, generated)
    assert joined["tokens"] == ["a", "c", "b", "xy", "z"]
    assert joined["text_offset"] == [0, 1, 2, 3, 5]
    assert after_prompt(part, None) is part


def test_an_echoed_stream_carries_the_prompt_logprobs_in_each_choices_first_chunk():
    echo = prompt_echo(["ab"], n=2, max_tokens=3, with_token_ids=False, decode=lambda ids: "")
    prompt_part = echoed_prompt_logprobs([0, 1], [TokenLogprob(1, -1.0, [])], text_of, 0)
    echo.logprobs = [prompt_part]
    generated = {
        "tokens": ["c"],
        "token_logprobs": [-2.0],
        "top_logprobs": [{}],
        "text_offset": [0],
    }
    text, lp = echo.delta(1, "c", generated)
    assert text == "abc" and lp is not None and lp["token_logprobs"] == [None, -1.0, -2.0]
    assert echo.delta(1, "c", generated) == ("c", generated)
    assert echo.whole_logprobs(0, generated)["text_offset"] == [0, 1, 2]
    only = prompt_echo(["ab"], n=1, max_tokens=0, with_token_ids=False, decode=lambda ids: "")
    only.logprobs = [prompt_part]
    assert only.whole_logprobs(0, generated) is prompt_part
    assert only.delta(0, "c", generated) == ("ab", prompt_part)


def test_the_answers_prompt_logprobs_are_bounded_across_choices():
    rows = MAX_PROMPT_LOGPROB_ENTRIES // 21
    check_prompt_logprobs_size([rows + 1], 1, 20, 1)  # the first token has none
    with pytest.raises(ValueError, match="fewer"):
        check_prompt_logprobs_size([rows + 2], 1, 20, 1)
    with pytest.raises(ValueError):
        check_prompt_logprobs_size([rows // 2 + 1, rows // 2 + 1], 2, 20, 1)
    with pytest.raises(ValueError):
        check_prompt_logprobs_size([rows // 2 + 2], 1, 20, 2)  # echoed: twice


def test_a_merged_run_of_outputs_keeps_the_first_ones_prompt_logprobs():
    first = RequestOutput("r", "a", [1], False, None, 3, 1, 0)
    first.prompt_logprobs = [TokenLogprob(5, -1.0, [], rank=1)]
    later = RequestOutput("r", "b", [2], False, None, 3, 2, 0)
    assert merge_deltas([first, later]).prompt_logprobs == first.prompt_logprobs


@pytest.mark.parametrize("value", [-1, 21, 1.5, "2"])
def test_sampling_params_refuse_prompt_logprobs_beyond_the_limit(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value).validate()


# --- the scheduler --------------------------------------------------------------------
BS = 4


def request(rid: str, n: int, prompt_logprobs=None, threshold=None) -> Request:
    params = SamplingParams(max_tokens=4, prompt_logprobs=prompt_logprobs)
    return Request(rid, list(range(n)), params, cache_hit_threshold=threshold, block_size=BS)


def run_prompt(s: Scheduler, r: Request) -> None:
    s.add_request(r)
    while r.num_computed_tokens < r.num_tokens:
        out = s.schedule()
        for item in out.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
            s.kv.cache_full_blocks(item.request, item.request.num_computed_tokens)


def test_a_request_for_its_prompts_logprobs_computes_every_row_and_is_never_rejected(
    monkeypatch,
):
    monkeypatch.setattr(scheduler_module, "PROMPT_LOGPROB_ROWS_PER_STEP", 8)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=32), KVCacheManager(64, BS))
    warm = request("warm", 20)
    run_prompt(s, warm)
    s.finish_request(warm, RequestStatus.FINISHED_STOPPED)
    again = request("again", 20)
    s.add_request(again)
    s.schedule()
    assert again.num_computed_tokens == 16  # a plain request hits the cached prefix
    s.finish_request(again, RequestStatus.FINISHED_ABORTED)

    # the same prompt for its logprobs: from the first row, 8 rows a step, and a
    # threshold that the hit would fail does not turn it away
    scored = request("scored", 20, prompt_logprobs=1, threshold=0.9)
    s.add_request(scored)
    chunks = []
    while scored.num_computed_tokens < 20:
        out = s.schedule()
        assert not out.rejected
        chunks.append(out.scheduled[0].num_new_tokens)
        scored.num_computed_tokens += chunks[-1]
        scored.prompt_logprobs += [TokenLogprob(0, 0.0, [])] * chunks[-1]
    assert chunks == [8, 8, 4] and scored.num_cached_tokens == 0
    assert not scored.computes_prompt_rows  # done: a preemption now may use the cache


# --- the request checks, shared by the engines and the front-ends ----------------------
@pytest.mark.parametrize(
    "body,accepted",
    [
        ({"prompt_logprobs": 0, "stream": True}, True),  # as vLLM: 0 streams
        ({"prompt_logprobs": 1, "stream": True}, False),
        ({"prompt_logprobs": -1, "stream": True}, False),
        ({"prompt_logprobs": -1}, True),  # all: the engines' logprob limit refuses it
        ({"prompt_logprobs": -2}, False),
        ({"prompt_logprobs": True}, False),
        ({"prompt_logprobs": 2, "kv_transfer_params": {"do_remote_prefill": True}}, False),
        ({"prompt_logprobs": 2, "kv_transfer_params": {"do_remote_decode": True}}, True),
        ({"echo": True, "logprobs": 3}, True),
    ],
)
def test_prompt_logprobs_checks(body, accepted):
    for model, base in (
        (CompletionFields, {"prompt": "x"}),
        (ChatFields, {"messages": [{"role": "user", "content": "x"}]}),
    ):
        if "echo" in body and model is ChatFields:
            continue
        if accepted:
            validate_request({**base, **body}, model)
        else:
            with pytest.raises(RequestError) as err:
                validate_request({**base, **body}, model)
            assert err.value.param == "prompt_logprobs"


def test_the_sidecar_serves_them_where_they_land_and_a_prefill_leg_drops_them():
    assert legs.served_where_it_lands({"prompt": "x", "prompt_logprobs": 0})
    assert legs.served_where_it_lands({"prompt": "x", "echo": True, "logprobs": 0})
    assert not legs.served_where_it_lands({"prompt": "x", "echo": True})
    assert not legs.served_where_it_lands({"prompt": "x", "logprobs": 2})
    chat = {"messages": [], "echo": True, "logprobs": True}  # chat's echo scores nothing
    assert not legs.served_where_it_lands(chat)
    assert legs.served_where_it_lands({**chat, "prompt_logprobs": 1})
    assert "prompt_logprobs" not in legs.prefill_leg({"prompt": "x", "prompt_logprobs": 3})
