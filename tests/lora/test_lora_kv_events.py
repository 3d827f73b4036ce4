"""KV cache events name the adapter a block was computed under, as vLLM 0.32 publishes
them (`lora_name`, `lora_id`, the name among the first block's extra keys), and adapter
blocks never share hashes with the base model's or another adapter's."""

from __future__ import annotations

import json
import time

import msgpack

from pdpool.engine.config import EngineConfig
from pdpool.engine.engine_core import LLMEngine
from pdpool.engine.lora.adapter_dir import read_adapter
from pdpool.engine.lora.registry import LoRARef
from pdpool.engine.sampling_params import SamplingParams
from pdpool.kv_events import BlockStored, KVEventBatch, KVEventSubscriber, encode_batch
from pdpool.ports import free_ports
from pdpool.sidecar.kv.index import request_block_keys
from pdpool.sidecar.routing.kv_cost import KVRouter
from tests.support.parity import random_prompts


def test_events_carry_the_adapter_and_hashes_differ(tiny_qwen3, qwen3_adapters):
    ports = free_ports(2)
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{ports[0]}",
        "replay_endpoint": f"tcp://*:{ports[1]}",
    }
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_qwen3),
            device="cpu",
            num_kv_blocks=64,
            enable_lora=True,
            max_loras=2,
            kv_events_config=json.dumps(events),
        )
    )
    refs = {}
    for i, name in enumerate(("alpha", "beta")):
        files = read_adapter(str(qwen3_adapters[name]), 16)
        refs[name] = LoRARef(name, i + 1, files.path, files.digest)
    sub = KVEventSubscriber(*(f"tcp://127.0.0.1:{p}" for p in ports))
    prompt = random_prompts(1, 48, 48, 500, seed=3)[0]
    try:
        time.sleep(0.3)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for name in (None, "alpha", "beta"):
            engine.add_request(f"r-{name}", prompt, params, lora=refs.get(name or ""))
            while engine.has_unfinished():
                engine.step()
        stored: list[BlockStored] = []
        router = KVRouter(block_size=16)
        index = router.index
        while (got := sub.recv(timeout_s=0.5)) is not None:
            stored += [e for e in got[1].events if isinstance(e, BlockStored)]
            index.on_message("e1", got[0], got[1])
    finally:
        sub.close()
        engine.close()
    by_adapter = {e.lora_name: e for e in stored if e.parent_block_hash is None}
    assert set(by_adapter) == {None, "alpha", "beta"}
    assert by_adapter[None].lora_id is None and by_adapter[None].extra_keys is None
    for name in ("alpha", "beta"):
        ev = by_adapter[name]
        assert ev.lora_id == refs[name].lora_id
        assert ev.extra_keys is not None and ev.extra_keys[0] == (name,)
        assert ev.token_ids == by_adapter[None].token_ids  # the same tokens...
    hashes = [bytes(by_adapter[n].block_hashes[0]) for n in (None, "alpha", "beta")]
    assert len(set(hashes)) == 3  # ...under three different names
    # The gateway's index keys a request by its `model` when it names an adapter the
    # engines published blocks under: each adapter hits its own blocks only.
    assert index.lora_names == {"alpha", "beta"}
    full = len(prompt) // 16
    for model in ("alpha", "beta", "base-model-name"):
        lora = model if model in index.lora_names else None
        keys = request_block_keys(prompt, 16, None, lora)
        assert index.prefix_hit_blocks("e1", keys) == full, model
    other = request_block_keys(prompt, 16, None, "gamma")  # an adapter never stored
    assert index.prefix_hit_blocks("e1", other) == 0
    decision = router.decide(["e0", "e1"], prompt, lambda b: 0.0, None, lambda b: True, "alpha")
    assert decision.precise and decision.order[0] == "e1"
    # On the wire: vLLM's field name.
    wire = msgpack.unpackb(encode_batch(KVEventBatch(0.0, [by_adapter["alpha"]])), raw=False)
    assert wire[1][0]["lora_name"] == "alpha" and wire[1][0]["lora_id"] == 1
