"""The incremental detokenizer gives the same stream of text whether it decodes through the
HF tokenizer or straight through its Rust backend (the engine's choice when equivalent)."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from pdpool.engine.detokenizer import IncrementalDetokenizer, fast_decoder


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    return AutoTokenizer.from_pretrained(str(tiny_qwen3))


def _stream(tokenizer, prompt, outputs, backend):
    detok = IncrementalDetokenizer(tokenizer, prompt, backend=backend)
    return [detok.add_token(t) for t in outputs], detok.text


def test_backend_decoding_streams_the_same_text(tokenizer):
    backend = fast_decoder(tokenizer)
    assert backend is not None  # a fast tokenizer without clean-up: the engine uses it
    rng = random.Random(0)
    for _ in range(50):
        prompt = [rng.randrange(0, tokenizer.vocab_size) for _ in range(rng.randint(1, 20))]
        outputs = [rng.randrange(0, tokenizer.vocab_size) for _ in range(40)]
        assert _stream(tokenizer, prompt, outputs, backend) == _stream(
            tokenizer, prompt, outputs, None
        )


def test_no_backend_when_the_tokenizer_cleans_up_spaces(tokenizer):
    class CleaningUp:
        _tokenizer = tokenizer._tokenizer
        clean_up_tokenization_spaces = True

    assert fast_decoder(CleaningUp()) is None
    assert fast_decoder(object()) is None
