"""Completions' echo as the answer's texts take it (engine/server/echo.py); served on a real
engine in test_vllm_fields.py and beside vLLM in tests/vllm."""

import pytest

from pdpool.engine.server import echo as echo_module
from pdpool.engine.server.echo import EchoTooLarge, prompt_echo


def decode(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i) for i in ids)


def test_each_choice_gets_its_prompt_once_before_its_text():
    echo = prompt_echo(["x", [1, 2]], n=2, max_tokens=4, with_token_ids=False, decode=decode)
    assert [echo.whole(i, "!") for i in range(4)] == ["x!", "x!", "bc!", "bc!"]
    assert [echo.delta(3, t)[0] for t in ("1", "2")] == ["bc1", "2"]
    assert [echo.delta(0, t)[0] for t in ("", "3")] == ["x", "3"]


def test_max_tokens_0_shows_the_prompt_alone():
    echo = prompt_echo(["x"], n=1, max_tokens=0, with_token_ids=False, decode=decode)
    assert echo.whole(0, "made") == "x"
    assert [echo.delta(0, "made")[0], echo.delta(0, "more")[0]] == ["x", ""]


def test_with_token_ids_the_prompt_text_is_not_repeated():
    echo = prompt_echo([[0]], n=1, max_tokens=2, with_token_ids=True, decode=decode)
    assert echo.whole(0, "t") == "t" and echo.delta(0, "t")[0] == "t"


def test_an_echo_repeated_past_the_bound_is_refused(monkeypatch):
    monkeypatch.setattr(echo_module, "MAX_ECHO_BYTES", 10)
    prompt_echo(["abcde"], n=2, max_tokens=1, with_token_ids=False, decode=decode)  # 10: at it
    with pytest.raises(EchoTooLarge, match="11 bytes"):
        prompt_echo(["abcdefg", "éé"], n=1, max_tokens=1, with_token_ids=False, decode=lambda _: "")
    with pytest.raises(EchoTooLarge):
        prompt_echo(["abcd", "ef"], n=2, max_tokens=1, with_token_ids=False, decode=decode)
    # what return_token_ids leaves out is not repeated
    prompt_echo(["x" * 100], n=2, max_tokens=1, with_token_ids=True, decode=decode)
