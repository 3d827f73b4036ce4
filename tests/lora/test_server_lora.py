"""`pdpool serve --enable-lora`: adapters chosen by `model`, listed by /v1/models with their
parent, loaded and unloaded at runtime (VLLM_ALLOW_RUNTIME_LORA_UPDATING) with every bad
load refused with 400, vllm:lora_requests_info, and tokens equal to transformers + peft."""

from __future__ import annotations

import concurrent.futures
import json
import shutil

import httpx
import pytest

from devtools.engine_procs import spawned_engine
from devtools.lora_maker import load_with_adapter, make_adapter
from tests.support.parity import hf_greedy, random_prompts

pytestmark = pytest.mark.slow

MAX_NEW = 5


def _complete(url: str, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0}
    body["ignore_eos"] = True
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(url: str, model: str, prompt: list[int]) -> list[int]:
    sampling = {"max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    body = {"model": model, "token_ids": prompt, "sampling_params": sampling}
    r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def lora_server(tiny_qwen3, qwen3_adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    allowed = root / "allowed"
    allowed.mkdir()
    shutil.copytree(qwen3_adapters["gamma"], allowed / "gamma")
    flags = [
        "--enable-lora",
        "--lora-modules",
        f"alpha={qwen3_adapters['alpha']}",
        json.dumps({"name": "beta", "path": str(qwen3_adapters["beta"])}),
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
        "--lora-allowed-dir",
        str(allowed),
    ]
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    try:
        with spawned_engine(tiny_qwen3, root, *flags) as eng:
            yield eng, allowed
    finally:
        mp.undo()


def test_models_lists_adapters_with_their_parent(lora_server, qwen3_adapters):
    eng, _ = lora_server
    cards = {c["id"]: c for c in httpx.get(f"{eng.url}/v1/models", timeout=10).json()["data"]}
    base = next(c for c in cards.values() if c["parent"] is None)
    assert set(cards) == {base["id"], "alpha", "beta"}
    for name in ("alpha", "beta"):
        assert cards[name]["parent"] == base["id"]
        assert cards[name]["root"] == str(qwen3_adapters[name].resolve())


def test_requests_pick_adapters_and_match_peft(lora_server, tiny_qwen3, qwen3_adapters):
    eng, _ = lora_server
    base_id = httpx.get(f"{eng.url}/v1/models", timeout=10).json()["data"][0]["id"]
    prompts = random_prompts(6, 6, 30, 500, seed=11)
    models = [base_id, "alpha", "beta"]
    jobs = [(models[i % 3], p) for i, p in enumerate(prompts)]
    # All at once: the engine batches the base model and both adapters in the same steps.
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: _tokens(eng.url, *j), jobs))
    from transformers import AutoModelForCausalLM

    refs = {
        base_id: AutoModelForCausalLM.from_pretrained(str(tiny_qwen3)).eval(),
        "alpha": load_with_adapter(tiny_qwen3, qwen3_adapters["alpha"]),
        "beta": load_with_adapter(tiny_qwen3, qwen3_adapters["beta"]),
    }
    for (model, prompt), tokens in zip(jobs, got, strict=True):
        assert tokens == hf_greedy(refs[model], prompt, MAX_NEW)[0], model
    assert _complete(eng.url, "alpha", prompts[0])["model"] == "alpha"


def test_unknown_model_is_404(lora_server):
    eng, _ = lora_server
    body = {"model": "nope", "prompt": [5, 6], "max_tokens": 2}
    r = httpx.post(f"{eng.url}/v1/completions", json=body, timeout=10)
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The model `nope` does not exist."


def test_prefix_cache_never_crosses_adapters(lora_server):
    eng, _ = lora_server
    prompt = random_prompts(1, 64, 64, 500, seed=21)[0]

    def cached(model):
        usage = _complete(eng.url, model, prompt)["usage"]
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    assert cached("alpha") == 0
    assert cached("alpha") >= 48  # the same adapter hits its own blocks
    assert cached("beta") == 0  # another adapter never does
    base_id = httpx.get(f"{eng.url}/v1/models", timeout=10).json()["data"][0]["id"]
    assert cached(base_id) == 0  # nor the base model


def test_runtime_load_and_unload(lora_server, tiny_qwen3, tiny_qwen3_5, tmp_path):
    eng, allowed = lora_server

    def load(body):
        return httpx.post(f"{eng.url}/v1/load_lora_adapter", json=body, timeout=30)

    r = load({"lora_name": "gamma", "lora_path": str(allowed / "gamma")})
    assert r.status_code == 200, r.text
    prompt = random_prompts(1, 10, 10, 500, seed=5)[0]
    want = hf_greedy(load_with_adapter(tiny_qwen3, allowed / "gamma"), prompt, MAX_NEW)[0]
    assert _tokens(eng.url, "gamma", prompt) == want
    assert "gamma" in {c["id"] for c in httpx.get(f"{eng.url}/v1/models").json()["data"]}

    # Every bad load: 400 with why.
    make_adapter(tiny_qwen3, allowed / "wide", seed=9, rank=32)
    make_adapter(tiny_qwen3_5, allowed / "other", seed=9, rank=4, targets=("in_proj_qkv",))
    broken = allowed / "broken"
    shutil.copytree(allowed / "gamma", broken)
    (broken / "adapter_config.json").write_text("{not json")
    truncated = allowed / "truncated"
    shutil.copytree(allowed / "gamma", truncated)
    (truncated / "adapter_model.safetensors").write_bytes(b"\x10\x00")
    outside = tmp_path / "outside"
    shutil.copytree(allowed / "gamma", outside)
    cases = [
        ({"lora_name": "gamma", "lora_path": str(allowed / "gamma")}, "already been loaded"),
        ({"lora_name": "wide", "lora_path": str(allowed / "wide")}, "--max-lora-rank"),
        ({"lora_name": "x", "lora_path": str(allowed / "missing")}, "not a directory"),
        ({"lora_name": "x", "lora_path": str(broken)}, "not valid JSON"),
        ({"lora_name": "x", "lora_path": str(truncated)}, "not a safetensors file"),
        ({"lora_name": "x", "lora_path": str(outside)}, "outside --lora-allowed-dir"),
        ({"lora_name": "x", "lora_path": str(allowed / ".." / "gamma")}, "outside"),
        ({"lora_name": "x", "lora_path": str(allowed / "other")}, "no layer"),
        ({"lora_name": "", "lora_path": str(allowed / "gamma")}, "lora_name"),
        ({"lora_name": ["x"], "lora_path": str(allowed / "gamma")}, "lora_name"),
        ({"lora_name": "x", "lora_path": 7}, "lora_path"),
        ({"lora_name": "alpha" * 100, "lora_path": str(allowed / "gamma")}, "lora_name"),
    ]
    for body, why in cases:
        r = load(body)
        assert r.status_code == 400, (body, r.text)
        assert why in r.json()["error"]["message"], (body, r.text)
    r = httpx.post(f"{eng.url}/v1/load_lora_adapter", content=b"[1, 2", timeout=10)
    assert r.status_code == 400
    # past the route's own 64 KiB (not --max-body-bytes): 413, announced or chunked
    big = b'{"lora_name": "' + b"x" * (1 << 20) + b'"}'
    for content in (big, iter([big[:1000], big[1000:]])):
        r = httpx.post(f"{eng.url}/v1/load_lora_adapter", content=content, timeout=10)
        assert r.status_code == 413 and "65536 bytes on this route" in r.text, r.text

    r = httpx.post(f"{eng.url}/v1/unload_lora_adapter", json={"lora_name": "gamma"}, timeout=10)
    assert r.status_code == 200, r.text
    body = {"model": "gamma", "prompt": prompt, "max_tokens": 2}
    assert httpx.post(f"{eng.url}/v1/completions", json=body, timeout=10).status_code == 404
    r = httpx.post(f"{eng.url}/v1/unload_lora_adapter", json={"lora_name": "gamma"}, timeout=10)
    assert r.status_code == 404


def test_lora_requests_info_metric(lora_server):
    eng, _ = lora_server
    text = httpx.get(f"{eng.url}/metrics", timeout=10).text
    lines = [ln for ln in text.splitlines() if ln.startswith("vllm:lora_requests_info{")]
    assert len(lines) == 1, lines
    assert 'max_lora="2"' in lines[0]
    assert 'running_lora_adapters=""' in lines[0]  # idle now
    assert float(lines[0].rsplit(" ", 1)[1]) > 1.7e9  # a timestamp, as vLLM's


def test_runtime_routes_need_the_env_var(tiny_qwen3, qwen3_adapters, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    flags = ["--enable-lora", "--lora-modules", f"alpha={qwen3_adapters['alpha']}"]
    with spawned_engine(tiny_qwen3, tmp_path, *flags) as eng:
        body = {"lora_name": "b", "lora_path": str(qwen3_adapters["beta"])}
        assert httpx.post(f"{eng.url}/v1/load_lora_adapter", json=body).status_code == 404
        assert _complete(eng.url, "alpha", [5, 6, 7])["model"] == "alpha"
