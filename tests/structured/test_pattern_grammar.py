"""A schema's patterns in the engine's grammar (pattern_grammar.py): what xgrammar 0.2.9 gets
wrong, kept as minimal reproductions, and ours checked against Python's `re` on every short
string of random patterns."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
import xgrammar as xgr
from xgrammar.testing import _get_matcher_from_grammar
from xgrammar.testing import _is_grammar_accept_string as accepts

from pdpool.engine.structured.json_grammar import schema_grammar
from pdpool.engine.structured.pattern_grammar import pattern_ebnf
from pdpool.engine.structured.schema_support import SchemaUnsupported, check_supported


def string_schema(pattern: str) -> str:
    return json.dumps({"type": "string", "pattern": pattern})


def as_json(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


def test_upstream_defect_xgrammar_pattern_with_an_optional_repeated_group():
    """When this fails, xgrammar's Regex automaton is fixed (and so is vLLM's, which uses it)."""
    upstream = xgr.Grammar.from_json_schema(string_schema("^(ba+)?$"))
    assert accepts(upstream, '"a"') and not re.search("^(ba+)?$", "a")
    numbers = xgr.Grammar.from_json_schema(string_schema(r"^\d{1,3}(\.\d+)?$"))
    assert accepts(numbers, '"12345"')
    # its regex-to-EBNF converter (xgr.Grammar.from_regex) has it right
    assert not accepts(xgr.Grammar.from_regex("^(ba+)?$"), "a")


def test_upstream_defect_xgrammar_pattern_writes_quotes_and_controls_raw():
    assert accepts(xgr.Grammar.from_json_schema(string_schema('a"b')), '"a"b"')
    assert accepts(xgr.Grammar.from_json_schema(string_schema("^\\n$")), '"\n"')


def test_upstream_defect_xgrammar_reads_back_its_own_byte_escape_wrong():
    """Its printer writes é as \\xe9; its parser reads "\\xe92" as U+0E92."""
    assert accepts(xgr.Grammar.from_ebnf('root ::= "\\xe92"'), "\u0e92")
    key = {"type": "object", "properties": {"é1": {"type": "string", "maxLength": 1}}}
    key["required"] = ["é1"]
    ours = schema_grammar(json.dumps(key), compact=True)
    assert accepts(ours, '{"é1":"x"}') and not accepts(ours, '{"\u0e91":"x"}')


@pytest.mark.parametrize(
    ("pattern", "good", "bad"),
    [
        ("^(ba+)?$", ["", "ba", "baaa"], ["a", "b", "bab"]),
        (r"^\d{1,3}(\.\d+)?$", ["1", "123", "1.25"], ["12345", "1.", ".5"]),
        ('a"b', ['a"b'], ["ab"]),
        (r"^a\\b$", ["a\\b"], ["ab", "a\\\\b"]),
        ('^[^"]{0,2}$', ["", "\\x", "é"], ['"', "abc"]),
        ("^.{1,3}$", ["é😀", "a b"], ["", "a\nb", "abcd", "a\u2028"]),
        (r"^\w+@\w+\.com$", ["a@b.com"], ["a@bxcom", "é@b.com"]),
        (r"^\S\D\W$", ["xy!"], ["x1!", "xy_", "\u00a0y!", "x\u0661!"]),
        ("^(?:ab|c)+d?$", ["abcd", "c"], ["d", "abd" + "x"]),
        ("x", ["x"], ["", "y"]),
    ],
)
def test_ours_accepts_what_the_pattern_matches_and_nothing_it_does_not(pattern, good, bad):
    grammar = schema_grammar(string_schema(pattern), compact=True)
    for value in good:
        assert re.search(pattern, value) and accepts(grammar, as_json(value)), value
    for value in bad:
        assert not accepts(grammar, as_json(value)), value
    # a raw control character or an unescaped quote never gets in
    assert not accepts(grammar, '"a\x0fb"') and not accepts(grammar, '"""')


@pytest.mark.parametrize(
    ("pattern", "needle"),
    [
        ("(?i)abc", "flags"),
        ("(?i:a)b", "flags"),
        ("a(?=b)", "look-arounds"),
        ("(?<!a)b", "negative look-arounds"),
        (r"(a)\1", "back-references"),
        (r"a\bb", "anchors"),
        ("^a^b", "anchors"),
        ("[", "cannot be parsed"),
        ("a{2,1}", "cannot be parsed"),
        ("^a{2,4294967294}$", "repetition bound above"),
        ("^\\n+$", "matches no string"),
        ("^[\\x00-\\x1f]$", "matches no string"),
    ],
)
def test_patterns_without_a_grammar_are_refused_naming_why(pattern, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        schema_grammar(string_schema(pattern), compact=False)


def test_pattern_properties_and_property_names_use_our_grammar():
    keyed = {"type": "object", "patternProperties": {"^(ba+)?$": {"type": "integer"}}}
    grammar = schema_grammar(json.dumps(keyed), compact=True)
    assert accepts(grammar, '{"baa":1}') and not accepts(grammar, '{"a":1}')
    named = {"type": "object", "propertyNames": {"pattern": '^x"$'}}
    grammar = schema_grammar(json.dumps(named), compact=True)
    assert accepts(grammar, '{"x\\"":true}') and not accepts(grammar, '{"x"":true}')
    # a property named "pattern" is a property, not the keyword
    plain = {"type": "object", "properties": {"pattern": {"const": "(a"}}, "required": ["pattern"]}
    assert accepts(schema_grammar(json.dumps(plain), compact=True), '{"pattern":"(a"}')


def random_pattern(rng: random.Random, depth: int = 0) -> str:
    atoms = ["a", "b", '"', r"\\", ".", "[ab]", "[^a]", r"\d", r"\w", r"\s", r"\S", r"\W", "é"]
    if depth < 2:
        atoms += ["(" + random_pattern(rng, depth + 1) + ")"] * 3
        atoms += ["(" + random_pattern(rng, depth + 1) + "|" + random_pattern(rng, depth + 1) + ")"]
    items = []
    for _ in range(rng.randint(1, 3)):
        items.append(rng.choice(atoms) + rng.choice(["", "", "?", "*", "+", "{1,2}", "{2}"]))
    return "".join(items)


def test_random_patterns_accept_only_strings_re_matches_and_every_plain_one_it_does():
    """Sound on every string up to 3 characters from an alphabet with a quote, a backslash,
    a digit, blanks and a non-ASCII letter; complete on those of a, b and 1 (where Python's
    and ECMA-262's readings agree)."""
    rng = random.Random(5)
    alphabet = ["a", "b", "1", '"', "\\", " ", "\n", "é", "_"]
    strings = ["".join(p) for n in range(4) for p in itertools.product(alphabet, repeat=n)]
    checked = 0
    for _ in range(60):
        pattern = random_pattern(rng)
        try:
            matcher = _get_matcher_from_grammar(schema_grammar(string_schema(pattern), True))
        except ValueError:
            continue  # nothing this grammar can write matches it
        for value in strings:
            matcher.reset()
            taken = matcher.accept_string(as_json(value)) and matcher.is_terminated()
            matched = re.fullmatch(pattern, value) is not None
            assert not taken or matched, (pattern, value)
            if set(value) <= {"a", "b", "1"}:
                assert taken == matched, (pattern, value)
        checked += 1
    assert checked > 40


def test_pattern_ebnf_is_one_expression():
    assert pattern_ebnf("^(ba+)?$") == "(([\\u0062] ([\\u0061])+))?"


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer", "maximum": 10, "multipleOf": 2},
        {"type": "integer", "exclusiveMinimum": 0, "multipleOf": 3},
        {"type": "integer", "multipleOf": 2.5},
        {"type": "integer", "multipleOf": 0.5},
        {"type": "number", "multipleOf": 2},
        {"type": "object", "additionalProperties": {"type": "string"}, "minProperties": 2},
        {"type": "object", "patternProperties": {"^a": {}}, "minProperties": 1},
        {"type": "object", "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
        {"type": "object", "properties": {"a": {}}, "anyOf": [{"required": ["a"]}]},
        {"type": "string", "maxLength": 2, "allOf": [{"pattern": "^a+$"}]},
        {"$ref": "#/$defs/s", "maxLength": 2, "$defs": {"s": {"type": "string"}}},
        {"type": "string", "enum": ["abc", "x"], "maxLength": 2},
        {"type": "string", "enum": ["a", 1]},
        {"type": "integer", "const": 1.5},
    ],
)
def test_keywords_xgrammar_drops_are_refused(schema):
    """multipleOf is dropped beside a bound or when not whole; a key from
    additional/pattern properties may repeat, which JSON reads as one; beside anyOf, oneOf,
    allOf, $ref, enum or const, xgrammar reads no other constraint (type included); it
    requires no property that `properties` does not name."""
    with pytest.raises(SchemaUnsupported):
        check_supported(schema)


def test_an_untyped_schema_is_held_to_the_type_its_keywords_are_about():
    """xgrammar ignores `pattern`, `maxLength`, `minimum` ... on a schema without `type`."""
    for schema, good, bad in (
        ({"pattern": "^a$"}, '"a"', '"b"'),
        ({"maxLength": 1}, '"a"', '"ab"'),
        ({"minimum": 5}, "7", "1"),
        ({"type": "object", "properties": {"x": {"maxLength": 1}}}, '{"x":"a"}', '{"x":"ab"}'),
    ):
        assert accepts(xgr.Grammar.from_json_schema(json.dumps(schema)), bad)
        ours = schema_grammar(json.dumps(schema), compact=True)
        assert accepts(ours, good) and not accepts(ours, bad), schema


def test_keywords_the_grammar_keeps_still_pass():
    for schema in (
        {"type": "integer", "multipleOf": 3},
        {"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"],
         "additionalProperties": True, "minProperties": 2},
        {"type": "object", "properties": {"a": {}, "b": {}}, "minProperties": 1},
        {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "x"},
        {"type": "integer", "enum": [1, 2.0], "description": "whole numbers"},
        {"$ref": "#/$defs/s", "$defs": {"s": {"type": "string"}}, "title": "s"},
    ):  # fmt: skip
        check_supported(schema)
