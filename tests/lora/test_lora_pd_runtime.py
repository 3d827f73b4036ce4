"""P/D for an adapter only the decode engine serves: loaded at runtime on decode alone.

`pdpool up`'s topology (real engines, real NIXL, sidecar, gateway), every engine started
with LoRA on and no adapter. The sidecar finds no prefill engine listing the adapter and
loads it on one (the decode engine's name and path), so the prefill leg runs under the
right adapter and the answer equals decode alone's. A decode engine's path outside the
sidecar's allowed folders is never loaded: decode serves alone, the same greedy tokens."""

from __future__ import annotations

import os
import random

import httpx
import pytest

from pdpool.up.topology import SIDE_BY_SIDE, Topology, TopologySpec
from tests.support.e2e_helpers import metric

pytestmark = pytest.mark.slow

RUNTIME = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@pytest.fixture(scope="module")
def topo(tiny_qwen3, qwen3_adapters, tmp_path_factory):
    root = qwen3_adapters["alpha"].parent
    saved = os.environ.get(RUNTIME)
    os.environ[RUNTIME] = "true"  # inherited by every engine
    spec = TopologySpec(
        model=str(tiny_qwen3),
        prefill=1,
        decode=1,
        cache_hit_threshold=0.5,
        log_dir=str(tmp_path_factory.mktemp("lora-pd-runtime")),
        engine_args=[
            "--num-kv-blocks",
            "256",
            "--enable-lora",
            "--max-loras=2",
            f"--lora-allowed-dir={root}",
        ],
        # The sidecar trusts alpha's folder only: beta's is outside.
        lora_allowed_dirs=[str(qwen3_adapters["alpha"])],
        # The sidecar trusts a /v1/models answer for long: an unload behind its back is
        # found by the leg's 404, not by a timely re-read (the last step of the test).
        sidecar_args=["--adapter-models-ttl-s", "600"],
        **SIDE_BY_SIDE,
    )
    t = Topology(spec)
    try:
        t.start(timeout_s=240)
        yield t
    finally:
        t.stop()
        if saved is None:
            os.environ.pop(RUNTIME, None)
        else:
            os.environ[RUNTIME] = saved


def models(url: str) -> dict[str, dict]:
    return {c["id"]: c for c in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}


def complete(url: str, model: str, prompt: list[int], **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json={**body, "ignore_eos": True, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def outcome(sidecar: str, name: str) -> float:
    return metric(sidecar, "pdpool_sidecar_adapter_prefill_total", f'outcome="{name}"')


def test_adapter_loaded_on_decode_only_is_loaded_on_the_prefill_leg(topo, qwen3_adapters):
    gateway = topo.gateway.url
    prefill, decode = topo.by_role("prefill")[0].url, topo.by_role("decode")[0].url
    sidecar = topo.by_role("sidecar")[0].url
    load = {"lora_name": "alpha", "lora_path": str(qwen3_adapters["alpha"])}
    assert httpx.post(f"{decode}/v1/load_lora_adapter", json=load, timeout=60).status_code == 200
    assert "alpha" in models(decode) and "alpha" not in models(prefill)
    rng = random.Random(7)
    base = next(c for c in models(decode).values() if not c.get("parent"))["id"]
    for round_, want_outcome in enumerate(("loaded", "resident")):
        prompt = [rng.randrange(3, 500) for _ in range(80)]
        legs0 = metric(sidecar, "pdpool_sidecar_legs_total", 'leg="prefill"')
        pulled0 = metric(decode, "pdpool_prompt_tokens_by_source_total", 'source="pulled"')
        seen0 = outcome(sidecar, want_outcome)
        got = complete(gateway, "alpha", prompt)
        assert got["model"] == "alpha"
        assert outcome(sidecar, want_outcome) == seen0 + 1, round_
        assert metric(sidecar, "pdpool_sidecar_legs_total", 'leg="prefill"') == legs0 + 1
        pulled = metric(decode, "pdpool_prompt_tokens_by_source_total", 'source="pulled"')
        assert pulled - pulled0 >= 64  # decode loaded the prefill's KV (same adapter)
        alone = complete(decode, "alpha", prompt, cache_hit_threshold=0)
        assert got["choices"][0]["text"] == alone["choices"][0]["text"]
        # ... which is the adapter's answer, not the base model's.
        fresh = [t + 1 for t in prompt]
        assert (
            complete(decode, "alpha", fresh, cache_hit_threshold=0)["choices"][0]["text"]
            != complete(decode, base, fresh, cache_hit_threshold=0)["choices"][0]["text"]
        )
    # The prefill engine now serves alpha from the decode engine's path.
    assert models(prefill)["alpha"]["root"] == models(decode)["alpha"]["root"]
    # Unloaded there behind the sidecar's back (its /v1/models answer is cached): the leg's
    # 404 is not the answer; decode serves alone, the same tokens.
    unload = {"lora_name": "alpha"}
    assert httpx.post(f"{prefill}/v1/unload_lora_adapter", json=unload, timeout=30).is_success
    prompt = [rng.randrange(3, 500) for _ in range(80)]
    missing0 = metric(sidecar, "pdpool_sidecar_prefill_attempts_total", 'outcome="adapter_missing"')
    got = complete(gateway, "alpha", prompt)
    missing = metric(sidecar, "pdpool_sidecar_prefill_attempts_total", 'outcome="adapter_missing"')
    assert missing == missing0 + 1
    alone = complete(decode, "alpha", prompt, cache_hit_threshold=0)
    assert got["choices"][0]["text"] == alone["choices"][0]["text"]


def test_a_path_outside_the_allowed_folders_is_never_loaded_decode_serves_alone(
    topo, qwen3_adapters
):
    gateway = topo.gateway.url
    prefill, decode = topo.by_role("prefill")[0].url, topo.by_role("decode")[0].url
    sidecar = topo.by_role("sidecar")[0].url
    load = {"lora_name": "beta", "lora_path": str(qwen3_adapters["beta"])}
    assert httpx.post(f"{decode}/v1/load_lora_adapter", json=load, timeout=60).status_code == 200
    prompt = [random.Random(11).randrange(3, 500) for _ in range(80)]
    legs0 = metric(sidecar, "pdpool_sidecar_legs_total", 'leg="prefill"')
    only0 = outcome(sidecar, "decode_only")
    got = complete(gateway, "beta", prompt)
    assert outcome(sidecar, "decode_only") == only0 + 1
    assert metric(sidecar, "pdpool_sidecar_legs_total", 'leg="prefill"') == legs0
    assert "beta" not in models(prefill)  # the untrusted path was not loaded there
    alone = complete(decode, "beta", prompt, cache_hit_threshold=0)
    assert got["model"] == "beta"
    assert got["choices"][0]["text"] == alone["choices"][0]["text"]
