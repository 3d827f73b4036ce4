"""The text logprobs show for a byte-level piece of a character split over several tokens:
"" until the piece that completes the character, which shows it whole (vLLM's reading),
never a lone replacement character."""

from __future__ import annotations

import pytest

from pdpool.engine.outputs import TokenLogprob
from pdpool.engine.server.logprobs import (
    TokenText,
    chat_formatter,
    completed_character,
    completion_formatter,
)
from pdpool.engine.server.text_tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    return TextTokenizer(tiny_qwen3)


def test_a_split_character_shows_on_the_piece_that_completes_it(tokenizer):
    decode = tokenizer.decode
    e1, e2 = tokenizer.encode("é", add_special_tokens=False)  # two byte pieces
    assert decode([e1]) == decode([e2]) == "\ufffd"
    assert completed_character(decode, e1, []) == ""
    assert completed_character(decode, e2, [e1]) == "é"
    a = tokenizer.encode("a", add_special_tokens=False)
    assert completed_character(decode, e2, [*a, e1]) == "é"  # the clean "a" is not repeated
    smile = tokenizer.encode("😀", add_special_tokens=False)  # four pieces
    shown = [completed_character(decode, t, smile[:i]) for i, t in enumerate(smile)]
    assert shown == ["", "", "", "😀"]


def test_formatters_read_each_piece_after_the_sampled_ones(tokenizer):
    ids = tokenizer.encode("aé", add_special_tokens=False)
    lps = [TokenLogprob(i, -0.5, [(i, -0.5)]) for i in ids]
    text_of = TokenText(tokenizer)
    completion = completion_formatter(text_of)
    first, rest = completion(lps[:2]), completion(lps[2:])  # streamed: state carries over
    tokens = first["tokens"] + rest["tokens"]
    assert "".join(tokens) == "aé" and "\ufffd" not in tokens
    assert rest["text_offset"] == [len("a")]
    chat = chat_formatter(text_of)(lps)["content"]
    assert [c["token"] for c in chat] == tokens
    assert chat[-1]["bytes"] == list("é".encode()) and chat[-1]["top_logprobs"][0]["token"] == "é"
