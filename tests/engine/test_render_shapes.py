"""The Renderer API's pure shapes (engine/server/render_shapes.py), without a server."""

from __future__ import annotations

import pytest

from pdpool.engine.outputs import TokenLogprob
from pdpool.engine.server.logprobs import generate_formatter
from pdpool.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from pdpool.engine.server.render_shapes import (
    completion_body,
    rendered_ids,
    unrendered_field,
    vllm_sampling_params,
)
from pdpool.protocol import RequestError, validate_request


def test_sampling_params_are_written_as_vllm_serializes_them():
    req = validate_request(
        {"prompt": "a", "top_k": -1, "n": 3, "min_tokens": 2, "stop": "s"}, CompletionRequest
    )
    out = vllm_sampling_params(req, max_tokens=16, logprobs=None, kv_transfer_params=None)
    assert out == {
        "n": 3,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,  # vLLM keeps an explicit -1; 16 max tokens and 1 choice are its defaults
        "min_p": 0.0,
        "stop": ["s"],
        "stop_token_ids": [],
        "min_tokens": 2,
        "output_kind": 2,
        "skip_clone": True,
        "bad_words": [],
        "skip_reading_prefix_cache": False,
    }
    chat = validate_request(
        {"messages": [{"role": "user", "content": "x"}], "temperature": 0, "stream": True},
        ChatCompletionRequest,
    )
    greedy = vllm_sampling_params(chat, 5, 0, {"do_remote_decode": True})
    assert "top_p" not in greedy and "min_p" not in greedy
    assert (greedy["max_tokens"], greedy["logprobs"], greedy["output_kind"]) == (5, 0, 1)
    assert greedy["extra_args"] == {"kv_transfer_params": {"do_remote_decode": True}}
    assert "skip_special_tokens" not in greedy
    tools = [{"type": "function", "function": {"name": "f"}}]
    for choice, kept in (("auto", False), ("none", None)):
        offered = validate_request(
            {"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": choice},
            ChatCompletionRequest,
        )
        # vLLM's Hermes tool parser keeps <tool_call> in the text when tools may be called
        assert vllm_sampling_params(offered, 16, None, None).get("skip_special_tokens") == kept


def test_a_batch_is_numbered_and_one_prompt_keeps_the_id():
    assert rendered_ids("cmpl-x", 1) == ["cmpl-x"]
    assert rendered_ids("cmpl-x", 2) == ["cmpl-x-0", "cmpl-x-1"]


def test_what_a_render_cannot_carry_is_named():
    assert unrendered_field({"response_format": {"type": "text"}, "tool_choice": "auto"}) is None
    assert unrendered_field({"response_format": {"type": "json_object"}}) == "response_format"
    assert unrendered_field({"tool_choice": "required"}) == "tool_choice"


def test_a_generate_body_becomes_a_completion_body():
    body = {
        "token_ids": [4, 5],
        "sampling_params": {
            "temperature": 0.0,
            "output_kind": 2,  # delivery settings: no effect on the tokens
            "skip_clone": True,
            "extra_args": {"kv_transfer_params": {"do_remote_prefill": True}},
            "bad_words": [],
        },
        "stream": True,
        "model": "m",
        "features": None,
    }
    assert completion_body(body, default_max_tokens=30) == {
        "temperature": 0.0,
        "bad_words": [],
        "max_tokens": 30,
        "prompt": [4, 5],
        "stream": True,
        "kv_transfer_params": {"do_remote_prefill": True},
        "model": "m",
    }


@pytest.mark.parametrize(
    "body, param",
    [
        ({"token_ids": [], "sampling_params": {}}, "token_ids"),
        ({"token_ids": [1, True], "sampling_params": {}}, "token_ids"),
        ({"token_ids": [1], "sampling_params": []}, "sampling_params"),
        ({"token_ids": [1], "sampling_params": {"logprob_token_ids": [3]}}, "sampling_params"),
        ({"token_ids": [1], "sampling_params": {}, "content_parts": [{}]}, "content_parts"),
    ],
)
def test_a_generate_body_we_cannot_serve_is_refused_by_name(body, param):
    with pytest.raises(RequestError) as refused:
        completion_body(body, default_max_tokens=1)
    assert refused.value.param == param


def test_generate_logprobs_list_the_sampled_token_then_the_likeliest_others():
    fmt = generate_formatter(2)
    among = TokenLogprob(7, -0.5, [(7, -0.5), (3, -1.0)], rank=1)
    outside = TokenLogprob(9, float("-inf"), [(4, -0.1), (5, -2.0)], rank=500)
    nan = TokenLogprob(2, float("nan"), [(4, -0.1)], rank=0)
    content = fmt([among, outside, nan])["content"]
    assert content[0] == {
        "token_id": 7,
        "logprob": -0.5,
        "rank": 1,
        "top_logprobs": [
            {"token_id": 7, "logprob": -0.5, "rank": 1},
            {"token_id": 3, "logprob": -1.0, "rank": 2},
        ],
    }
    # vLLM shows the first max(k, 1) of its map: the sampled token takes one of k places
    assert [t["token_id"] for t in content[1]["top_logprobs"]] == [9, 4]
    assert content[1]["logprob"] == -9999.0 and content[1]["rank"] == 500
    assert (content[2]["logprob"], content[2]["rank"]) == (-9999.0, None)  # NaN: no rank
    assert len(generate_formatter(0)([outside])["content"][0]["top_logprobs"]) == 1


def test_generate_drops_the_prompts_logprobs_from_a_stream_and_passes_logprobs():
    body = {"token_ids": [1, 2], "sampling_params": {"logprobs": 2, "prompt_logprobs": 1}}
    whole = completion_body(body, 16)
    assert (whole["logprobs"], whole["prompt_logprobs"]) == (2, 1)
    streamed = completion_body({**body, "stream": True}, 16)
    assert streamed["logprobs"] == 2 and "prompt_logprobs" not in streamed
