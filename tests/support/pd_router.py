"""The router's part of a P/D exchange, done by hand for engine-level tests: a prefill leg,
then a decode leg with the prefill's kv_transfer_params (what the sidecar automates)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from devtools.engine_procs import SpawnedEngine, connector_stat

__all__ = ["connector_stat"]  # the engine-level tests take it from here with the legs


def post(url: str, body: dict, timeout: float = 120.0) -> dict:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def prefill_leg(prefill_url: str, body: dict, extra_params: dict | None = None) -> dict:
    params = {"do_remote_decode": True, **(extra_params or {})}
    out = post(
        prefill_url, {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": params}
    )
    kv = out["kv_transfer_params"]
    assert kv and kv["do_remote_prefill"] is True, out
    return kv


def decode_leg(decode_url: str, body: dict, kv_params: dict) -> dict:
    return post(decode_url, {**body, "kv_transfer_params": kv_params, "cache_hit_threshold": 0.0})


def text_of(resp: dict) -> str:
    return resp["choices"][0]["text"]


def wait_no_blocks(*engs, timeout=15.0) -> None:
    """Until no KV block is in use on any of the engines (AssertionError after `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(e.metric("pdpool_kv_blocks_used") == 0 for e in engs):
            return
        time.sleep(0.2)
    used = {e.url: e.metric("pdpool_kv_blocks_used") for e in engs}
    raise AssertionError(f"blocks still in use: {used}")


@contextmanager
def engine_set(model: Path, logs: Path, specs: dict[str, tuple]):
    """Starts one engine process per name (flags as given), all at once; stops them all."""
    procs = {name: SpawnedEngine(model, logs, *flags) for name, flags in specs.items()}
    try:
        for p in procs.values():
            p.wait()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def unsigned_lease(
    prompt: list[int],
    num_tokens: int | None = None,
    lease_id: str = "forged",
    epoch: str = "forged-epoch",
    block_size: int = 16,
) -> dict:
    """A well-formed, unsigned `pdpool_lease` over `prompt`'s first tokens, as a forger who
    knows the prompt could write it: right prefix hash, made-up lease id and epoch."""
    from pdpool.engine.kv.hashing import BlockHasher, prefix_hash

    n = len(prompt) if num_tokens is None else num_tokens
    hashes = BlockHasher(block_size).hash_blocks(prompt, [], len(prompt) // block_size)
    return {
        "id": lease_id,
        "epoch": epoch,
        "num_tokens": n,
        "hash": prefix_hash(prompt, hashes, n, block_size).hex(),
        "expires_ms": int((time.time() + 3600) * 1000),
    }
