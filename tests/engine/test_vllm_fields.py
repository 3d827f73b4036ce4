"""vLLM request fields a client may send, on a real `pdpool serve`: each is served as vLLM
serves it, or a malformed value is a 400 naming the field (never ignored with a 200).
chat_template_kwargs on a copy of the tiny checkpoint whose template reads Qwen3's
`enable_thinking`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from devtools.engine_procs import SpawnedEngine
from pdpool.engine.server.template_kwargs import template_kwargs
from pdpool.engine.server.text_tokenizer import ChatTemplateError, TextTokenizer, _compile
from pdpool.protocol import RequestError

# Qwen3's own clause: a chat that must not think gets an empty thought after the prompt.
THINKING_CLAUSE = (
    "{%- if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
)
IM_START = 1  # <|im_start|>, a special token of the tiny tokenizers


def test_template_kwargs_keep_what_the_template_reads_and_refuse_request_fields():
    variables = frozenset({"messages", "enable_thinking"})
    assert template_kwargs({"enable_thinking": False, "other": 1}, variables) == {
        "enable_thinking": False
    }
    assert template_kwargs({"other": 1}, None) == {"other": 1}
    assert template_kwargs(None, variables) == {}
    names = ("messages", "tools", "add_generation_prompt", "chat_template", "raise_exception")
    for name in names:
        with pytest.raises(RequestError, match=name):
            template_kwargs({name: 1}, variables)


def test_a_template_that_cannot_use_a_value_refuses_the_request(tiny_qwen3):
    tokenizer = TextTokenizer(tiny_qwen3)
    tokenizer._template = _compile("{{ greet('x') }}{{ messages[0].content }}")
    with pytest.raises(ChatTemplateError, match="cannot render"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], greet="not callable")


def thinking_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    config_path = dst / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    template = config.pop("chat_template", None) or (dst / "chat_template.jinja").read_text()
    config_path.write_text(json.dumps(config))
    (dst / "chat_template.jinja").write_text(template + THINKING_CLAUSE)
    return dst


@pytest.fixture(scope="module")
def eng(tiny_qwen3, tmp_path_factory):
    model = thinking_checkpoint(tiny_qwen3, tmp_path_factory.mktemp("ckpt") / "thinking")
    proc = SpawnedEngine(model, tmp_path_factory.mktemp("logs"))
    try:
        yield proc.wait()
    finally:
        proc.stop()


def post(eng, path: str, body: dict) -> httpx.Response:
    return httpx.post(eng.url + path, json=body, timeout=60)


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.slow
def test_chat_template_kwargs_reach_the_template(eng):
    plain = post(eng, "/tokenize", CHAT).json()["tokens"]
    off = post(eng, "/tokenize", {**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    unread = post(eng, "/tokenize", {**CHAT, "chat_template_kwargs": {"not_read": 1}})
    detok = post(eng, "/detokenize", {"tokens": off.json()["tokens"]}).json()["prompt"]
    assert detok.endswith("<think>\n\n</think>\n\n") and off.json()["tokens"][: len(plain)] == plain
    assert unread.json()["tokens"] == plain
    r = post(eng, "/v1/chat/completions", {**CHAT, "max_tokens": 2, "chat_template_kwargs": {
        "enable_thinking": False}})  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(off.json()["tokens"])


KW = "chat_template_kwargs"
SPACES = "spaces_between_special_tokens"
TOOL_ANSWER = {"role": "tool", "content": "r", "tool_call_id": 5}
CALLED = {
    "role": "assistant",
    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": 5}}],
}
MALFORMED = [
    ("/v1/chat/completions", {**CHAT, KW: {"messages": []}}, KW),
    ("/v1/chat/completions", {**CHAT, KW: [1]}, KW),
    ("/v1/chat/completions", {**CHAT, KW: {"raise_exception": 1}}, KW),
    ("/tokenize", {**CHAT, KW: {"tokenize": True}}, KW),
    ("/tokenize", {**CHAT, "chat_template": "{{ 1 }}"}, "chat_template"),
    ("/v1/completions", {"prompt": "hi", "skip_special_tokens": 1}, "skip_special_tokens"),
    ("/v1/completions", {"prompt": "hi", SPACES: []}, SPACES),
    ("/v1/completions", {"prompt": "hi", "request_id": 5}, "request_id"),
    ("/v1/completions", {"prompt": "hi", "request_id": "a b\n"}, "request_id"),
    ("/v1/completions", {"prompt": "hi", "vllm_xargs": [1]}, "vllm_xargs"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": 0}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "tools": ""}, "tools"),
    ("/v1/chat/completions", {"messages": [TOOL_ANSWER]}, "messages"),
    ("/v1/chat/completions", {"messages": [CALLED]}, "messages"),
]


@pytest.mark.slow
@pytest.mark.parametrize("path,body,param", MALFORMED)
def test_a_malformed_vllm_field_is_a_400_naming_it(eng, path, body, param):
    r = post(eng, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_skip_special_tokens_false_keeps_them_in_the_text(eng, stream):
    body = {"prompt": "hi", "max_tokens": 3, "allowed_token_ids": [IM_START], "stream": stream}
    texts = {}
    for skip in (True, False):
        r = post(eng, "/v1/completions", {**body, "skip_special_tokens": skip})
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]  # fmt: skip
            texts[skip] = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        else:
            texts[skip] = r.json()["choices"][0]["text"]
    assert texts == {True: "", False: "<|im_start|>" * 3}


@pytest.mark.slow
def test_the_body_request_id_names_the_answer(eng):
    r = post(eng, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "request_id": "my-id.7"})
    assert r.status_code == 200 and r.json()["id"] == "cmpl-my-id.7", r.text  # as vLLM's
    header = {"x-request-id": "from-header"}
    body = {**CHAT, "max_tokens": 1, "request_id": "b"}
    r = httpx.post(eng.url + "/v1/chat/completions", json=body, headers=header)
    assert r.json()["id"] == "chatcmpl-from-header", r.text
    history = [
        {"role": "user", "content": "call f"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]  # fmt: skip
    r = post(eng, "/v1/chat/completions", {"messages": history, "max_tokens": 1})
    assert r.status_code == 200, r.text


@pytest.mark.slow
def test_return_token_ids_in_a_whole_answer_as_vllm_places_them(eng):
    body = {"prompt": [[5, 6], [7]], "max_tokens": 3, "return_token_ids": True, "ignore_eos": True}
    choices = post(eng, "/v1/completions", body).json()["choices"]
    assert [c["prompt_token_ids"] for c in choices] == [[5, 6], [7]]
    assert all(len(c["token_ids"]) == 3 for c in choices)
    chat = post(eng, "/v1/chat/completions", {**CHAT, "max_tokens": 2, "return_token_ids": True})
    tokens = post(eng, "/tokenize", CHAT).json()["tokens"]
    assert chat.json()["prompt_token_ids"] == tokens and len(chat.json()["choices"][0]["token_ids"])
    plain = post(eng, "/v1/completions", {"prompt": "hi", "max_tokens": 1}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
