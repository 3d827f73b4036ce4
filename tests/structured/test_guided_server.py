"""Structured outputs on a real `pdpool serve` process, through the `openai` client: the
tiny random model's unguided output is gibberish, so every parse and schema check below
holds only because the engine masks the logits with the request's grammar."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "rain": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["sun", "wind"]}, "maxItems": 3},
    },
    "required": ["city", "days", "rain"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "the weather, as JSON"}]


def chat(client, model, **kw):
    kw.setdefault("messages", MESSAGES)
    kw.setdefault("max_tokens", 300)
    return client.chat.completions.create(model=model, **kw)


def test_unguided_output_is_not_json(client, model):
    text = chat(client, model, temperature=0, max_tokens=40).choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(text)


def test_json_mode_always_parses(client, model):
    # At temperature 1 the random model often writes past max_tokens inside a string: an
    # output cut by the length is no JSON by design. Every one that ends parses.
    ended = 0
    for seed in range(12):
        r = chat(client, model, response_format={"type": "json_object"}, seed=seed)
        if r.choices[0].finish_reason == "length":
            assert r.usage.completion_tokens == 300
            continue
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(parse(r.choices[0].message.content), dict)
        ended += 1
    assert ended >= 3, f"only {ended} of 12 seeded outputs ended"


def parse(text: str):
    # strict: no raw control characters in strings, though a byte-level vocabulary has a
    # token for each (xgrammar's length-bounded string rule let them through)
    return json.loads(text)


def test_json_schema_validates_for_20_seeds(client, model):
    # Compact JSON (vLLM's disable_any_whitespace); free whitespace below.
    so = {"json": SCHEMA, "disable_any_whitespace": True}
    # n choices sample with seeds seed + i: seeds 0..19
    choices = [
        c
        for seed in (0, 10)
        for c in chat(
            client, model, seed=seed, n=10, temperature=1.0, extra_body={"structured_outputs": so}
        ).choices
    ]
    for c in choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(parse(c.message.content), SCHEMA)
    assert len({c.message.content for c in choices}) > 1  # sampled, not one fixed answer


def test_response_format_json_schema(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    r = chat(client, model, response_format=fmt, seed=1, n=8, temperature=1.0, max_tokens=300)
    for c in r.choices:  # blanks are bounded per gap: none wanders until max_tokens
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(parse(c.message.content), SCHEMA)


def test_guided_choice_completions(client, model):
    choices = ["pdpool", "vllm", "sglang"]
    for seed in range(4):
        r = client.completions.create(
            model=model,
            prompt="best engine:",
            max_tokens=20,
            seed=seed,
            extra_body={"guided_choice": choices},
        )
        assert r.choices[0].text in choices
        assert r.choices[0].finish_reason == "stop"


def test_structured_outputs_regex_and_grammar(client, model):
    r = client.completions.create(
        model=model,
        prompt="a date:",
        max_tokens=30,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}},
    )
    assert len(r.choices[0].text) == 10 and r.choices[0].text.startswith("20")
    r = chat(
        client,
        model,
        temperature=0,
        extra_body={"guided_grammar": 'root ::= "yes" | "no" | "maybe"'},
    )
    assert r.choices[0].message.content in ("yes", "no", "maybe")


def test_compact_json_and_streamed_json(client, model):
    so = {"json": SCHEMA, "disable_any_whitespace": True}
    r = chat(client, model, seed=3, temperature=1.0, extra_body={"structured_outputs": so})
    text = r.choices[0].message.content
    assert " " not in text.replace(parse(text)["city"], "")
    stream = chat(
        client,
        model,
        seed=3,
        temperature=1.0,
        stream=True,
        extra_body={"structured_outputs": so},
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            },
            "invalid JSON schema",
        ),
        ({"guided_json": "{not json"}, "not valid JSON"),
        ({"guided_choice": []}, "choices"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "only one kind"),
        ({"guided_regex": "(unclosed"}, "regex cannot be compiled"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"logit_bias": {"99999": 5}}, "logit_bias"),
    ],
)
def test_bad_constraints_are_400_naming_the_problem(client, model, extra, needle):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, model, max_tokens=5, extra_body=extra)
    assert needle in str(err.value)


def test_logit_bias_forces_a_token(client, model):
    r = client.completions.create(
        model=model,
        prompt=[5, 6, 7],
        max_tokens=6,
        temperature=0,
        logit_bias={"71": 100},
    )
    assert r.choices[0].text == "e" * 6  # token 71 of the tiny byte-level vocabulary


def test_min_tokens_yields_to_a_grammar_that_has_ended(client, model):
    # The choice is complete after a few tokens; min_tokens asks for more. The grammar then
    # allows only the end, so the end wins (no 500, no token outside the grammar).
    out = client.completions.create(
        model=model,
        prompt="pick one",
        max_tokens=20,
        temperature=0,
        extra_body={"guided_choice": ["yes", "no"], "min_tokens": 15},
    ).choices[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
