"""Tool calling on a real `pdpool serve` process through the `openai` client: tools
rendered by the tiny checkpoint's (Qwen3-style) template, tool_choice required and named
enforced by guided decoding, auto parsed from Hermes `<tool_call>` blocks (forced here with a
regex, since a random model never writes one), streamed deltas, a second turn."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "weather in Paris?"}]
HERMES = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'


def literal(text: str) -> dict:
    return {"structured_outputs": {"regex": re.escape(text)}}


def call(client, model, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 200)
    kw.setdefault("extra_body", {})
    kw["extra_body"].setdefault("structured_outputs", None)
    if kw["extra_body"]["structured_outputs"] is None:
        del kw["extra_body"]["structured_outputs"]
    return client.chat.completions.create(model=model, tools=TOOLS, **kw)


def check_calls(calls):
    assert calls
    for c in calls:
        assert c.id.startswith("chatcmpl-tool-") and c.type == "function"
        args = json.loads(c.function.arguments)  # strict: see test_guided_server.parse
        jsonschema.validate(args, SCHEMAS[c.function.name])


def test_named_tool_choice(client, model):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        r = call(client, model, tool_choice=named, seed=seed, temperature=1.0, extra_body={})
        msg = r.choices[0].message
        assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
        check_calls(msg.tool_calls)
        assert r.choices[0].finish_reason == "stop"  # as vLLM / OpenAI for a named choice


def test_required_tool_choice(client, model):
    r = call(client, model, tool_choice="required", seed=1, temperature=1.0, extra_body={})
    check_calls(r.choices[0].message.tool_calls)
    assert r.choices[0].finish_reason == "tool_calls"


def test_auto_parses_hermes_tool_calls(client, model):
    r = call(
        client,
        model,
        tool_choice="auto",
        temperature=0,
        extra_body=literal(HERMES),
    )
    msg = r.choices[0].message
    assert [c.function.name for c in msg.tool_calls] == ["get_time"]
    assert json.loads(msg.tool_calls[0].function.arguments) == {"zone": "utc"}
    assert r.choices[0].finish_reason == "tool_calls"
    plain = call(client, model, temperature=0, max_tokens=10)  # auto by default
    assert plain.choices[0].message.tool_calls == []
    assert plain.choices[0].message.content


def reassemble(stream):
    calls: dict[int, dict] = {}
    reason = None
    for chunk in stream:
        for ch in chunk.choices:
            reason = ch.finish_reason or reason
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                c["name"] += (d.function.name or "") if d.function else ""
                c["arguments"] += (d.function.arguments or "") if d.function else ""
    return [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("choice", ["named", "required", "auto"])
def test_streamed_deltas_reassemble_to_the_whole_answer(client, model, choice):
    kw: dict = {"temperature": 0, "extra_body": {}}
    if choice == "named":
        kw["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    elif choice == "required":
        kw["tool_choice"] = "required"
    else:
        kw["extra_body"] = literal(HERMES)
    whole = call(client, model, **kw).choices[0]
    kw["extra_body"] = dict(kw["extra_body"])
    calls, reason = reassemble(call(client, model, stream=True, **kw))
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls)
    assert reason == whole.finish_reason


def test_two_turn_tool_conversation(client, model):
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = call(client, model, tool_choice=named, temperature=0, extra_body={})
    tc = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
        {"role": "tool", "tool_call_id": tc.id, "content": '{"sky": "clear"}'},
    ]
    second = call(client, model, messages=history, temperature=0, max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the history was rendered


def test_parallel_tool_calls_false_keeps_one(client, model):
    two = HERMES + "\n" + HERMES.replace("utc", "cet")
    kw = {"temperature": 0, "max_tokens": 250, "extra_body": literal(two)}
    assert len(call(client, model, **kw).choices[0].message.tool_calls) == 2
    kw["extra_body"] = literal(two)
    one = call(client, model, parallel_tool_calls=False, **kw)
    assert len(one.choices[0].message.tool_calls) == 1


def test_bad_tool_requests_are_400(client, model):
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        call(client, model, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model=model, messages=ASK, tool_choice="required")
