"""The Renderer API's pure shapes (engine/server/render_shapes.py), without a server."""

from __future__ import annotations

import pytest

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
