"""KV cache events in vLLM's format: a real engine publishes, a subscriber decodes, and the
gateway's index matches the engine's own prefix cache (store, evict, clear, restart, a
dropped message recovered by replay)."""

from __future__ import annotations

import json
import random
import time

import msgpack
import pytest

from pdpool.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventSubscriber,
    decode_batch,
    encode_batch,
    hash_key,
)
from pdpool.ports import free_ports
from pdpool.sidecar.kv.index import KVIndex, request_block_keys

torch = pytest.importorskip("torch")

BS = 16


def _engine(model, num_blocks=24, ports=None):
    from pdpool.engine.config import EngineConfig
    from pdpool.engine.engine_core import LLMEngine

    ports = ports or free_ports(2)
    cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{ports[0]}",
        "replay_endpoint": f"tcp://*:{ports[1]}",
        "buffer_steps": 1000,
    }
    eng = LLMEngine(
        EngineConfig(
            model=str(model),
            device="cpu",
            num_kv_blocks=num_blocks,
            block_size=BS,
            max_num_batched_tokens=256,
            kv_events_config=json.dumps(cfg),
        )
    )
    return eng, ports


def _run(engine, prompts, tag):
    from pdpool.engine.sampling_params import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(
            f"{tag}{i}", p, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        )
    while engine.has_unfinished():
        engine.step()


def _drain(sub, want_quiet=0.3):
    msgs = []
    while True:
        got = sub.recv(timeout_s=want_quiet)
        if got is None:
            return msgs
        msgs.append(got)


def _engine_keys(engine) -> set[int]:
    """What the engine really caches (group 0), as index keys."""
    return {hash_key(k[1:]) for k in engine.kv.pool._cached if k[0] == 0}


def test_wire_format_roundtrip_and_vllm_shapes():
    batch = KVEventBatch(
        1.5,
        [
            BlockStored(
                [b"\x01" * 32], None, list(range(16)), 16, None, "GPU", 0, "full_attention"
            ),
            BlockRemoved([b"\x01" * 32], "GPU", 0),
            AllBlocksCleared(),
        ],
        0,
    )
    raw = msgpack.unpackb(encode_batch(batch), raw=False)
    assert raw[0] == 1.5 and raw[2] == 0
    assert [e["type"] for e in raw[1]] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert decode_batch(encode_batch(batch)) == batch
    # Older vLLM: array-encoded events, tag first; int hashes (64-bit) key like bytes.
    old = msgpack.packb(
        [
            2.0,
            [
                ["BlockStored", [7], None, [1, 2], 2, None, "GPU"],
                ["BlockRemoved", [7], "GPU"],
                ["AllBlocksCleared"],
            ],
        ]
    )
    events = decode_batch(old).events
    assert isinstance(events[0], BlockStored) and events[0].block_hashes == [7]
    assert isinstance(events[1], BlockRemoved) and isinstance(events[2], AllBlocksCleared)
    digest = bytes(range(32))
    assert hash_key(digest) == hash_key(int.from_bytes(digest, "big") & (2**64 - 1))


def test_engine_events_keep_the_index_equal_to_the_cache(tiny_qwen3):
    engine, ports = _engine(tiny_qwen3)
    sub = KVEventSubscriber(*(f"tcp://127.0.0.1:{p}" for p in ports))
    index = KVIndex()
    try:
        time.sleep(0.3)  # PUB/SUB: let the subscription reach the publisher
        rng = random.Random(0)
        shared = [rng.randrange(3, 500) for _ in range(48)]
        prompts = [shared + [rng.randrange(3, 500) for _ in range(20)] for _ in range(3)]
        _run(engine, prompts, "a")
        msgs = _drain(sub)
        kinds = [type(e).__name__ for _, b in msgs for e in b.events]
        assert "BlockStored" in kinds
        # The stored hashes are exactly the request's chained hashes (the index recomputes).
        stored = [e for _, b in msgs for e in b.events if isinstance(e, BlockStored)]
        assert stored[0].parent_block_hash is None and stored[0].block_size == BS
        assert stored[0].token_ids == prompts[0][: BS * len(stored[0].block_hashes)]
        for seq, b in msgs:
            index.on_message("e1", seq, b, replay=sub.replay)
        assert set(index.engines["e1"].blocks) == _engine_keys(engine)
        keys = request_block_keys(prompts[0], BS)
        assert index.prefix_hit_blocks("e1", keys) == len(keys)

        # Evictions: 24 blocks, many new prompts -> BlockRemoved; a message is dropped and
        # recovered through the replay socket.
        # Two rounds, drained apart: at least two messages whatever the publisher batches.
        msgs = []
        for r in range(2):
            _run(engine, [[rng.randrange(3, 500) for _ in range(70)] for _ in range(3)], f"b{r}")
            msgs += _drain(sub)
        assert any(isinstance(e, BlockRemoved) for _, b in msgs for e in b.events)
        assert len(msgs) >= 2
        dropped = msgs[0][0]
        for seq, b in msgs:
            if seq != dropped:
                index.on_message("e1", seq, b, replay=sub.replay)
        st = index.engines["e1"]
        assert st.gaps == 1 and st.known
        assert set(st.blocks) == _engine_keys(engine)

        # A gap that cannot be replayed: unknown until AllBlocksCleared.
        _run(engine, [prompts[0]], "c")
        lost = _drain(sub)
        _run(engine, [[rng.randrange(3, 500) for _ in range(40)]], "d")
        for seq, b in _drain(sub):
            index.on_message("e1", seq, b, replay=lambda start: [])
        assert lost and not index.knows("e1")
        assert index.prefix_hit_blocks("e1", keys) is None
        assert engine.kv.pool.reset_prefix_cache()
        engine.kv.events.flush()
        for seq, b in _drain(sub):
            index.on_message("e1", seq, b)
        assert index.knows("e1") and index.block_count("e1") == 0 == len(_engine_keys(engine))
    finally:
        sub.close()
        engine.close()

    # Restart: a new engine on the same endpoint starts its sequence at 0 again.
    engine2, _ = _engine(tiny_qwen3, ports=ports)
    sub = KVEventSubscriber(*(f"tcp://127.0.0.1:{p}" for p in ports))
    try:
        time.sleep(0.3)
        _run(engine2, [prompts[1]], "r")
        msgs = _drain(sub)
        if msgs[0][0] != 0:  # the first message raced the subscription: fetch it
            msgs = sub.replay(0)
        for seq, b in msgs:
            index.on_message("e1", seq, b, replay=sub.replay)
        assert index.engines["e1"].restarts == 1
        assert set(index.engines["e1"].blocks) == _engine_keys(engine2)
    finally:
        sub.close()
        engine2.close()


def test_index_lru_cap_and_group_filter():
    index = KVIndex(max_blocks_per_engine=3)
    ev = BlockStored([1, 2, 3, 4], None, [], 1, None, "GPU", 0, "full_attention")
    index.on_message("e", 0, KVEventBatch(0.0, [ev]))
    assert set(index.engines["e"].blocks) == {2, 3, 4}
    # Events of another group (a sliding-window group) do not count for prefix hits.
    index.on_message(
        "e", 1, KVEventBatch(0.0, [BlockStored([9], 4, [], 1, None, "GPU", 1, "sliding_window")])
    )
    assert 9 not in index.engines["e"].blocks
    assert index.prefix_hit_blocks("e", [2, 3, 5]) == 2


def test_an_engine_with_its_own_block_names_is_indexed_under_ours():
    """A publisher that names blocks its own way (stock vLLM's seeded hashes): the index
    rebuilds our chained names from token ids, parents and the salt, so a request's own
    keys find them; removals by the engine's names still land."""
    rng = random.Random(7)
    prompt = [rng.randrange(3, 500) for _ in range(4 * BS)]
    salted = [rng.randrange(3, 500) for _ in range(2 * BS)]
    index = KVIndex()
    index.on_message(
        "vllm",
        0,
        KVEventBatch(
            0.0,
            [
                BlockStored([101, 102], None, prompt[: 2 * BS], BS, None, "GPU"),
                BlockStored([103, 104], 102, prompt[2 * BS :], BS, None, "GPU"),
                BlockStored(
                    [201, 202], None, salted, BS, None, "GPU", extra_keys=[("tenant-a",), None]
                ),
            ],
        ),
    )
    assert index.prefix_hit_blocks("vllm", request_block_keys(prompt, BS)) == 4
    assert index.prefix_hit_blocks("vllm", request_block_keys(salted, BS, "tenant-a")) == 2
    assert index.prefix_hit_blocks("vllm", request_block_keys(salted, BS, "tenant-b")) == 0
    assert index.prefix_hit_blocks("vllm", request_block_keys(salted, BS)) == 0
    index.on_message("vllm", 1, KVEventBatch(0.0, [BlockRemoved([103], "GPU")]))
    assert index.prefix_hit_blocks("vllm", request_block_keys(prompt, BS)) == 2
    # A run whose parent was never seen cannot be named by us: kept under the engine's name.
    index.on_message(
        "vllm", 2, KVEventBatch(0.0, [BlockStored([301], 999, prompt[:BS], BS, None, "GPU")])
    )
    assert 301 in index.engines["vllm"].blocks
    index.on_message("vllm", 3, KVEventBatch(0.0, [AllBlocksCleared()]))
    assert not index.engines["vllm"].blocks and not index.engines["vllm"].ours


def test_extra_keys_survive_the_wire():
    ev = BlockStored(
        [b"x" * 32], None, list(range(BS)), BS, None, "GPU", 0, "full_attention", [("salt",)]
    )
    back = decode_batch(encode_batch(KVEventBatch(1.0, [ev]))).events[0]
    assert back.extra_keys == [("salt",)] and back.block_hashes == [b"x" * 32]
