"""vLLM's own KV-events publisher (vllm.distributed.kv_events, run in the vLLM venv) read
by our subscriber, decoder and index: live PUB messages, replay, bytes and int hashes.
Skipped with the reason when the vLLM venv is missing (conftest.py)."""
from __future__ import annotations

import subprocess
import textwrap
import time
from pathlib import Path

from pdpool.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventSubscriber,
                              hash_key)
from pdpool.sidecar.kv_index import KVIndex
from tests.engine_procs import free_port

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
                    block_size=16, lora_id=None, medium="GPU", lora_name=None)]))
    pub.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
    time.sleep(3.0)   # serve the replay request
    pub.shutdown()
""")


def test_vllm_publisher_is_decoded_and_indexed(tmp_path, vllm_bin):
    port, replay = free_port(), free_port()
    script = tmp_path / "pub.py"
    script.write_text(PUBLISHER)
    proc = subprocess.Popen([str(Path(vllm_bin).parent / "python"), str(script),
                             f"tcp://*:{port}", f"tcp://*:{replay}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
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
        assert set(index.engines["vllm"].blocks) == {hash_key(bytes(range(32))), 12345}
        assert [s for s, _ in sub.replay(1)] == [1, 2]
    finally:
        sub.close()
        proc.wait(30)
