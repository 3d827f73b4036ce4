"""Stock vLLM's CPU build serves the same tiny PEFT adapters: its greedy token ids equal
ours (and transformers + peft) per adapter, with the base model and two adapters in flight
at once on both servers, and both list the adapters with the base model as `parent`."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess

import httpx
import pytest

from devtools.engine_procs import SpawnedEngine, wait_healthy
from devtools.lora_maker import load_with_adapter
from pdpool.up.topology import VLLM_ARGS, VLLM_ENV, free_port
from tests.support.parity import hf_greedy, random_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

MAX_NEW = 6


@pytest.fixture(scope="module")
def servers(tiny_qwen3, qwen3_adapters, vllm_bin, tmp_path_factory):
    logs = tmp_path_factory.mktemp("vllm-lora")
    modules = [f"{n}={qwen3_adapters[n]}" for n in ("alpha", "beta")]
    lora = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--lora-modules"]
    port = free_port()
    argv = [vllm_bin, "serve", str(tiny_qwen3), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--served-model-name", "base", *VLLM_ARGS, *lora, *modules]
    ours = SpawnedEngine(tiny_qwen3, logs, "--served-model-name", "base", *lora, *modules)
    with open(logs / "vllm.log", "wb") as fh:
        proc = subprocess.Popen(
            argv,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, **VLLM_ENV},
            start_new_session=True,
        )
    try:
        ours.wait(timeout=300)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, 900, logs / "vllm.log")
        yield {"ours": ours.url, "vllm": url}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        ours.stop()


def vllm_tokens(url: str, model: str, prompt: list[int]) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0}
    body.update(ignore_eos=True, return_token_ids=True)
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def our_tokens(url: str, model: str, prompt: list[int]) -> list[int]:
    sampling = {"max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    body = {"model": model, "token_ids": prompt, "sampling_params": sampling}
    r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_token_ids_equal_vllm_per_adapter_in_mixed_batches(servers, tiny_qwen3, qwen3_adapters):
    """Ours equals transformers + peft on every row, mixed or not. vLLM 0.32's CPU build
    equals it one request at a time, and on the adapter rows of mixed batches; on base-model
    rows batched with adapter rows it answers otherwise (measured here: an adapter's update
    leaks into them), so those rows are compared with ours only when run alone."""
    prompts = random_prompts(9, 6, 40, 500, seed=17)
    models = ["base", "alpha", "beta"]
    jobs = [(models[i % 3], p) for i, p in enumerate(prompts)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        theirs_mixed = list(pool.map(lambda j: vllm_tokens(servers["vllm"], *j), jobs))
        ours = list(pool.map(lambda j: our_tokens(servers["ours"], *j), jobs))
    theirs_alone = [vllm_tokens(servers["vllm"], *j) for j in jobs]
    from transformers import AutoModelForCausalLM

    refs = {
        "base": AutoModelForCausalLM.from_pretrained(str(tiny_qwen3)).eval(),
        "alpha": load_with_adapter(tiny_qwen3, qwen3_adapters["alpha"]),
        "beta": load_with_adapter(tiny_qwen3, qwen3_adapters["beta"]),
    }
    leaks = []
    for (model, prompt), mine, mixed, alone in zip(
        jobs, ours, theirs_mixed, theirs_alone, strict=True
    ):
        assert mine == hf_greedy(refs[model], prompt, MAX_NEW)[0], model
        assert mine == alone, (model, prompt)
        if model != "base":
            assert mine == mixed, (model, prompt)
        elif mine != mixed:
            leaks.append((len(prompt), mixed, mine))
    print(f"\nvLLM base-model rows batched with adapter rows that differ: {leaks}")
    assert len({tuple(t) for (m, _), t in zip(jobs, ours, strict=True) if m != "base"}) > 1


def test_models_list_the_same_adapters_and_parent(servers):
    def cards(url):
        data = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        return {c["id"]: c.get("parent") for c in data}

    assert (
        cards(servers["ours"])
        == cards(servers["vllm"])
        == {
            "base": None,
            "alpha": "base",
            "beta": "base",
        }
    )
