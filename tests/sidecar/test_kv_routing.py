"""Precise routing from real engines' KV events: the router picks the engine holding the
longest prefix, and its up-front P/D decision equals the engine's own threshold decision."""

from __future__ import annotations

import json
import random
import time

import pytest

from pdpool.ports import free_ports
from pdpool.sidecar.routing.kv_cost import KVRouter

pytest.importorskip("torch")

BS = 16


def _engine(model, ports):
    from pdpool.engine.config import EngineConfig
    from pdpool.engine.engine_core import LLMEngine

    cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{ports[0]}",
        "replay_endpoint": f"tcp://*:{ports[1]}",
    }
    return LLMEngine(
        EngineConfig(
            model=str(model),
            device="cpu",
            num_kv_blocks=64,
            block_size=BS,
            max_num_batched_tokens=256,
            kv_events_config=json.dumps(cfg),
        )
    )


def _run(engine, rid, prompt, threshold=None):
    from pdpool.engine.sampling_params import SamplingParams

    engine.add_request(
        rid,
        prompt,
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        cache_hit_threshold=threshold,
    )
    reason = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                reason = out.finish_reason
    return reason


def _synced(router, name, engine, timeout=5.0):
    want = {k[1:] for k in engine.kv.pool._cached if k[0] == 0}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if router.index.knows(name) and router.index.block_count(name) == len(want):
            return
        time.sleep(0.02)
    raise AssertionError(f"index of {name} not in sync")


def test_routes_to_the_longest_prefix_and_predicts_the_engines_threshold(tiny_qwen3):
    free = free_ports(4)
    ports = {"a": free[:2], "b": free[2:]}
    engines = {n: _engine(tiny_qwen3, p) for n, p in ports.items()}
    threshold = 0.5
    # expect_s=0: every decision is judged against what the engines have really stored
    # (a rejected request stores nothing, so an expectation would outlive it here).
    router = KVRouter(
        block_size=BS,
        threshold=threshold,
        expect_s=0.0,
        tokenizer_file=str(tiny_qwen3 / "tokenizer.json"),
    )
    for n, p in ports.items():
        router.subscribe(n, *(f"tcp://127.0.0.1:{x}" for x in p))
    try:
        time.sleep(0.3)
        rng = random.Random(1)
        docs = {n: [rng.randrange(3, 500) for _ in range(80)] for n in engines}
        for n, eng in engines.items():
            _run(eng, f"warm-{n}", docs[n])
            _synced(router, n, eng)
        order = ["a", "b"]
        idle = lambda b: 0  # noqa: E731
        for n in engines:
            d = router.decide(order, docs[n] + [7, 8, 9], idle)
            assert d.precise and d.order[0] == n and d.hit_tokens == 80
        # Load moves a short hit elsewhere: cost = uncached + 64 per in-flight request.
        d = router.decide(order, docs["a"][:20] + [1] * 40, lambda b: 1 if b == "a" else 0)
        assert d.order[0] == "b"

        # A workload of partial overlaps: the router decides the path before sending; the
        # engine then judges the same request against the same threshold.
        agree, total = 0, 0
        for i in range(16):
            base = docs[rng.choice("ab")]
            keep = rng.randrange(0, 81)
            prompt = base[:keep] + [rng.randrange(3, 500) for _ in range(rng.randint(8, 60))]
            d = router.decide(order, prompt, idle)
            name = d.order[0]
            reason = _run(engines[name], f"w{i}", prompt, threshold)
            engine_pd = reason == "cache_threshold"
            agree += (d.path == "pd") == engine_pd
            total += 1
            _synced(router, name, engines[name])
        print(f"up-front P/D decision agreed with the engine on {agree}/{total}")
        assert agree == total
    finally:
        router.close()
        for eng in engines.values():
            eng.close()


def test_no_events_keeps_affinity_order():
    router = KVRouter(block_size=BS)
    d = router.decide(["x", "y"], list(range(40)), lambda b: 0)
    assert not d.precise and d.order == ["x", "y"] and d.path == "decode"
    assert router.prompt_token_ids({"messages": []}) is None
    assert router.prompt_token_ids({"prompt": [1, 2, 3]}) == [1, 2, 3]


def test_the_router_hashes_the_prompt_the_engine_keeps():
    router = KVRouter(block_size=BS)
    ids = list(range(3, 43))
    assert router.prompt_token_ids({"prompt": ids, "truncate_prompt_tokens": 5}) == ids[-5:]
    right = {"prompt": ids, "truncate_prompt_tokens": 5, "truncation_side": "right"}
    assert router.prompt_token_ids(right) == ids[:5]
    # -1 is the engine's context, which a router does not know; junk is the engine's to refuse.
    for keep in (-1, "5", True, None):
        assert router.prompt_token_ids({"prompt": ids, "truncate_prompt_tokens": keep}) == ids


def test_a_burst_on_a_new_prefix_goes_to_one_engine():
    """Before any engine has reported a new prefix, the requests already routed with it
    count as held where they went: a burst sharing it is not scattered by load."""
    from pdpool.kv_events import AllBlocksCleared, BlockRemoved, KVEventBatch
    from pdpool.sidecar.kv.index import request_block_keys

    router = KVRouter(block_size=BS, load_cost_tokens=8.0, expect_s=60.0)
    for n in ("a", "b", "c"):
        router.index.on_message(n, 0, KVEventBatch(0.0, [AllBlocksCleared()]))
    rng = random.Random(4)
    system = [rng.randrange(3, 500) for _ in range(160)]
    in_flight = {"a": 0, "b": 0, "c": 0}
    chosen = []
    for _ in range(6):
        d = router.decide(
            ["a", "b", "c"], system + [rng.randrange(3, 500) for _ in range(20)], in_flight.get
        )
        chosen.append(d.order[0])
        in_flight[d.order[0]] += 1
    assert len(set(chosen)) == 1 and chosen[0] == "a", chosen
    # The engine evicts one of those blocks: the expectation goes with it.
    keys = request_block_keys(system, BS)
    router.index.on_message("a", 1, KVEventBatch(0.0, [BlockRemoved([keys[0]], "GPU")]))
    assert router.index.prefix_hit_blocks("a", keys) == 0
    # Unconfirmed expectations lapse.
    lapsing = KVRouter(block_size=BS, expect_s=0.05)
    lapsing.index.on_message("a", 0, KVEventBatch(0.0, [AllBlocksCleared()]))
    lapsing.decide(["a"], system, lambda b: 0)
    assert lapsing.index.prefix_hit_blocks("a", keys) == len(keys)
    assert lapsing.index.pending_blocks("a") == len(keys)
    time.sleep(0.1)
    assert lapsing.index.prefix_hit_blocks("a", keys) == 0
    assert lapsing.index.pending_blocks("a") == 0  # nor is it queued work any more


def _cleared_router(names, **kw):
    from pdpool.kv_events import AllBlocksCleared, KVEventBatch

    router = KVRouter(block_size=BS, expect_s=60.0, **kw)
    for n in names:
        router.index.on_message(n, 0, KVEventBatch(0.0, [AllBlocksCleared()]))
    return router


def test_queued_prefill_work_counts_as_load():
    """Two engines with one request in flight each: the one whose request still has a long
    prefill ahead (routed, not yet reported stored) is the busier one, and a new prompt
    goes to the other; a request count alone would call them equal."""
    rng = random.Random(5)
    long_doc = [rng.randrange(3, 500) for _ in range(1024)]
    short = [rng.randrange(3, 500) for _ in range(40)]
    router = _cleared_router(["a", "b"])
    one_each = lambda b: 1  # noqa: E731
    assert router.decide(["a"], long_doc, one_each).order == ["a"]
    assert router.decide(["b"], short, one_each).order == ["b"]
    assert router.index.pending_blocks("a") == 64 and router.index.pending_blocks("b") == 2
    new = [rng.randrange(3, 500) for _ in range(300)]
    assert router.decide(["a", "b"], new, one_each).order[0] == "b"


def test_pending_work_a_request_shares_is_not_its_load():
    """A request whose prefix is still being computed on an engine waits for it there
    rather than computing it again elsewhere; once the engine reports the blocks stored they
    are cached, no longer pending."""
    from pdpool.block_hash import chain_hashes
    from pdpool.kv_events import BlockStored, KVEventBatch

    rng = random.Random(6)
    system = [rng.randrange(3, 500) for _ in range(1024)]
    router = _cleared_router(["a", "b"])
    idle = lambda b: 0  # noqa: E731
    assert router.decide(["a", "b"], system + [5] * 20, idle).order[0] == "a"
    d = router.decide(["b", "a"], system + [6] * 20, idle)
    assert d.order[0] == "a" and d.hit_tokens == 1024
    assert router.index.pending_blocks("a") == 64 + 1 + 1
    stored = BlockStored(chain_hashes(system, BS), None, [], BS, None, "GPU", 0, "full_attention")
    router.index.on_message("a", 1, KVEventBatch(0.0, [stored]))
    assert router.index.pending_blocks("a") == 2
