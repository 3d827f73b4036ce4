"""The structured-output caps (engine/structured/limits.py and the HTTP checks that use
them): each names its flag, none recurses, and the defaults let realistic specs through;
logit_bias is capped at OpenAI's 300 entries and applied from per-request tensors; the
compiled-grammar cache is bounded."""

from __future__ import annotations

import json

import pytest

from pdpool.engine.sampling_params import SamplingParams
from pdpool.engine.server.structured_request import check_json_schema, constrain
from pdpool.engine.structured.limits import (
    SpecTooLarge,
    StructuredLimits,
    check_choices,
    check_schema,
)
from pdpool.protocol import RequestError
from tests.support.hostile_specs import choices, deep_schema_text, wide_schema


@pytest.mark.parametrize(
    "schema, flag",
    [
        (wide_schema(2001), "--structured-max-properties"),
        ({"enum": list(range(1001))}, "--structured-max-enum-values"),
        ({"type": "string", "pattern": "a" * 4097}, "--structured-max-pattern-chars"),
        (json.loads(deep_schema_text(20)), "--structured-max-depth"),
    ],
)
def test_each_cap_names_its_flag(schema, flag):
    with pytest.raises(SpecTooLarge, match=flag):
        check_schema(schema, StructuredLimits())


def test_choices_are_capped_in_count_and_bytes():
    with pytest.raises(SpecTooLarge, match="--structured-max-choices"):
        check_choices(choices(1001), StructuredLimits())
    with pytest.raises(SpecTooLarge, match="--structured-max-bytes"):
        check_choices(["x" * 300_000], StructuredLimits())
    check_choices(choices(1000), StructuredLimits())


def test_a_realistic_schema_passes_the_defaults():
    item = {
        "type": "object",
        "properties": {
            # (a length and a pattern on one string are refused: xgrammar would drop the length)
            "name": {"type": "string", "maxLength": 80},
            "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            },
        },
    }
    schema = {
        "type": "object",
        "properties": {f"field_{i}": item for i in range(100)},
        "$defs": {"item": item},
    }
    assert check_json_schema(schema, "guided_json") == schema


def test_nesting_thousands_deep_in_a_string_is_400_not_a_recursion_error():
    text = '{"type": "object", "properties": {"a": ' * 5000 + "{}" + "}}" * 5000
    with pytest.raises(RequestError, match=r"--structured-max-depth|too deeply"):
        check_json_schema(text, "guided_json")


def test_logit_bias_is_capped_at_300_entries():
    extras = {"logit_bias": {str(t): 1.0 for t in range(301)}}
    with pytest.raises(RequestError, match="at most 300"):
        constrain(SamplingParams(), extras, 1000, None)
    with pytest.raises(ValueError, match="at most 300"):
        SamplingParams(logit_bias={t: 1.0 for t in range(301)}).validate(1000)


def test_logit_bias_tensors_are_built_once_per_request():
    torch = pytest.importorskip("torch")
    from pdpool.engine.structured.logits import LogitBiases

    biases = LogitBiases()
    bias = {3: 5.0, 7: -2.0}
    logits = torch.zeros(2, 10)
    biases.apply(logits, ["r1", "r2"], [bias, None])
    assert logits[0, 3] == 5.0 and logits[0, 7] == -2.0 and logits[1].abs().sum() == 0
    built = biases._tensors("r1", bias, logits)
    again = torch.zeros(1, 10)
    biases.apply(again, ["r1"], [bias])
    assert biases._tensors("r1", bias, again)[0] is built[0]  # reused, not rebuilt
    biases.forget("r1")
    assert biases._tensors("r1", bias, again)[0] is not built[0]


def test_the_compiled_grammar_cache_is_bounded(tiny_qwen3):
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from pdpool.engine.config import EngineConfig
    from pdpool.engine.structured.grammar import GrammarCompiler
    from pdpool.engine.structured.spec import GuidedSpec, choice_grammar

    assert EngineConfig(model="x").structured_cache_bytes > 0
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    limit = 1 << 20
    compiler = GrammarCompiler(tokenizer, 512, cache_limit_bytes=limit)
    for i in range(40):  # ~1.4 MB of grammars unbounded
        compiler.compile(GuidedSpec("grammar", choice_grammar([f"g{i}-{j}" for j in range(200)])))
    assert 0 < compiler.cache_size_bytes() <= limit
    assert GrammarCompiler(tokenizer, 512)._get().cache_limit_bytes > 0
