"""Random schemas (devtools/schema_fuzz.py), random sentences of the engine's grammar for
each: every sentence is strict JSON that validates, or the schema is refused (a 400). The
same walk through xgrammar's own grammar finds invalid sentences, so the check can fail."""

from __future__ import annotations

import pytest

from devtools.schema_fuzz import Walker, engine_grammar, fuzz, xgrammar_as_is


@pytest.fixture(scope="module")
def walker(tiny_qwen3):
    from transformers import AutoTokenizer

    return Walker(AutoTokenizer.from_pretrained(tiny_qwen3), vocab_size=512)


@pytest.mark.parametrize("compact", [False, True])
def test_random_schemas_give_only_valid_json(walker, compact):
    tally = fuzz(walker, engine_grammar(compact), seed=11 + compact, schemas=300, walks=4)
    assert tally.sentences > 600 and tally.refused < tally.schemas / 2, tally
    assert not tally.bad, tally.bad[:3]


def test_the_same_walk_finds_xgrammar_s_own_grammar_invalid(walker):
    tally = fuzz(walker, xgrammar_as_is, seed=11, schemas=60, walks=4)
    assert tally.bad, "xgrammar as installed gave no invalid sentence: its defects may be fixed"
