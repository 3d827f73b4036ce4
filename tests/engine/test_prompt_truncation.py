"""`truncate_prompt_tokens`: the rules (pure), then one real `pdpool serve` whose context is
256 tokens: a truncated request answers exactly as the kept tokens sent alone."""

from __future__ import annotations

import httpx
import pytest

from devtools.engine_procs import spawned_engine
from pdpool.prompt_truncation import (
    TruncationError,
    cut_text,
    truncate_ids,
    truncation_tokens,
)

CONTEXT = 256


def test_how_many_tokens_a_request_keeps():
    assert truncation_tokens(None, CONTEXT) is None
    assert truncation_tokens(-1, CONTEXT) == CONTEXT - 1  # one token left to generate
    assert truncation_tokens(1, CONTEXT) == 1
    assert truncation_tokens(CONTEXT, CONTEXT) == CONTEXT
    for bad in (0, -2, CONTEXT + 1):
        with pytest.raises(TruncationError, match="truncate_prompt_tokens"):
            truncation_tokens(bad, CONTEXT)


def test_the_side_kept():
    ids = list(range(10))
    assert truncate_ids(ids, 3, "left") == [7, 8, 9]
    assert truncate_ids(ids, 3, "right") == [0, 1, 2]
    assert truncate_ids(ids, 10, "left") == ids and truncate_ids(ids, None, "left") == ids
    assert cut_text("abcdef", 4, "left") == "cdef" and cut_text("abcdef", 4, "right") == "abcd"
    assert cut_text("abc", 4, "left") == "abc"


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    with spawned_engine(
        tiny_qwen3, tmp_path_factory.mktemp("logs"), "--max-model-len", str(CONTEXT)
    ) as eng:
        yield eng


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def greedy(server, path: str, body: dict) -> tuple[str, int]:
    r = post(server, path, {"max_tokens": 6, "temperature": 0, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    return text, out["usage"]["prompt_tokens"]


@pytest.mark.slow
def test_a_truncated_prompt_answers_as_its_kept_tokens_alone(server):
    ids = [(7 * i) % 400 + 3 for i in range(120)]
    for side, kept in (("left", ids[-40:]), ("right", ids[:40])):
        extra = {} if side == "left" else {"truncation_side": side}
        got = greedy(
            server, "/v1/completions", {"prompt": ids, "truncate_prompt_tokens": 40, **extra}
        )
        assert got == greedy(server, "/v1/completions", {"prompt": kept}), side
        assert got[1] == 40
    text = " ".join(["river stone bright quiet"] * 30)
    whole = post(server, "/tokenize", {"prompt": text}).json()["tokens"]
    assert len(whole) > 50
    got = greedy(server, "/v1/completions", {"prompt": text, "truncate_prompt_tokens": 50})
    assert got == greedy(server, "/v1/completions", {"prompt": whole[-50:]})
    # Shorter than the truncation: untouched.
    assert (
        greedy(server, "/v1/completions", {"prompt": ids[:10], "truncate_prompt_tokens": 40})[1]
        == 10
    )


@pytest.mark.slow
def test_a_chat_is_truncated_after_its_template(server):
    messages = [
        {"role": "system", "content": " ".join(["market window seven garden"] * 20)},
        {"role": "user", "content": "why?"},
    ]
    rendered = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    assert len(rendered) > 60
    got = greedy(
        server, "/v1/chat/completions", {"messages": messages, "truncate_prompt_tokens": 60}
    )
    assert got[1] == 60
    assert got[0] == greedy(server, "/v1/completions", {"prompt": rendered[-60:]})[0]


@pytest.mark.slow
def test_minus_one_keeps_what_the_context_holds_and_a_long_text_is_not_refused(server):
    # Far more than the context holds, and more characters than the untruncated refusal
    # bound: kept to the context less one token, one token generated.
    text = "stone " * 20000
    r = post(
        server, "/v1/completions", {"prompt": text, "max_tokens": 1, "truncate_prompt_tokens": -1}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == CONTEXT - 1
    assert post(server, "/v1/completions", {"prompt": text, "max_tokens": 1}).status_code == 400


@pytest.mark.slow
@pytest.mark.parametrize(
    "fields",
    [
        {"truncate_prompt_tokens": CONTEXT + 1},
        {"truncate_prompt_tokens": 0},
        {"truncate_prompt_tokens": -2},
        {"truncate_prompt_tokens": "10"},
        {"truncate_prompt_tokens": 10.0},
        {"truncate_prompt_tokens": 10, "truncation_side": "middle"},
    ],
)
def test_bad_truncations_are_refused_by_name(server, fields):
    for path, body in (
        ("/v1/completions", {"prompt": "hello"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = post(server, path, {**body, **fields})
        assert r.status_code == 400, (path, fields, r.text)
        assert r.json()["error"]["param"] in fields, r.text
