"""Our Renderer API answers as stock vLLM's does: `vllm launch render` (the GPU-less render
server of the cached vLLM venv) and `pdpool serve` on the same tiny checkpoint (its tokenizer
adds a BOS, so add_special_tokens shows), asked the same bodies with the same X-Request-Id,
give equal JSON, field for field and token for token, over completions and chats (system
prompts, multi-turn, add_generation_prompt, add_special_tokens, continue_final_message), and
refuse the same bad bodies. The render server loads no weights: it starts in ~20 s here."""

from __future__ import annotations

import json
import os
import signal
import subprocess

from pathlib import Path

import httpx
import pytest

from devtools.engine_procs import SpawnedEngine, wait_healthy
from pdpool.ports import free_port
from tests.support.bos_checkpoint import with_bos_tokenizer
from tests.support.render_cases import CHAT, COMPLETION, RENDER_CASES, TURNS

GENERATE = "/inference/v1/generate"

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

# The render server runs no model: the CPU platform and a context length are all it needs.
RENDER_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_HOST_IP": "127.0.0.1"}
MAX_MODEL_LEN = "2048"


@pytest.fixture(scope="module")
def servers(vllm_bin, tiny_qwen3, tmp_path_factory):
    model = with_bos_tokenizer(tiny_qwen3, tmp_path_factory.mktemp("bos") / "tiny-qwen3-bos")
    logs = tmp_path_factory.mktemp("vllm-render-logs")
    ours = SpawnedEngine(model, logs, "--max-model-len", MAX_MODEL_LEN)
    port = free_port()
    argv = [vllm_bin, "launch", "render", str(model), "--port", str(port)]
    argv += ["--served-model-name", model.name, "--max-model-len", MAX_MODEL_LEN]
    # Qwen3's tool calls, as vLLM serves them (the tools case needs a parser for "auto")
    argv += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with open(logs / "vllm-render.log", "wb") as log:  # the child holds its own copy
        theirs = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **RENDER_ENV},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, theirs, timeout=300, log=logs / "vllm-render.log")
        ours.wait(timeout=300)
        yield {"vllm": url, "ours": ours.url, "model": model.name}
    finally:
        if theirs.poll() is None:
            os.killpg(theirs.pid, signal.SIGTERM)
            theirs.wait(30)
        ours.stop()


def ask(url: str, path: str, body: object, request_id: str) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"X-Request-Id": request_id}, timeout=60)


@pytest.mark.parametrize(
    "case, path, body", RENDER_CASES, ids=[case for case, _, _ in RENDER_CASES]
)
def test_render_answers_as_vllm_launch_render(servers, case, path, body):
    for named in (body, {**body, "model": servers["model"]}):
        theirs = ask(servers["vllm"], path, named, f"same-{case}")
        ours = ask(servers["ours"], path, named, f"same-{case}")
        assert theirs.status_code == 200, theirs.text
        assert ours.status_code == 200, ours.text
        assert ours.json() == theirs.json()


BAD = [
    (COMPLETION, {"prompt": ""}),
    (COMPLETION, {"prompt": 7}),
    (COMPLETION, {"prompt": "a", "max_tokens": 10**6}),
    (COMPLETION, {"prompt": "a", "model": "another-model"}),
    (CHAT, {"messages": [TURNS[0]], "continue_final_message": True}),
    (CHAT, {"messages": [TURNS[0]], "model": "another-model"}),
]


@pytest.mark.parametrize("path, body", BAD)
def test_render_refuses_what_vllm_refuses(servers, path, body):
    theirs = ask(servers["vllm"], path, body, "bad")
    ours = ask(servers["ours"], path, body, "bad")
    assert theirs.status_code in (400, 404)
    assert ours.status_code == theirs.status_code, (ours.text, theirs.text)
    # (vLLM types its own schema errors "Bad Request", its other 400s "BadRequestError")
    assert ours.json()["error"]["message"] and theirs.json()["error"]["message"]


# Run by the vLLM venv's python: each of our /inference/v1/generate answers (stdin, JSON) is
# parsed by vLLM's own response model and written back as vLLM's server writes it (a whole
# answer fully, a stream's token chunks without their null prompt fields, its usage chunk
# without nulls); it prints the answers that do not come back unchanged.
VLLM_ROUNDTRIP = """
import json, sys
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    GenerateTokensResponse, GenerateTokensStreamResponse)
differ = []
for kind, ours in json.load(sys.stdin):
    if kind == "whole":
        theirs = GenerateTokensResponse.model_validate(ours).model_dump(mode="json")
    elif ours["choices"]:
        chunk = GenerateTokensStreamResponse.model_validate(ours)
        empty = {n for n in ("prompt_token_ids", "mm_placeholders", "metrics")
                 if getattr(chunk, n) is None}
        theirs = chunk.model_dump(mode="json", exclude=empty)
    else:
        theirs = GenerateTokensStreamResponse.model_validate(ours).model_dump(
            mode="json", exclude_none=True)
    if theirs != ours:
        differ.append({"ours": ours, "vllm": theirs})
print(json.dumps(differ))
"""


def test_generate_answers_in_vllms_response_models(servers, vllm_bin):
    """/inference/v1/generate has no stock counterpart without a full `vllm serve`: our
    answers (whole and streamed, n=2, usage, prompt ids, logprobs and the prompt's) must
    survive vLLM's own models."""
    asked = {"prompt": "Once upon", "max_tokens": 3, "n": 2, "seed": 1, "logprobs": 2}
    (rendered,) = httpx.post(
        servers["ours"] + COMPLETION,
        json={**asked, "prompt_logprobs": 1},
        timeout=60,
    ).json()
    whole = httpx.post(
        servers["ours"] + GENERATE, json={**rendered, "return_token_ids": True}, timeout=60
    )
    assert whole.status_code == 200, whole.text
    assert whole.json()["prompt_logprobs"] and whole.json()["choices"][0]["logprobs"]
    answers = [("whole", whole.json())]
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {**rendered, "stream": True, "stream_options": options, "return_token_ids": True}
    with httpx.stream("POST", servers["ours"] + GENERATE, json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    answers += [("chunk", json.loads(event)) for event in events[:-1]]
    python = str(Path(vllm_bin).parent / "python")
    done = subprocess.run(
        [python, "-c", VLLM_ROUNDTRIP],
        input=json.dumps(answers),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **RENDER_ENV},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
