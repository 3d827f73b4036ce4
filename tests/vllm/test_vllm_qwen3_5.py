"""The default tiny Qwen3.5 (`pdpool tiny-model --arch qwen3_5`, in bfloat16) runs on stock
vLLM too: its CPU Gated DeltaNet needs bfloat16 and equal linear key/value head dims of 64
(32 kills the engine at the first request, as head_dim 16 does for attention). In bfloat16
the two engines' kernels round differently, so greedy outputs may part after a few tokens:
we require vLLM to serve every prompt and the first greedy token to agree on most."""

from __future__ import annotations

import os
import signal
import subprocess

import httpx
import pytest

from devtools.engine_procs import SpawnedEngine, wait_healthy
from pdpool.ports import free_port
from pdpool.up.topology import VLLM_ARGS, VLLM_ENV

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = [
    "hello world, the",
    "Once upon a time there was",
    "The quick brown fox jumps over the lazy dog and then",
]


@pytest.fixture(scope="module")
def engines(vllm_bin, tmp_path_factory):
    from pdpool.engine.tiny_model import TinyModelSpec, write_tiny_model

    model = tmp_path_factory.mktemp("qwen3_5-bf16") / "tiny-qwen3_5-bf16"
    write_tiny_model(model, TinyModelSpec(arch="qwen3_5", seed=2, num_layers=4, dtype="bfloat16"))
    logs = tmp_path_factory.mktemp("vllm-qwen3_5-logs")
    ours = SpawnedEngine(model, logs, "--dtype", "bfloat16")
    port = free_port()
    with open(logs / "vllm.log", "wb") as log:  # the child holds its own copy
        theirs = subprocess.Popen(
            [
                vllm_bin,
                "serve",
                str(model),
                "--port",
                str(port),
                "--served-model-name",
                model.name,
                *VLLM_ARGS,
                "--dtype",
                "bfloat16",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **VLLM_ENV},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, theirs, timeout=600, log=logs / "vllm.log")
        ours.wait(timeout=300)
        yield {"vllm": url, "ours": ours.url, "model": model.name, "log": logs / "vllm.log"}
    finally:
        if theirs.poll() is None:
            os.killpg(theirs.pid, signal.SIGTERM)
            theirs.wait(30)
        ours.stop()


def greedy_ids(url: str, model: str, prompt: str) -> list[int]:
    r = httpx.post(
        url + "/v1/completions",
        timeout=300,
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text[:500]
    return [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def test_default_tiny_qwen3_5_runs_on_vllm(engines):
    agree, same_prefix = 0, []
    for prompt in PROMPTS:
        theirs = greedy_ids(engines["vllm"], engines["model"], prompt)
        ours = greedy_ids(engines["ours"], engines["model"], prompt)
        assert len(theirs) == len(ours) == 16
        agree += theirs[0] == ours[0]
        same_prefix.append(
            next((i for i, (a, b) in enumerate(zip(theirs, ours, strict=True)) if a != b), 16)
        )
    print(f"\nbfloat16 Qwen3.5: greedy tokens equal for the first {same_prefix} of 16")
    assert agree >= 2, same_prefix
    assert httpx.get(engines["vllm"] + "/health", timeout=10).status_code == 200
    assert "Unexpected head dim" not in engines["log"].read_text(errors="replace")
