"""The gateway's continuation of a broken guided stream (pure): it keeps the constraint in
the shape /v1/completions takes and names the tokens already sent, which the engine's
grammar is advanced over."""

from __future__ import annotations

from pdpool.sidecar.gateway.migration import GUIDED_PREFIX, StreamState, can_migrate

SCHEMA = {"type": "object"}


def broken_stream(body: dict) -> StreamState:
    state = StreamState("/v1/chat/completions", {"stream": True, "max_tokens": 50, **body})
    state.observe({"id": "x", "choices": [{"delta": {"role": "assistant"}}]}, False)
    state.observe({"choices": [{"delta": {"content": "{"}, "token_ids": [90]}]}, False)
    state.prompt_ids = [1, 2, 3]
    return state


def test_response_format_becomes_structured_outputs_with_the_sent_tokens():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    body = broken_stream({"response_format": fmt}).continuation()
    assert "response_format" not in body
    assert body["structured_outputs"] == {"json": SCHEMA}
    assert body[GUIDED_PREFIX] == [90]
    assert body["prompt"] == [1, 2, 3, 90]
    json_mode = broken_stream({"response_format": {"type": "json_object"}}).continuation()
    assert json_mode["structured_outputs"] == {"json_object": True}


def test_vllm_fields_are_kept_and_unguided_streams_carry_no_prefix():
    body = broken_stream({"guided_regex": "[a-z]+"}).continuation()
    assert body["guided_regex"] == "[a-z]+" and body[GUIDED_PREFIX] == [90]
    assert GUIDED_PREFIX not in broken_stream({}).continuation()


def test_streams_with_tools_are_not_migrated():
    body = {"stream": True, "messages": [], "tools": [{"type": "function"}]}
    assert not can_migrate("/v1/chat/completions", body)
    assert can_migrate("/v1/chat/completions", {"stream": True, "messages": [], "guided_json": {}})
