"""LoRA through P/D: `pdpool up` with the LoRA flags passed to every engine
(--engine-arg); cold prompts under each adapter go decode-first, are rejected, prefilled
remotely under the same adapter and loaded by the decode engine; the answers equal one
aggregated engine's under that adapter, and the decode engine pulled the prefill's KV."""

from __future__ import annotations

import random

import httpx
import pytest

from pdpool.up.topology import SIDE_BY_SIDE, Topology, TopologySpec
from tests.support.e2e_helpers import metric

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def topo(tiny_qwen3, qwen3_adapters, tmp_path_factory):
    lora = [
        "--enable-lora",
        "--max-loras=2",
        f"--lora-modules=alpha={qwen3_adapters['alpha']}",
        f"--lora-modules=beta={qwen3_adapters['beta']}",
    ]
    spec = TopologySpec(
        model=str(tiny_qwen3),
        prefill=1,
        decode=1,
        cache_hit_threshold=0.5,
        log_dir=str(tmp_path_factory.mktemp("lora-up")),
        engine_args=["--num-kv-blocks", "256", *lora],
        **SIDE_BY_SIDE,
    )
    t = Topology(spec)
    t.start(timeout_s=240)
    try:
        yield t
    finally:
        t.stop()


def complete(url: str, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json={**body, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_adapters_through_pd_equal_one_engine(topo):
    gateway = topo.gateway.url
    prefill, decode = topo.by_role("prefill")[0].url, topo.by_role("decode")[0].url
    sidecar = topo.by_role("sidecar")[0].url
    base = httpx.get(f"{prefill}/v1/models", timeout=10).json()["data"][0]["id"]
    rng = random.Random(4)
    texts = set()
    for model in ("alpha", "beta", base):
        prompt = [rng.randrange(3, 500) for _ in range(80)]
        legs0 = metric(sidecar, "pdpool_sidecar_legs_total", 'leg="prefill"')
        pulled0 = metric(decode, "pdpool_prompt_tokens_by_source_total", 'source="pulled"')
        got = complete(gateway, model, prompt)
        want = complete(prefill, model, prompt)["choices"][0]["text"]
        assert got["choices"][0]["text"] == want, model
        assert got["model"] == model
        assert metric(sidecar, "pdpool_sidecar_legs_total", 'leg="prefill"') == legs0 + 1
        pulled = metric(decode, "pdpool_prompt_tokens_by_source_total", 'source="pulled"')
        assert pulled - pulled0 >= 64, model  # the decode engine loaded the prefill's KV
        texts.add(want)
    assert len(texts) == 3  # the adapters answer differently from the base model
