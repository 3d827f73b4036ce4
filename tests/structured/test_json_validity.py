"""Every guided JSON output is RFC 8259 JSON (strict json.loads) that validates against its
schema: on a real `pdpool serve` of the tiny random model (whose unguided output is byte
gibberish, control characters included), at temperature 1 and greedy, for each kind of
schema in devtools/json_schemas.py; tool_choice required and named always give tool calls.
Also the upstream xgrammar defect that the engine corrects (json_grammar.py), asserted as it
stands so that this suite says when upstream fixes it."""

from __future__ import annotations

import json

import httpx
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from devtools.json_schemas import SCHEMAS, TOOLS, calls_valid, strictly_valid
from pdpool.engine.structured.json_grammar import MAX_WHITESPACE, schema_grammar

LENGTH = json.dumps({"type": "string", "maxLength": 5})
POINTER = json.dumps({"type": "string", "format": "json-pointer"})


def xgrammar_version() -> tuple[int, ...]:
    from importlib.metadata import version

    return tuple(int(p) for p in version("xgrammar").split(".")[:3] if p.isdigit())


def test_upstream_defect_xgrammar_length_string_admits_control_characters():
    """Documents xgrammar's defect (0.2.8, vLLM 0.32's, and 0.2.9 alike). When this fails,
    upstream has fixed its string rules: json_grammar.py's corrections can go."""
    length = xgr.Grammar.from_json_schema(LENGTH)
    assert accepts(length, '"a\x0fb"') and accepts(length, '"a\x1bb"')
    assert not accepts(length, '"a\\nb"')  # and a valid escape is refused
    assert not accepts(xgr.Grammar.from_json_schema('{"type": "string"}'), '"a\x0fb"')


def test_upstream_json_pointer_rule_as_the_installed_xgrammar_has_it():
    """0.2.8's json-pointer rule let control characters and a raw `"` into the string;
    0.2.9 fixed it (escapes allowed, raw controls refused), and json_grammar.py then leaves
    it alone."""
    pointer = xgr.Grammar.from_json_schema(POINTER)
    defective = accepts(pointer, '"/a\x0fb"') and accepts(pointer, '"/a"b"')
    assert defective == (xgrammar_version() < (0, 2, 9)), xgrammar_version()


def test_corrected_string_rules_are_json_within_their_bounds():
    length = schema_grammar(LENGTH, compact=False)
    for good in ('""', '"abcde"', '"a\\nb"', '"\\u00e9\\"\\\\"', '"é€😀"'):
        assert accepts(length, good), good
    for bad in ('"a\x0fb"', '"a\x1b"', '"a\tb"', '"abcdef"', '"a\\x"', '"\\ud83d\\ude00"'):
        assert not accepts(length, bad), bad
    bounded = schema_grammar('{"type": "string", "minLength": 2, "maxLength": 3}', False)
    assert accepts(bounded, '"a\\t"') and not accepts(bounded, '"a"')
    pointer = schema_grammar(POINTER, compact=False)
    assert accepts(pointer, '"/a~1b/c"') and accepts(pointer, '"/a[b]"')
    for bad in ('"/a\x0fb"', '"/a"b"', '"/a\\x"'):
        assert not accepts(pointer, bad), bad


def byte_matcher(tiny_qwen3, grammar):
    """A matcher on the tiny checkpoint's byte-level vocabulary, and its one-byte tokens."""
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(tiny_qwen3), vocab_size=512
    )
    single = {v[0]: i for i, v in enumerate(info.decoded_vocab) if len(v) == 1}
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar)), single


def accepts_bytes(tiny_qwen3, grammar, data: bytes) -> bool:
    matcher, single = byte_matcher(tiny_qwen3, grammar)
    return all(matcher.accept_token(single[b]) for b in data) and matcher.is_completed()


def test_upstream_defect_xgrammar_takes_an_encoded_surrogate_for_a_character(tiny_qwen3):
    """ED A0 80 (U+D800's bytes, not UTF-8) decodes to three U+FFFD: one character for the
    grammar, three for JSON Schema. Upstream in every string rule; corrected in ours with a
    length; a pattern's regex keeps it, and the engine's UTF-8 guard masks it (below)."""
    surrogate = b'"\xed\xa0\x80"'
    assert accepts_bytes(tiny_qwen3, xgr.Grammar.from_json_schema(LENGTH), surrogate)
    pattern = xgr.Grammar.from_json_schema('{"type": "string", "pattern": "^.{1,3}$"}')
    assert accepts_bytes(tiny_qwen3, pattern, surrogate)
    ours = schema_grammar(LENGTH, compact=True)
    assert not accepts_bytes(tiny_qwen3, ours, surrogate)
    assert accepts_bytes(tiny_qwen3, ours, '"\u16fe"'.encode())  # a 3-byte character


def test_utf8_guard_follows_unicode_table_3_7():
    from pdpool.engine.structured.utf8_guard import INVALID, START, advance

    for good in ("a", "é", "€", "😀", "\U0010ffff", "\ud7ff", "\ue000"):
        assert advance(START, good.encode()) == START, good
    for bad in (b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xc0\xaf", b"\xe0\x80\x80",
                b"\xf0\x80\x80\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xf5"):  # fmt: skip
        assert advance(START, bad) == INVALID, bad
    assert advance(START, b"\xed") not in (START, INVALID)  # a character begun
    assert advance(advance(START, b"\xed"), b"\x9f\xbf") == START


def test_pattern_grammar_with_the_guard_never_writes_a_surrogate(tiny_qwen3):
    """xgrammar's pattern `.` takes ED A0 80 for a character (the upstream defect above);
    with the guard's mask after the grammar's, a string that began ED may go on with 80-9F
    (U+D000-U+D7FF) but not with A0-BF (a surrogate): what made seed 45 (greedy) and 84
    (t=1) of benchmarks/structured_validity.py's pattern schema invalid."""
    import torch

    from pdpool.engine.structured.utf8_guard import Utf8Guard

    grammar = xgr.Grammar.from_json_schema('{"type": "string", "pattern": "^.{1,3}$"}')
    matcher, single = byte_matcher(tiny_qwen3, grammar)
    info = xgr.TokenizerInfo.from_huggingface(
        __import__("transformers").AutoTokenizer.from_pretrained(tiny_qwen3), vocab_size=512
    )
    guard = Utf8Guard(info.decoded_vocab, 512)
    state = 0
    for b in b'"\xed':
        assert matcher.accept_token(single[b])
        state = guard.next_state(state, single[b])
    logits = torch.zeros(1, 512)
    bitmask = xgr.allocate_token_bitmask(1, 512)
    matcher.fill_next_token_bitmask(bitmask)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    assert logits[0, single[0xA0]] == 0  # the grammar alone allows the surrogate's byte
    guard.mask(logits, 0, state)
    allowed = {b for b, t in single.items() if logits[0, t] == 0}
    assert allowed and allowed <= set(range(0x80, 0xA0)), sorted(allowed)


@pytest.mark.parametrize("seed,temperature", [(45, 0.0), (84, 1.0)])
def test_pattern_outputs_that_wrote_a_surrogate_now_validate(client, model, seed, temperature):
    """The benchmark's two invalid answers before the guard (U+FFFD x3 in `any`)."""
    schema = SCHEMAS["pattern"]
    r = client.chat.completions.create(
        model=model,
        messages=ask(seed),
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "pattern", "schema": schema},
        },
        temperature=temperature,
        seed=seed,
        max_tokens=400,
    ).choices[0]
    assert r.finish_reason == "stop" and "\ufffd" not in r.message.content, r.message.content
    assert strictly_valid(r.message.content, schema), r.message.content


def test_free_whitespace_is_bounded():
    grammar = schema_grammar('{"type": "object"}', compact=False)
    assert accepts(grammar, "{" + " " * MAX_WHITESPACE + "}")
    assert not accepts(grammar, "{" + " " * (MAX_WHITESPACE + 1) + "}")


def ask(seed: int) -> list[dict]:
    # the seed in the prompt: greedy outputs differ per seed too
    return [{"role": "user", "content": f"record {seed} as JSON"}]


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_json_schema_outputs_parse_strictly_and_validate(client, model, kind, temperature):
    # response_format: free whitespace, as vLLM's default (bounded: json_grammar.py)
    rf = {"type": "json_schema", "json_schema": {"name": kind, "schema": SCHEMAS[kind]}}
    for seed in range(3):
        r = client.chat.completions.create(
            model=model,
            messages=ask(seed),
            response_format=rf,
            temperature=temperature,
            seed=seed,
            n=2,  # seeds seed, seed + 1 (distinct prompts keep greedy runs apart)
            max_tokens=400,
        )
        for c in r.choices:
            text = c.message.content
            assert c.finish_reason == "stop", (kind, seed, text)
            assert strictly_valid(text, SCHEMAS[kind]), (kind, seed, text)


def test_json_object_outputs_parse_strictly(client, model):
    # Any object: its keys and strings have no bound, so a random model may write one until
    # max_tokens; whatever ends is strict JSON.
    ended = 0
    for seed in range(4):
        r = client.chat.completions.create(
            model=model,
            messages=ask(seed),
            response_format={"type": "json_object"},
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        ).choices[0]
        assert r.finish_reason in ("stop", "length")
        if r.finish_reason == "stop":
            assert isinstance(json.loads(r.message.content), dict), r.message.content
            ended += 1
    assert ended


def test_schema_keywords_the_grammar_ignores_are_400(server, model):
    for schema, needle in (
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength"),
        ({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0.5}}}, "/n"),
        ({"allOf": [{"type": "string"}, {"enum": ["yes", "no"]}]}, "allOf"),
        ({"type": "integer", "maximum": 10, "multipleOf": 2}, "multipleOf"),
        ({"type": "string", "pattern": "^a(?=b)"}, "look-arounds"),
        ({"type": "string", "pattern": "^\\n$"}, "matches no string"),
    ):
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        r = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"model": model, "messages": ask(0), "response_format": rf},
            timeout=60,
        )
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def tool_choices():
    return [
        ("required", "required"),
        ("named", {"type": "function", "function": {"name": "locate"}}),
    ]


@pytest.mark.parametrize(("label", "choice"), tool_choices())
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_forced_tool_calls_always_parse(client, model, label, choice, temperature):
    # named answers "stop" with its call, as OpenAI and vLLM do
    reason = "tool_calls" if label == "required" else "stop"
    for seed in range(4):
        r = client.chat.completions.create(
            model=model,
            messages=ask(seed),
            tools=TOOLS,
            tool_choice=choice,
            temperature=temperature,
            seed=seed,
            max_tokens=400,
        ).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in r.message.tool_calls]
        assert calls_valid(calls), (seed, r.message)
        assert r.finish_reason == reason


def streamed(client, model, **kw):
    calls: dict[int, list[str]] = {}
    content, reason = "", None
    for chunk in client.chat.completions.create(model=model, tools=TOOLS, stream=True, **kw):
        for ch in chunk.choices:
            reason = ch.finish_reason or reason
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                call = calls.setdefault(d.index, ["", ""])
                call[0] += (d.function.name or "") if d.function else ""
                call[1] += (d.function.arguments or "") if d.function else ""
    return [tuple(calls[i]) for i in sorted(calls)], content, reason


@pytest.mark.parametrize(("label", "choice"), tool_choices())
def test_streamed_forced_tool_calls_always_parse(client, model, label, choice):
    for seed in range(3):
        calls, content, reason = streamed(
            client,
            model,
            messages=ask(seed),
            tool_choice=choice,
            temperature=1.0,
            seed=seed,
            max_tokens=400,
        )
        assert calls_valid(calls), (seed, calls, content)
        assert reason == ("tool_calls" if label == "required" else "stop")


def test_a_cut_required_call_is_content_with_reason_length(client, model):
    """The array cut by max_tokens does not parse: its text is the answer, never
    finish_reason "tool_calls" with no calls; streamed alike."""
    kw = {"messages": ask(0), "tool_choice": "required", "temperature": 0, "max_tokens": 5}
    whole = client.chat.completions.create(model=model, tools=TOOLS, **kw).choices[0]
    assert whole.finish_reason == "length" and not whole.message.tool_calls
    assert whole.message.content
    calls, content, reason = streamed(client, model, **kw)
    assert (calls, content, reason) == ([], whole.message.content, "length")
