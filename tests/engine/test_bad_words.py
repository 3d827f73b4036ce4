"""vLLM's bad_words: the token sequences a request's words become (vLLM's rule, on the tiny
checkpoint's tokenizer), and the tokens banned at a step from the output so far."""

from __future__ import annotations

import pytest
import torch

from pdpool.engine.bad_words import MAX_BAD_WORD_SEQUENCES, banned, token_sequences
from pdpool.engine.sampling import Sampler
from pdpool.engine.sampling_params import SamplingParams


def test_a_one_token_word_is_always_banned_a_longer_one_only_after_its_start():
    seqs = [[7], [3, 4, 5]]
    assert banned(seqs, []) == [7]
    assert banned(seqs, [3]) == [7]  # too short for the tail of [3, 4, 5]
    assert banned(seqs, [1, 3, 4]) == [7, 5]
    assert banned(seqs, [3, 4, 1]) == [7]
    assert banned([[2, 2]], [2]) == [2]


def test_words_become_vllm_sequences_with_and_without_a_space(tiny_qwen3):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)

    def encode(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    vocab = len(tok)
    seqs = token_sequences(["hello", " hello", "world peace"], encode, vocab)
    plain, spaced = encode("hello"), encode(" hello")
    assert seqs[0] == plain  # a leading space is stripped first: " hello" repeats "hello"
    if spaced[0] != plain[0] and len(spaced) == len(plain):
        assert seqs[1] == spaced
    assert encode("world peace") in seqs
    assert all(0 <= t < vocab for seq in seqs for t in seq)


@pytest.mark.parametrize(
    "words,message",
    [
        ([""], "empty string"),
        (["   "], "tokenizes to no token"),
        ([f"w{i}" for i in range(MAX_BAD_WORD_SEQUENCES + 1)], "at most 128 token sequences"),
        (["big"], "outside the vocabulary"),
    ],
)
def test_bad_words_that_cannot_be_served_are_refused(words, message):
    def encode(text: str) -> list[int]:
        return [10_000] if "big" in text else [ord(c) for c in text.strip()]

    with pytest.raises(ValueError, match=message):
        token_sequences(words, encode, vocab_size=1000)


def test_the_sampler_bans_each_rows_words_from_its_own_output():
    logits = torch.zeros(2, 10)
    logits[:, 5] = 10.0  # both rows would pick 5
    params = [
        SamplingParams(temperature=0, bad_words_token_ids=[[1, 5]]),
        SamplingParams(temperature=0, bad_words_token_ids=[[2, 5]]),
    ]
    params[0].validate(10)
    histories = [([9, 9], [3, 1]), ([9, 9], [3, 1])]  # both outputs end with 1
    result = Sampler().sample(logits, ["a", "b"], params, [None, None], histories)
    assert result.tokens[0] != 5 and result.tokens[1] == 5


def test_sampling_params_hold_bad_words_to_the_vocabulary():
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words_token_ids=[[1, 99]]).validate(50)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words_token_ids=[[]]).validate(50)
