"""An engine-like peer in its own OS process, for the multi-process transport tests.

It owns a real NixlTransport with two regions filled with a known pattern, serves its
handshake on an ephemeral loopback port, and obeys commands sent over a Pipe. It is the
same code an engine runs, minus the model.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time

NUM_BLOCKS = 16
BLOCK_SHAPE = (2, 3, 4, 64)  # (layers, k/v, block_size, head elems): 12 KiB of int64
NUM_SLOTS = 4
STATE_SHAPE = (5, 32)


def layout(block_size: int = 4) -> dict:
    return {
        "model": "tiny-test",
        "dtype": "int64",
        "block_size": block_size,
        "kv_layout": "blocks,layers,kv,tokens,heads*dim",
        "num_layers": 2,
        "num_kv_heads": 1,
        "head_dim": 64,
    }


def pattern(seed: int, region: str):
    """What region `region` of the peer started with `seed` holds: unique per element."""
    import torch

    shape = (NUM_BLOCKS, *BLOCK_SHAPE) if region == "kv" else (NUM_SLOTS, *STATE_SHAPE)
    base = seed * 10**9 + (0 if region == "kv" else 5 * 10**8)
    n = 1
    for s in shape:
        n *= s
    return torch.arange(base, base + n, dtype=torch.int64).reshape(shape)


def _serve(conn, engine_id: str, seed: int):
    from pdpool.engine.connector.allowlist import parse_allowlist
    from pdpool.engine.connector.handshake import HandshakeServer, document_for
    from pdpool.engine.connector.nixl_transport import NixlTransport, TransferState
    from pdpool.engine.connector.peering import connect_peer

    transport = NixlTransport(engine_id)
    kv, state = pattern(seed, "kv"), pattern(seed, "state")
    transport.register_region("kv", kv)
    transport.register_region("state", state)
    server = HandshakeServer(document_for(transport, layout()), host="127.0.0.1", port=0)
    conn.send(("ready", server.port, transport.agent_name))
    inbox = []
    try:
        while True:
            inbox.extend((n.peer, n.message) for n in transport.notifications())
            if not conn.poll(0.005):
                continue
            cmd, *args = conn.recv()
            if cmd == "notifications":
                deadline = time.monotonic() + args[0]
                while (args[1] == 0 or len(inbox) < args[1]) and time.monotonic() < deadline:
                    inbox.extend((n.peer, n.message) for n in transport.notifications())
                    time.sleep(0.005)
                conn.send(inbox)
                inbox = []
            elif cmd == "read":  # act as a consumer: pull kv units from another peer
                port, local_ids, remote_ids, note = args
                peer = connect_peer(
                    transport,
                    "127.0.0.1",
                    port,
                    allowlist=parse_allowlist(""),
                    local_layout=layout(),
                )
                tid = transport.start_read(
                    peer.agent_name, {"kv": (local_ids, remote_ids)}, note, timeout_s=30
                )
                while transport.poll(tid) is TransferState.IN_PROGRESS:
                    time.sleep(0.001)
                result = transport.poll(tid).value
                transport.release(tid)
                conn.send((result, [kv[i].clone() for i in local_ids], transport.bytes_read))
            elif cmd == "stop":
                break
    finally:
        server.close()
        transport.close()
        conn.close()


class PeerProcess:
    """Handle on a spawned peer: `.port`, `.agent_name`, commands, kill."""

    def __init__(self, engine_id: str, seed: int):
        """Starts the process; `ready()` waits for it (start several, then wait)."""
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.engine_id, self.seed = engine_id, seed
        self.port = self.agent_name = None
        self.process = ctx.Process(target=_serve, args=(child, engine_id, seed), daemon=True)
        self.process.start()
        child.close()

    def ready(self, timeout: float = 120) -> "PeerProcess":
        if self.port is None:
            if not self.conn.poll(timeout):
                self.kill()
                raise RuntimeError(f"peer {self.engine_id} did not start")
            _, self.port, self.agent_name = self.conn.recv()
        return self

    def call(self, *cmd, timeout: float = 60):
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {cmd[0]!r}")
        return self.conn.recv()

    def notifications(self, expect: int = 0, wait_s: float = 5.0):
        """Notifications received so far, waiting for `expect` of them (0: the whole wait)."""
        return self.call("notifications", wait_s, expect)

    def kill(self):
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)

    def request_stop(self):
        """Ask the peer to close its transport and exit (without waiting)."""
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("stop",))

    def stop(self):
        self.request_stop()
        self.process.join(15)
        self.kill()
