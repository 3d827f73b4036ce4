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


def stream_texts(r: httpx.Response) -> dict[int, list[str]]:
    """A streamed completion's texts by choice index, chunk by chunk."""
    texts: dict[int, list[str]] = {}
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                texts.setdefault(choice["index"], []).append(choice["text"])
    return texts


GREEDY = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.mark.slow
@pytest.mark.parametrize("prompts", [["hello there", "good day"], [[5, 6, 7], [8]]])
def test_echo_puts_each_prompt_before_its_choices_text(eng, prompts):
    body = {"prompt": prompts, "n": 2, **GREEDY}
    plain = post(eng, "/v1/completions", body).json()["choices"]
    echoed = post(eng, "/v1/completions", {**body, "echo": True}).json()["choices"]
    # a text as written, token ids as they decode
    texts = [p if isinstance(p, str) else post(eng, "/detokenize", {"tokens": p}).json()["prompt"]
             for p in prompts]  # fmt: skip
    echoes = [texts[0], texts[0], texts[1], texts[1]]
    assert [c["text"] for c in echoed] == [
        e + c["text"] for e, c in zip(echoes, plain, strict=True)
    ]
    streamed = stream_texts(post(eng, "/v1/completions", {**body, "echo": True, "stream": True}))
    assert {i: "".join(t) for i, t in streamed.items()} == dict(
        enumerate(c["text"] for c in echoed)
    )
    assert all(chunks[0].startswith(echoes[i]) for i, chunks in streamed.items())
    # the prompt's ids are in the answer already: its text is not repeated (as vLLM)
    with_ids = post(eng, "/v1/completions", {**body, "echo": True, "return_token_ids": True})
    assert [c["text"] for c in with_ids.json()["choices"]] == [c["text"] for c in plain]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_answers_the_prompt_alone(eng, stream):
    r = post(eng, "/v1/completions", {"prompt": "hi there", "max_tokens": 0, "echo": True,
                                      "stream": stream, "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    text = "".join(stream_texts(r)[0]) if stream else r.json()["choices"][0]["text"]
    assert text == "hi there"
    if not stream:
        assert r.json()["usage"]["completion_tokens"] == 1  # made and left out, as vLLM
    # that one token may be a must (min_tokens 1); two cannot
    body = {"prompt": "hi there", "max_tokens": 0, "echo": True, "stream": stream}
    assert post(eng, "/v1/completions", {**body, "min_tokens": 1}).status_code == 200
    r = post(eng, "/v1/completions", {**body, "min_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


CONTINUED = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]


@pytest.mark.slow
@pytest.mark.parametrize(
    "fields,echoed",
    [
        ({"messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True},
         "Once upon"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 2}],
          "add_generation_prompt": False}, "a\na"),  # no generation prompt: any role echoes
        ({"messages": CONTINUED}, "Once upon"),  # an assistant message last
        (CHAT, ""),  # the answer's role is not the last message's: nothing to echo
    ],
)  # fmt: skip
def test_chat_echo_puts_the_last_message_before_the_answer(eng, fields, echoed):
    body = {**fields, **GREEDY}
    plain = post(eng, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    got = post(eng, "/v1/chat/completions", {**body, "echo": True})
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"]["content"] == echoed + plain
    streamed = post(eng, "/v1/chat/completions", {**body, "echo": True, "stream": True})
    lines = streamed.text.splitlines()
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0]["role"] == "assistant"
    # with the first token (vLLM sends it alone, just before): the concatenation is the same
    assert (deltas[1].get("content") or "").startswith(echoed)
    assert "".join(d.get("content") or "" for d in deltas) == echoed + plain


@pytest.mark.slow
def test_an_echo_that_would_multiply_a_large_prompt_is_a_400(eng):
    # a truncated prompt is echoed whole, once per choice: 1.1 MB x 16 would be 17.6 MB
    body = {"prompt": "word " * 220000, "truncate_prompt_tokens": 8, "max_tokens": 1, "n": 16}
    assert post(eng, "/v1/completions", body).status_code == 200
    r = post(eng, "/v1/completions", {**body, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
    long = {"messages": [{"role": "assistant", "content": "word " * 220000}], "n": 16}
    r = post(eng, "/v1/chat/completions", {**long, "echo": True, "truncate_prompt_tokens": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
    assert post(eng, "/v1/completions", {**body, "echo": True, "n": 1}).status_code == 200


REFUSED_ECHO = [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # nothing to generate, nothing echoed
    ({"prompt": "hi", "echo": "yes"}, "echo"),
    ({"prompt": "hi", "echo": 1}, "echo"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
]


@pytest.mark.slow
@pytest.mark.parametrize("body,param", REFUSED_ECHO)
def test_an_echo_this_server_cannot_answer_is_a_400_naming_it(eng, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = post(eng, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
