"""vLLM's own KV-events publisher (vllm.distributed.kv_events, run in the vLLM venv) read
by our subscriber, decoder and index: live PUB messages, replay, bytes and int hashes.
Skipped with the reason when the vLLM venv is missing (conftest.py)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from pdpool.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventSubscriber
from pdpool.ports import free_port
from pdpool.sidecar.kv.engine_tokenize import token_ids_of, tokenize_body
from pdpool.sidecar.kv.index import KVIndex, request_block_keys
from pdpool.up.topology import VLLM_ARGS, VLLM_ENV, served_model_name
from devtools.engine_procs import wait_healthy

PUBLISHER = textwrap.dedent("""
    import sys, time
    from vllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                            KVEventBatch, ZmqEventPublisher)
    pub = ZmqEventPublisher(0, endpoint=sys.argv[1], replay_endpoint=sys.argv[2])
    time.sleep(1.0)   # let the subscriber connect
    h1, h2 = bytes(range(32)), bytes(range(1, 33))
    pub.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=[h1, h2], parent_block_hash=None, token_ids=list(range(32)),
        block_size=16, lora_id=None, medium="GPU", lora_name=None)]))
    pub.publish(KVEventBatch(ts=time.time(), events=[
        BlockRemoved(block_hashes=[h2], medium="GPU"),
        BlockStored(block_hashes=[12345], parent_block_hash=h1, token_ids=list(range(16)),
                    block_size=16, lora_id=None, medium="GPU", lora_name=None),
        BlockStored(block_hashes=[777], parent_block_hash=None, token_ids=list(range(16)),
                    block_size=16, lora_id=None, medium="GPU", lora_name=None,
                    extra_keys=[("tenant-a",)])]))
    pub.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
    time.sleep(3.0)   # serve the replay request
    pub.shutdown()
""")


def test_vllm_publisher_is_decoded_and_indexed(tmp_path, vllm_bin):
    port, replay = free_port(), free_port()
    script = tmp_path / "pub.py"
    script.write_text(PUBLISHER)
    proc = subprocess.Popen(
        [
            str(Path(vllm_bin).parent / "python"),
            str(script),
            f"tcp://*:{port}",
            f"tcp://*:{replay}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
    try:
        got = []
        deadline = time.monotonic() + 90
        while len(got) < 3 and time.monotonic() < deadline and proc.poll() is None:
            msg = sub.recv(timeout_s=0.5)
            if msg is not None:
                got.append(msg)
        assert len(got) == 3, proc.stdout.read().decode()[-3000:] if proc.poll() else got
        assert [s for s, _ in got] == [0, 1, 2]
        first = got[0][1].events[0]
        assert isinstance(first, BlockStored) and first.block_size == 16
        assert first.block_hashes == [bytes(range(32)), bytes(range(1, 33))]
        assert isinstance(got[1][1].events[0], BlockRemoved)
        assert isinstance(got[2][1].events[0], AllBlocksCleared)

        index = KVIndex()
        for seq, batch in got[:2]:
            index.on_message("vllm", seq, batch)
        # Indexed under our names for the same tokens, whatever vLLM called the blocks.
        first_two = list(range(32))
        assert index.prefix_hit_blocks("vllm", request_block_keys(first_two, 16)) == 1
        assert index.prefix_hit_blocks("vllm", request_block_keys(first_two[:16] * 2, 16)) == 2
        assert index.prefix_hit_blocks("vllm", request_block_keys(first_two, 16, "s")) == 0
        salted = got[1][1].events[2]
        assert salted.extra_keys == [("tenant-a",)]
        index.on_message("vllm", 2, got[2][1])
        assert not index.engines["vllm"].blocks
        assert [s for s, _ in sub.replay(1)] == [1, 2]
    finally:
        sub.close()
        proc.wait(30)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_real_vllm_engines_events_find_a_prompt_by_our_names(tmp_path, vllm_bin, tiny_qwen3):
    """`vllm serve` with --kv-events-config names blocks by its own seeded hashes; the
    index, fed by its live events, finds a prompt's full blocks by the keys the gateway
    computes for that prompt."""
    port, pub, replay = free_port(), free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
    }
    name = served_model_name(str(tiny_qwen3))
    log = tmp_path / "vllm.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [
                vllm_bin,
                "serve",
                str(tiny_qwen3),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--served-model-name",
                name,
                *VLLM_ARGS,
                "--kv-events-config",
                json.dumps(config),
            ],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, **VLLM_ENV},
            start_new_session=True,
        )
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=600, log=log)
        rng = random.Random(3)
        prompts = [[rng.randrange(3, 500) for _ in range(300)] for _ in range(3)]
        words = ["river", "stone", "bright", "quiet", "market", "window", "seven"]
        system = " ".join(rng.choice(words) for _ in range(300))
        chat = {"model": name, "messages": [{"role": "system", "content": system}]}
        chat["messages"].append({"role": "user", "content": "and then?"})
        index, sizes = KVIndex(), set()
        # The chat first: a step's events leave with the next step's output.
        requests = [("/v1/chat/completions", chat)] + [
            ("/v1/completions", {"model": name, "prompt": prompt}) for prompt in prompts
        ]
        for path, body in requests:
            r = httpx.post(
                f"{url}{path}", timeout=120, json={**body, "max_tokens": 2, "temperature": 0}
            )
            assert r.status_code == 200, r.text
            while (msg := sub.recv(timeout_s=1.0)) is not None:
                index.on_message("vllm", msg[0], msg[1], replay=sub.replay)
                sizes |= {e.block_size for e in msg[1].events if isinstance(e, BlockStored)}
        assert len(sizes) == 1, f"no BlockStored from vLLM (sizes {sizes}); log: {log}"
        block_size = sizes.pop()
        # A chat, as the gateway sees it: ids from vLLM's /tokenize (engine_tokenize.py).
        r = httpx.post(f"{url}/tokenize", json=tokenize_body(chat), timeout=30)
        chat_ids = token_ids_of(r.json(), chat)
        assert chat_ids is not None and len(chat_ids) > 2 * block_size, r.text
        for prompt in [chat_ids, *prompts[:2]]:
            keys = request_block_keys(prompt, block_size)
            assert keys and index.prefix_hit_blocks("vllm", keys) == len(keys)
            assert (
                index.prefix_hit_blocks(
                    "vllm", request_block_keys(prompt, block_size, "other-tenant")
                )
                == 0
            )
    finally:
        sub.close()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
