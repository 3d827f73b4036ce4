"""vLLM's Renderer API on one real `pdpool serve` (a tiny checkpoint whose tokenizer adds a
BOS, so add_special_tokens shows): the render routes give the very prompt ids the completion
routes feed the model, for every template and add_special_tokens case, and
/inference/v1/generate runs a rendered request to the tokens /v1/completions gives."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from devtools.engine_procs import spawned_engine
from tests.support.bos_checkpoint import with_bos_tokenizer
from tests.support.render_cases import CHAT, COMPLETION, RENDER_CASES, SYSTEM, TURNS

# Starts engine processes: the full run's tier, not the fast one.
pytestmark = pytest.mark.slow

GENERATE = "/inference/v1/generate"
CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "add_special_tokens", "tools")


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    model = with_bos_tokenizer(tiny_qwen3, tmp_path_factory.mktemp("bos") / "tiny-qwen3-bos")
    with spawned_engine(model, tmp_path_factory.mktemp("logs")) as eng:
        yield eng


def post(server, path: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def rendered_ids(server, path: str, body: dict[str, Any]) -> list[list[int]]:
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    answer = r.json()
    return [item["token_ids"] for item in (answer if path == COMPLETION else [answer])]


def fed_ids(server, path: str, body: dict[str, Any]) -> list[list[int]]:
    """The prompt ids the completion route computes from, one list per prompt (its stream's
    return_token_ids), with one generated token per choice."""
    dropped = ("max_completion_tokens", "min_tokens", "prompt_logprobs", "echo")
    body = {k: v for k, v in body.items() if k not in dropped}
    body.update(max_tokens=1, stream=True, return_token_ids=True)
    n = body.get("n", 1)
    by_prompt: dict[int, list[int]] = {}
    route = path.removesuffix("/render")
    with httpx.stream("POST", f"{server.url}{route}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for holder in (chunk, *chunk.get("choices", ())):
                if "prompt_token_ids" in holder:
                    by_prompt[chunk["choices"][0]["index"] // n] = holder["prompt_token_ids"]
    return [by_prompt[i] for i in sorted(by_prompt)]


@pytest.mark.parametrize(
    "path, body", [c[1:] for c in RENDER_CASES], ids=[c[0] for c in RENDER_CASES]
)
def test_render_gives_the_ids_the_completion_routes_feed_the_model(server, path, body):
    ids = rendered_ids(server, path, body)
    assert ids == fed_ids(server, path, body)
    if path == CHAT or isinstance(body["prompt"], str):  # /tokenize agrees for one text
        ask = {k: v for k, v in body.items() if k in ("prompt", "messages", *CHAT_FIELDS)}
        assert post(server, "/tokenize", ask).json()["tokens"] == ids[0]


def test_the_flags_change_the_ids_as_in_vllm(server):
    """BOS for a text prompt unless add_special_tokens is false; none for a chat unless it
    is true; the generation prompt opens the assistant's turn; continue_final_message leaves
    the last message open."""
    (text,) = rendered_ids(server, COMPLETION, {"prompt": "a b"})
    (bare,) = rendered_ids(server, COMPLETION, {"prompt": "a b", "add_special_tokens": False})
    assert text == [0, *bare]
    chat = {"messages": [SYSTEM, TURNS[0]], "max_tokens": 4}
    (plain,) = rendered_ids(server, CHAT, chat)
    (with_bos,) = rendered_ids(server, CHAT, {**chat, "add_special_tokens": True})
    (no_prompt,) = rendered_ids(server, CHAT, {**chat, "add_generation_prompt": False})
    assert plain[0] != 0 and with_bos == [0, *plain]
    assert plain[: len(no_prompt)] == no_prompt and len(plain) > len(no_prompt)
    two = {"messages": TURNS[:2], "max_tokens": 4, "add_generation_prompt": False}
    (closed,) = rendered_ids(server, CHAT, two)
    (open_,) = rendered_ids(server, CHAT, {**two, "continue_final_message": True})
    assert closed[: len(open_)] == open_ and len(open_) < len(closed)


def test_render_answers_in_vllms_shape(server):
    body = {"prompt": ["x y", "z"], "temperature": 0, "max_tokens": 3, "seed": 4, "stop": "q"}
    r = post(server, COMPLETION, {**body, "model": "tiny-qwen3-bos"}, **{"x-request-id": "abc"})
    assert r.status_code == 200, r.text
    first, second = r.json()
    assert (first["request_id"], second["request_id"]) == ("cmpl-abc-0", "cmpl-abc-1")
    assert first["model"] == "tiny-qwen3-bos" and first["output_mode"] == "tokens"
    assert first["sampling_params"] == {  # greedy: no top_p/top_k/min_p, as vLLM writes it
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "temperature": 0.0,
        "seed": 4,
        "stop": ["q"],
        "stop_token_ids": [],
        "max_tokens": 3,
        "output_kind": 2,
        "skip_clone": True,
        "bad_words": [],
        "skip_reading_prefix_cache": False,
    }
    kv = {"do_remote_decode": True}
    chat = {"messages": [TURNS[0]], "stream": True, "kv_transfer_params": kv, "request_id": "q"}
    one = post(server, CHAT, chat).json()
    assert one["request_id"] == "chatcmpl-q" and one["stream"] is True
    assert one["sampling_params"]["output_kind"] == 1  # a stream's deltas
    assert one["sampling_params"]["extra_args"] == {"kv_transfer_params": kv}
    # what our chat route would run: 16, vLLM's SamplingParams default, which it leaves out
    assert "max_tokens" not in one["sampling_params"]


def completion_tokens(server, body: dict[str, Any]) -> list[list[int]]:
    """Each choice's generated token ids through /v1/completions."""
    body = {**body, "logprobs": 0, "return_tokens_as_token_ids": True}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return [
        [int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]]
        for c in sorted(r.json()["choices"], key=lambda c: c["index"])
    ]


def test_generate_runs_a_rendered_request_to_the_completion_routes_tokens(server):
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    (rendered,) = post(server, COMPLETION, body).json()
    r = post(server, GENERATE, {**rendered, "return_token_ids": True})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["request_id"].startswith("generate-tokens-")
    assert answer["prompt_token_ids"] == rendered["token_ids"]
    (choice,) = answer["choices"]
    assert [choice["token_ids"]] == completion_tokens(server, body)
    assert choice["finish_reason"] == "length"
    assert answer["usage"]["prompt_tokens"] == len(rendered["token_ids"])
    assert answer["usage"]["completion_tokens"] == 6

    # streamed, two seeded choices: each choice's chunks add up to /v1/completions' choice
    sampled = {**body, "temperature": 0.8, "seed": 3, "n": 2}
    (rendered,) = post(server, COMPLETION, {**sampled, "stream": True}).json()
    rendered["stream_options"] = {"include_usage": True}
    tokens: dict[int, list[int]] = {0: [], 1: []}
    usage = None
    with httpx.stream("POST", f"{server.url}{GENERATE}", json=rendered, timeout=60) as s:
        assert s.status_code == 200
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        chunk = json.loads(event)
        for c in chunk["choices"]:
            tokens[c["index"]] += c["token_ids"]
        usage = chunk["usage"] or usage
    assert [tokens[0], tokens[1]] == completion_tokens(server, sampled)
    assert usage is not None and usage["completion_tokens"] == 12


def test_generate_answers_logprobs_as_the_completion_route_computes_them(server):
    body = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    asked = {**body, "logprobs": 3, "prompt_logprobs": 2}
    (rendered,) = post(server, COMPLETION, asked).json()
    params = rendered["sampling_params"]
    assert (params["logprobs"], params["prompt_logprobs"]) == (3, 2)
    assert params["skip_reading_prefix_cache"] is True  # vLLM's: the prompt computed whole
    r = post(server, GENERATE, rendered)
    assert r.status_code == 200, r.text
    answer = r.json()
    (choice,) = answer["choices"]
    theirs = post(server, "/v1/completions", {**asked, "return_tokens_as_token_ids": True})
    assert theirs.status_code == 200, theirs.text
    (reference,) = theirs.json()["choices"]
    ref = reference["logprobs"]
    content = choice["logprobs"]["content"]
    assert [c["token_id"] for c in content] == choice["token_ids"]
    assert [f"token_id:{c['token_id']}" for c in content] == ref["tokens"]
    for c, value, top in zip(content, ref["token_logprobs"], ref["top_logprobs"], strict=True):
        assert c["logprob"] == pytest.approx(value, abs=1e-5)
        assert c["rank"] == 1  # greedy: the likeliest
        # vLLM's candidates: the sampled token, then the likeliest others, 3 in all
        assert c["top_logprobs"][0] == {k: c[k] for k in ("token_id", "logprob", "rank")}
        assert len(c["top_logprobs"]) == 3
        assert [t["rank"] for t in c["top_logprobs"]] == [1, 2, 3]
        by_id = {int(k.removeprefix("token_id:")): v for k, v in top.items()}
        for t in c["top_logprobs"]:
            assert t["logprob"] == pytest.approx(by_id[t["token_id"]], abs=1e-5)
    # the prompt's logprobs, as the completion route gives them (its texts too)
    assert answer["prompt_logprobs"][0] is None
    assert len(answer["prompt_logprobs"]) == len(rendered["token_ids"])
    for ours, ref_row in zip(answer["prompt_logprobs"], reference["prompt_logprobs"], strict=True):
        if ours is None:
            assert ref_row is None
            continue
        assert list(ours) == list(ref_row)
        for token, entry in ours.items():
            assert entry["rank"] == ref_row[token]["rank"]
            assert entry["logprob"] == pytest.approx(ref_row[token]["logprob"], abs=1e-5)
    # `detokenize: false`: no texts; a stream has no place for the prompt's
    rendered["sampling_params"]["detokenize"] = False
    rows = post(server, GENERATE, rendered).json()["prompt_logprobs"]
    assert {e["decoded_token"] for row in rows[1:] for e in row.values()} == {None}
    stream = {**rendered, "stream": True}
    with httpx.stream("POST", f"{server.url}{GENERATE}", json=stream, timeout=60) as s:
        assert s.status_code == 200
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    streamed = [c for chunk in chunks for ch in chunk["choices"] for c in ch["logprobs"]["content"]]
    assert [c["token_id"] for c in streamed] == choice["token_ids"]
    assert all("prompt_logprobs" not in chunk for chunk in chunks)


def test_generate_without_max_tokens_may_fill_the_context(server):
    r = post(server, GENERATE, {"token_ids": [5, 6], "sampling_params": {"temperature": 0}})
    assert r.status_code == 200, r.text


BAD = [
    (COMPLETION, {"prompt": 7}, "prompt"),
    (COMPLETION, {"prompt": ""}, "prompt"),
    (COMPLETION, {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    (COMPLETION, {"prompt": "a", "max_tokens": 10**6}, "prompt"),
    (COMPLETION, {"prompt": [10**6]}, "prompt"),
    (COMPLETION, {"prompt": "a", "presence_penalty": 3}, "presence_penalty"),
    (COMPLETION, {"prompt": "a", "logit_bias": {"5": 1.0}}, "logit_bias"),
    (CHAT, {"messages": [TURNS[0]], "response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"messages": []}, "messages"),
    (
        CHAT,
        {"messages": [TURNS[0]], "continue_final_message": True},
        "continue_final_message",
    ),
    (GENERATE, {"sampling_params": {}}, "token_ids"),
    (GENERATE, {"token_ids": [1, -2], "sampling_params": {}}, "token_ids"),
    (GENERATE, {"token_ids": [10**6], "sampling_params": {}}, "prompt"),
    (GENERATE, {"token_ids": [1]}, "sampling_params"),
    (GENERATE, {"token_ids": [1], "sampling_params": {"logprobs": 21}}, "logprobs"),
    (GENERATE, {"token_ids": [1], "sampling_params": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    (GENERATE, {"token_ids": [1], "sampling_params": {"prompt_logprobs": -2}}, "prompt_logprobs"),
    # with a KV load the prompt's rows would be computed elsewhere
    (
        GENERATE,
        {
            "token_ids": [1, 2],
            "sampling_params": {"prompt_logprobs": 0},
            "kv_transfer_params": {"do_remote_prefill": True},
        },
        "prompt_logprobs",
    ),
    (
        GENERATE,
        {"token_ids": [1], "sampling_params": {"structured_outputs": {"json": {}}}},
        "sampling_params",
    ),
    (GENERATE, {"token_ids": [1], "sampling_params": {"top_p": 2}}, "top_p"),
    (GENERATE, {"token_ids": [1], "sampling_params": {}, "output_mode": "text"}, "output_mode"),
    (GENERATE, {"token_ids": [1], "sampling_params": {}, "features": {"a": 1}}, "features"),
    (GENERATE, [1, 2], None),
]


@pytest.mark.parametrize("path, body, param", BAD)
def test_bad_input_gets_a_400_that_names_the_field(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["message"]
    assert error["param"] == param


def test_another_model_is_404(server):
    for path, body in ((COMPLETION, {"prompt": "a"}), (GENERATE, {"token_ids": [1]})):
        r = post(server, path, {**body, "model": "other", "sampling_params": {}})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
