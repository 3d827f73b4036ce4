"""P/D with LoRA adapters, on real engine processes over real NIXL (loopback): a decode
engine loads a prefill engine's KV only when both computed it under the same adapter.
KV pulled under another adapter (or the base model) is refused by the lease's content
check and recomputed: the answer is always the decode request's own adapter's."""

from __future__ import annotations

import random

import httpx
import pytest

pytest.importorskip("nixl", reason="the nixl extra is not installed")

from tests.support.pd_router import connector_stat, decode_leg, engine_set, post, prefill_leg

pytestmark = pytest.mark.slow


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def body(model: str, prompt: list[int]) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engines(tiny_qwen3, qwen3_adapters, tmp_path_factory):
    lora = (
        "--enable-lora",
        "--max-loras",
        "2",
        "--lora-modules",
        f"alpha={qwen3_adapters['alpha']}",
        f"beta={qwen3_adapters['beta']}",
    )
    nixl = ("--kv-connector", "nixl", "--num-kv-blocks", "64")
    specs = {
        "P": (*nixl, "--kv-role", "producer", *lora),
        "D": (*nixl, "--kv-role", "consumer", *lora),
        "A": ("--num-kv-blocks", "64", *lora),  # one engine: the reference answers
    }
    with engine_set(tiny_qwen3, tmp_path_factory.mktemp("lora-pd"), specs) as procs:
        yield procs


def pulled(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["pdpool"]["pulled"]


def test_same_adapter_loads_the_prefill(engines):
    P, D, A = engines["P"], engines["D"], engines["A"]
    for i, model in enumerate(("alpha", "beta")):
        b = body(model, ids(70, seed=i))
        out = decode_leg(D.url, b, prefill_leg(P.url, b))
        assert out["choices"][0]["text"] == post(A.url, b)["choices"][0]["text"]
        assert pulled(out) == 69
        assert out["model"] == model


@pytest.mark.parametrize(
    "producer,consumer,seed", [("alpha", "beta", 11), ("alpha", None, 12), (None, "beta", 13)]
)
def test_kv_of_another_adapter_is_refused_and_recomputed(engines, producer, consumer, seed):
    P, D, A = engines["P"], engines["D"], engines["A"]
    base = httpx.get(f"{A.url}/v1/models", timeout=10).json()["data"][0]["id"]
    prompt = ids(70, seed=seed)
    kv = prefill_leg(P.url, body(producer or base, prompt))
    refused0 = connector_stat(D, "content_mismatches")
    pulled0 = connector_stat(D, "tokens_pulled")
    b = body(consumer or base, prompt)
    out = decode_leg(D.url, b, kv)
    assert out["choices"][0]["text"] == post(A.url, b)["choices"][0]["text"]
    assert pulled(out) == 0
    assert connector_stat(D, "tokens_pulled") == pulled0
    assert connector_stat(D, "content_mismatches") == refused0 + 1
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
