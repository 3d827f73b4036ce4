"""/tokenize and /detokenize of one real `pdpool serve`: the ids are those generation uses."""

from __future__ import annotations

import json

import httpx
import pytest

from devtools.engine_procs import spawned_engine

# Starts engine processes: the full run's tier, not the fast one.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    with spawned_engine(tiny_qwen3, tmp_path_factory.mktemp("logs")) as eng:
        yield eng


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def generated_from(server, path: str, body: dict) -> list[int]:
    """The prompt token ids a generation request was computed from (return_token_ids)."""
    body = {**body, "max_tokens": 1, "stream": True, "return_token_ids": True}
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for holder in (chunk, *chunk.get("choices", ())):
                    if "prompt_token_ids" in holder:
                        return holder["prompt_token_ids"]
    raise AssertionError("no prompt_token_ids in the stream")


def test_tokenize_gives_the_ids_completions_and_chat_compute_from(server):
    prompt = "The quick brown fox jumps over the lazy dog"
    r = post(server, "/tokenize", {"prompt": prompt})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens"] == generated_from(server, "/v1/completions", {"prompt": prompt})
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] > 0
    assert out["token_strs"] is None

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
    chat = post(server, "/tokenize", {"messages": msgs}).json()
    assert chat["tokens"] == generated_from(server, "/v1/chat/completions", {"messages": msgs})
    # The generation prompt is the template's tail: without it the ids are a strict prefix.
    bare = post(server, "/tokenize", {"messages": msgs, "add_generation_prompt": False}).json()
    assert chat["tokens"][: bare["count"]] == bare["tokens"] and bare["count"] < chat["count"]


def test_detokenize_inverts_tokenize_and_token_strs_name_each_token(server):
    text = "hello there, general"
    out = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert len(out["token_strs"]) == out["count"] and all(out["token_strs"])
    back = post(server, "/detokenize", {"tokens": out["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {}, 400, "prompt"),
        (
            "/tokenize",
            {"prompt": "a", "messages": [{"role": "user", "content": "a"}]},
            400,
            "prompt",
        ),
        ("/tokenize", {"prompt": [1, 2, 3]}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": "hi"}, 400, None),
        ("/tokenize", {"prompt": "a", "model": "another-model"}, 404, "model"),
        ("/tokenize", [1, 2], 400, None),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_bad_bodies_get_a_clear_error(server, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["code"] == status
    if param is not None:
        assert err["param"] == param
    assert post(server, "/tokenize", {"prompt": "still serving"}).status_code == 200
