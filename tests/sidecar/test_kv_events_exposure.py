"""Where KV events go: a publisher bound to one address listens there only (vLLM's rule
would connect instead), and one configured without token ids publishes hashes that the
router's index still matches against a request's prompt, while the prompt's tokens never
leave the engine."""

from __future__ import annotations

import json
import os
import random
import time

import msgpack
import pytest

from pdpool.kv_events import (
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    KVEventsConfig,
    KVEventSubscriber,
)
from pdpool.ports import free_ports
from pdpool.sidecar.kv.index import KVIndex, request_block_keys
from tests.support.listeners import listeners

BS = 16


def _config(ports, host="127.0.0.1", **extra):
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://{host}:{ports[0]}",
        "replay_endpoint": f"tcp://{host}:{ports[1]}",
        "buffer_steps": 1000,
        **extra,
    }


def _mine(ports):
    return [s for s in listeners({os.getpid()}) if s.port in ports]


def test_bind_listens_on_the_named_address_only_and_replays():
    ports = free_ports(2)
    pub = KVEventPublisher(KVEventsConfig.parse(_config(ports, bind=True)))
    sub = KVEventSubscriber(*(f"tcp://127.0.0.1:{p}" for p in ports))
    try:
        assert sorted((s.address, s.port) for s in _mine(ports)) == sorted(
            ("127.0.0.1", p) for p in ports
        )
        time.sleep(0.3)  # PUB/SUB: let the subscription reach the publisher
        pub.record(BlockStored([b"h" * 32], None, list(range(BS)), BS))
        pub.flush()
        got = sub.recv(timeout_s=3)
        assert got is not None and isinstance(got[1].events[0], BlockStored)
        assert [s for s, _ in sub.replay(0)] == [0]
    finally:
        sub.close()
        pub.close()


def test_without_bind_an_address_is_connected_to_as_vllm_does_but_replay_binds():
    ports = free_ports(2)
    pub = KVEventPublisher(KVEventsConfig.parse(_config(ports)))
    try:
        # vLLM's PUB connects to a non-wildcard endpoint; its ROUTER always binds.
        assert [(s.address, s.port) for s in _mine(ports)] == [("127.0.0.1", ports[1])]
    finally:
        pub.close()


def test_ipv6_loopback_binds():
    ports = free_ports(2)
    pub = KVEventPublisher(KVEventsConfig.parse(_config(ports, host="[::1]", bind=True)))
    try:
        assert sorted(s.address for s in _mine(ports)) == ["::1", "::1"]
    finally:
        pub.close()


def test_config_refuses_non_booleans():
    for key in ("bind", "token_ids"):
        with pytest.raises(ValueError, match="true or false"):
            KVEventsConfig.parse(_config(free_ports(2), **{key: "yes"}))


def test_without_token_ids_the_wire_keeps_the_field_empty():
    ports = free_ports(2)
    pub = KVEventPublisher(KVEventsConfig.parse(_config(ports, bind=True, token_ids=False)))
    sub = KVEventSubscriber(*(f"tcp://127.0.0.1:{p}" for p in ports))
    try:
        time.sleep(0.3)
        pub.record(BlockStored([b"h" * 32], None, list(range(BS)), BS))
        pub.flush()
        assert sub.recv(timeout_s=3) is not None
        ((_, payload),) = list(pub._buffer)
        (event,) = msgpack.unpackb(payload, raw=False)[1]
        # vLLM's BlockStored always has token_ids: present, empty.
        assert event["token_ids"] == [] and event["block_hashes"] == [b"h" * 32]
    finally:
        sub.close()
        pub.close()


def test_a_real_engine_without_token_ids_is_indexed_as_well(tiny_qwen3):
    pytest.importorskip("torch")
    from pdpool.engine.config import EngineConfig
    from pdpool.engine.engine_core import LLMEngine
    from pdpool.engine.sampling_params import SamplingParams

    ports = free_ports(2)
    cfg = _config(ports, bind=True, token_ids=False)
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_qwen3),
            device="cpu",
            num_kv_blocks=24,
            block_size=BS,
            max_num_batched_tokens=256,
            kv_events_config=json.dumps(cfg),
        )
    )
    sub = KVEventSubscriber(*(f"tcp://127.0.0.1:{p}" for p in ports))
    index = KVIndex()
    try:
        assert all(s.loopback for s in _mine(ports)) and len(_mine(ports)) == 2
        time.sleep(0.3)
        rng = random.Random(3)
        prompt = [rng.randrange(3, 500) for _ in range(70)]
        engine.add_request("a", prompt, SamplingParams(max_tokens=2, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
        msgs: list[tuple[int, KVEventBatch]] = []
        while (got := sub.recv(timeout_s=0.5)) is not None:
            msgs.append(got)
        stored = [e for _, b in msgs for e in b.events if isinstance(e, BlockStored)]
        assert stored and all(e.token_ids == [] for e in stored)
        for seq, batch in msgs:
            index.on_message("e1", seq, batch, replay=sub.replay)
        keys = request_block_keys(prompt, BS)
        assert len(keys) == 4 and index.prefix_hit_blocks("e1", keys) == len(keys)
    finally:
        sub.close()
        engine.close()
