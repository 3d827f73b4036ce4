"""Routing knows the tiers: real engines publish their tier's blocks with vLLM's `medium`
(STORAGE) and locality (LOCAL for a disk of their own, REMOTE for the pool's shared
directory); the gateway's KV index keeps them apart from pool blocks, prices a tier hit
between a pool hit and a recompute, and counts a shared-tier prefix for every engine that
mounts it."""

from __future__ import annotations

import json
import random
import time

import pytest

from pdpool.kv_events import BlockRemoved, BlockStored, KVEventBatch
from pdpool.ports import free_ports
from pdpool.sidecar.kv.index import request_block_keys
from pdpool.sidecar.routing.kv_cost import KVRouter

BS = 16


@pytest.fixture(autouse=True)
def _pool_secret(monkeypatch):
    """The shared tier needs the pool's secret (engines inherit it from the environment)."""
    monkeypatch.setenv("PDPOOL_KV_SECRET", "pool-secret-" + "p" * 32)


def _engine(model, tier, backend):
    from pdpool.engine.config import EngineConfig
    from pdpool.engine.engine_core import LLMEngine

    ports = free_ports(2)
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{ports[0]}",
        "replay_endpoint": f"tcp://*:{ports[1]}",
    }
    engine = LLMEngine(
        EngineConfig(
            model=str(model),
            device="cpu",
            num_kv_blocks=24,
            max_num_batched_tokens=64,
            kv_events_config=json.dumps(events),
            kv_offloading_size=0.05,
            kv_offloading_path=str(tier),
            kv_offloading_backend=backend,
        )
    )
    return engine, ports


def _run(engine, prompt):
    from pdpool.engine.sampling_params import SamplingParams

    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    deadline = time.monotonic() + 10
    while engine.offload._saving:  # the tier's writes (and their events) land
        assert time.monotonic() < deadline
        engine.idle_tick()
        time.sleep(0.005)


def _prompt(seed, n=150):
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "the index did not catch up"
        time.sleep(0.02)


@pytest.mark.slow  # engines publishing over ZeroMQ, read by the router's subscribers
def test_tier_blocks_route_as_loads_and_shared_ones_for_every_engine(tiny_qwen3, tmp_path):
    shared = tmp_path / "shared"
    a, a_ports = _engine(tiny_qwen3, shared, "shared")
    b, b_ports = _engine(tiny_qwen3, shared, "shared")
    c, c_ports = _engine(tiny_qwen3, tmp_path / "c-disk", "disk")
    router = KVRouter(block_size=BS, threshold=0.5, load_cost_tokens=1.0)
    try:
        for name, ports in (("a", a_ports), ("b", b_ports), ("c", c_ports)):
            router.subscribe(name, f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}")
        time.sleep(0.5)  # the subscriptions settle (the replay covers anything earlier)
        mine = _prompt(1)
        _run(b, _prompt(2))  # b writes to the shared tier too: it mounts it
        _run(a, mine)  # a's pool and the shared tier hold `mine`
        _run(c, mine)  # c's own disk tier holds it too
        for other in (3, 4, 5):  # then both pools move on: 24 blocks hold one prompt
            _run(a, _prompt(other))
            _run(c, _prompt(other))
        keys = request_block_keys(mine, BS)
        idx = router.index
        _wait(lambda: idx.prefix_hit_blocks("a", keys) == 0)
        _wait(lambda: idx.prefix_hit_blocks("c", keys) == 0)
        _wait(lambda: idx.tier_hit_blocks("c", keys, 0) == len(keys))
        for name in ("a", "b"):  # the shared tier counts for both engines that mount it
            _wait(lambda n=name: idx.tier_hit_blocks(n, keys, 0) == len(keys))
        assert idx.shared_tier and not idx.engines["a"].tier
        # A tier hit is a load: preferred over a recompute, and it counts as cached for
        # the P/D decision (the engine loads it rather than sending it to prefill).
        fresh = _prompt(9)
        _run(a, fresh)  # only a's pool holds `fresh`
        d = router.decide(["b", "c", "a"], [*mine, 7, 8, 9], lambda e: 0)
        assert d.path == "decode" and d.hit_tokens == len(keys) * BS
        # A pool hit is still cheaper than a tier load.
        d = router.decide(["b", "c", "a"], [*fresh, 7], lambda e: 0)
        assert d.order[0] == "a"
    finally:
        router.close()
        for e in (a, b, c):
            e.close()
            if e.kv_events is not None:
                e.kv_events.close()


def test_index_keeps_tier_and_pool_apart():
    """Pure: a pool eviction leaves the tier's copy, a tier eviction the pool's; an engine
    that never wrote to the shared tier does not count it."""
    router = KVRouter(block_size=BS, threshold=0.5, load_cost_tokens=0.0)
    idx = router.index
    prompt = _prompt(7, 64)
    keys = request_block_keys(prompt, BS)
    from pdpool.block_hash import chain_hashes

    hashes = chain_hashes(prompt, BS)

    def stored(medium, locality=None):
        return BlockStored(
            hashes, None, prompt, BS, None, medium, 0, "full_attention", locality=locality
        )

    idx.on_message("x", 0, KVEventBatch(0.0, [stored("GPU"), stored("STORAGE", "LOCAL")]))
    idx.on_message("x", 1, KVEventBatch(0.0, [BlockRemoved(hashes, "GPU", 0)]))
    assert idx.prefix_hit_blocks("x", keys) == 0 and idx.tier_hit_blocks("x", keys, 0) == 4
    idx.on_message(
        "x", 2, KVEventBatch(0.0, [stored("GPU"), BlockRemoved(hashes, "STORAGE", 0, "LOCAL")])
    )
    assert idx.prefix_hit_blocks("x", keys) == 4 and idx.tier_hit_blocks("x", keys, 0) == 0
    idx.on_message("y", 0, KVEventBatch(0.0, [stored("STORAGE", "REMOTE")]))
    idx.on_message("z", 0, KVEventBatch(0.0, [stored("GPU")]))
    idx.on_message("z", 1, KVEventBatch(0.0, [BlockRemoved(hashes, "GPU", 0)]))
    assert idx.tier_hit_blocks("y", keys, 0) == 4 and idx.tier_hit_blocks("z", keys, 0) == 0
    # Costs: pool hit (x) < tier load (y) < recompute (z).
    d = router.decide(["z", "y", "x"], [*prompt, 1, 2, 3], lambda e: 0)
    assert d.order == ["x", "y", "z"]
    d = router.decide(["z", "y"], [*prompt, 1, 2, 3], lambda e: 0)
    assert d.order == ["y", "z"] and d.path == "decode" and d.hit_tokens == 64
    with pytest.raises(ValueError):
        KVRouter(block_size=BS, tier_cost=1.5)
