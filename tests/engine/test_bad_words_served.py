"""bad_words on a real `pdpool serve`: a banned word of the greedy answer is gone from it
(completions and chat, streamed and not), malformed or oversized lists are a 400 naming
bad_words, and the longest lists the caps allow are served. Token-exact parity with vLLM is
in tests/vllm/test_vllm_engine.py."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from devtools.engine_procs import spawned_engine

# Starts engine processes: the full run's tier, not the fast one.
pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog and then runs far away into the forest"


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    with spawned_engine(tiny_qwen3, tmp_path_factory.mktemp("logs")) as eng:
        yield eng


def greedy(url: str, chat: bool, stream: bool = False, **fields) -> tuple[str, list[int]]:
    """The greedy answer's text and token ids."""
    body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": PROMPT}]
    else:
        path, body["prompt"] = "/v1/completions", PROMPT
    body.update(fields, stream=stream)
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    text, ids = "", []
    for choice in [c for e in events for c in e["choices"]] if stream else r.json()["choices"]:
        piece = choice.get("text") or (choice.get("delta") or choice.get("message") or {})
        text += piece if isinstance(piece, str) else (piece.get("content") or "")
        ids += choice.get("token_ids") or []
    return text, ids


def one_token_word(tokenizer, ids: list[int]) -> tuple[int, str]:
    """A token of the answer (after its first) that is a word of its own, and that word."""
    for token in ids[1:]:
        word = tokenizer.decode([token])
        if (
            word.strip() == word
            and word
            and tokenizer(word, add_special_tokens=False)["input_ids"] == [token]
        ):
            return token, word
    raise AssertionError(f"no one-token word in {ids}")


@pytest.mark.parametrize("chat", [False, True])
def test_a_banned_word_leaves_the_greedy_answer(server, tiny_qwen3, chat):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    text, ids = greedy(server.url, chat)
    token, word = one_token_word(tokenizer, ids)
    for stream in (False, True):
        banned_text, banned_ids = greedy(server.url, chat, stream, bad_words=[word])
        assert token not in banned_ids and banned_text != text
        # up to the word's first place the answer is the same
        first = ids.index(token)
        assert banned_ids[:first] == ids[:first], stream


@pytest.mark.parametrize(
    "bad_words,message",
    [
        ([""], "String should have at least 1 character"),
        (["   "], "tokenizes to no token"),
        ([f"word{i}" for i in range(129)], "at most 128 token sequences"),
        (["w"] * 1025, "at most 1024 items"),
        (["x" * 1025], "at most 1024 characters"),
        ([7], "valid string"),
        ("word", "valid list"),
        ([["nested"]], "valid string"),
    ],
)
def test_bad_words_that_cannot_be_served_are_a_400_naming_the_field(server, bad_words, message):
    body = {"prompt": "x", "max_tokens": 2, "bad_words": bad_words}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] and error["param"].startswith("bad_words"), error
    assert message in error["message"], error


def test_the_longest_lists_are_served_and_the_engine_stays_whole(server):
    rng = random.Random(7)
    words = ["".join(chr(rng.randint(0x21, 0x2FFF)) for _ in range(1024)) for _ in range(64)]
    words += words * 15  # repeats count once, as in vLLM
    body = {"prompt": PROMPT, "max_tokens": 8, "bad_words": words}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    text, _ = greedy(server.url, False)
    assert text  # the next request is served as before
