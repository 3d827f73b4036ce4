"""Handshake documents, the compatibility hash, and the TCP exchange (real sockets)."""

import json
import socket
import struct
import threading
import time

import pytest

from pdpool.engine.connector import handshake
from pdpool.engine.connector.allowlist import parse_allowlist
from pdpool.engine.connector.handshake import (
    HandshakeDocument,
    HandshakeError,
    HandshakeServer,
    IncompatiblePeerError,
    build_document,
    check_compatible,
    compatibility_hash,
    fetch_handshake,
    layout_differences,
)
from pdpool.engine.connector.regions import RegionLayout

LAYOUT = {
    "model": "Qwen/Qwen3-0.6B",
    "dtype": "bfloat16",
    "block_size": 16,
    "kv_layout": "NLHD",
    "num_layers": 28,
    "num_kv_heads": 8,
    "head_dim": 128,
}


def document(layout=LAYOUT, metadata=b"\x00agent-metadata\xff"):
    regions = {
        "kv": RegionLayout("kv", 100, (4096, 4096), (1 << 40, 1 << 41)),
        "state": RegionLayout("state", 8, (512,), (1 << 42,)),
    }
    return build_document("prefill-0", "prefill-0-abc", metadata, regions, layout)


def test_hash_ignores_key_order_and_sees_every_field():
    base = compatibility_hash(LAYOUT)
    assert base == compatibility_hash(dict(reversed(list(LAYOUT.items()))))
    assert len(base) == 64
    for key, other in [
        ("model", "x"),
        ("dtype", "float16"),
        ("block_size", 32),
        ("kv_layout", "HND"),
        ("num_layers", 27),
        ("num_kv_heads", 4),
        ("head_dim", 64),
    ]:
        assert compatibility_hash({**LAYOUT, key: other}) != base, key
    assert compatibility_hash({**LAYOUT, "extra": None}) != base


@pytest.mark.parametrize("bad", [{}, {"x": float("nan")}, {"x": object()}, ["block_size"]])
def test_hash_rejects_what_is_not_plain_data(bad):
    with pytest.raises(ValueError):
        compatibility_hash(bad)


def test_differences_name_each_field():
    other = {**LAYOUT, "block_size": 32, "dtype": "float16"}
    del other["head_dim"]
    assert layout_differences(LAYOUT, other) == [
        "block_size: ours 16, peer 32",
        "dtype: ours 'bfloat16', peer 'float16'",
        "head_dim: ours 128, peer '<missing>'",
    ]


def test_compatible_peer_passes_and_incompatible_is_refused():
    check_compatible(LAYOUT, document())
    with pytest.raises(IncompatiblePeerError, match=r"prefill-0 .*block_size: ours 32, peer 16"):
        check_compatible({**LAYOUT, "block_size": 32}, document())


def test_a_hash_that_lies_about_its_layout_is_refused():
    doc = document().to_json()
    doc["compatibility"]["layout"]["block_size"] = 99
    with pytest.raises(IncompatiblePeerError, match="does not match its own layout"):
        check_compatible(LAYOUT, HandshakeDocument.from_json(doc))


def test_document_round_trips_through_json():
    doc = document()
    again = HandshakeDocument.from_json(json.loads(json.dumps(doc.to_json())))
    assert again == doc
    assert again.regions["kv"].unit_bytes == 8192


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.update(protocol=2), "unsupported handshake protocol 2"),
        (lambda d: d.pop("agent_metadata"), "malformed"),
        (lambda d: d.update(agent_metadata="***"), "malformed"),
        (lambda d: d["regions"]["kv"].update(num_units=-1), "malformed"),
        (lambda d: d["regions"]["kv"].update(unit_bytes=1), "malformed"),
        (lambda d: d["regions"]["kv"].update(slice_bytes=["4096", 4096]), "malformed"),
        (lambda d: d.update(regions=[]), "malformed"),
    ],
)
def test_malformed_documents_are_refused(mutate, match):
    doc = document().to_json()
    mutate(doc)
    with pytest.raises(HandshakeError, match=match):
        HandshakeDocument.from_json(doc)


def test_server_serves_the_document_and_can_swap_it():
    with HandshakeServer(document(), host="127.0.0.1", port=0) as server:
        assert server.port > 0
        assert fetch_handshake("127.0.0.1", server.port, timeout=5) == document()
        newer = document(metadata=b"re-registered")
        server.set_document(newer)
        again = fetch_handshake("localhost", server.port, timeout=5)
        assert again.agent_metadata == b"re-registered"


def test_server_handles_clients_in_parallel():
    with HandshakeServer(document(), host="127.0.0.1", port=0) as server:
        stalled = socket.create_connection(("127.0.0.1", server.port))  # says nothing
        try:
            results = []
            threads = [
                threading.Thread(
                    target=lambda: results.append(
                        fetch_handshake("127.0.0.1", server.port, timeout=5)
                    )
                )
                for _ in range(4)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert results == [document()] * 4
        finally:
            stalled.close()


def test_server_refuses_clients_outside_its_allowlist():
    allow = parse_allowlist("10.0.0.0/8", include_loopback=False)
    with (
        HandshakeServer(document(), host="127.0.0.1", port=0, client_allowlist=allow) as server,
        pytest.raises(HandshakeError, match="connection closed"),
    ):
        fetch_handshake("127.0.0.1", server.port, timeout=5)


def test_connection_refused_is_a_handshake_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(HandshakeError, match=f"127.0.0.1:{port} failed"):
        fetch_handshake("127.0.0.1", port, timeout=2)


class RawServer:
    """A TCP server that answers every client with fixed bytes (or nothing at all)."""

    def __init__(self, answer: bytes | None):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.answer = answer
        self.clients = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        self.clients.append(conn)
        if self.answer is not None:
            conn.recv(6)  # the hello; closing with it unread would reset the connection
            conn.sendall(self.answer)
            conn.close()

    def close(self):
        self.sock.close()
        for c in self.clients:
            c.close()


@pytest.mark.parametrize(
    "answer, match",
    [
        (None, "timed out after 0.5s"),
        (struct.pack(">I", 5) + b"{nope", "not JSON"),
        (struct.pack(">I", 1 << 30), "exceeds"),
        (struct.pack(">I", 100) + b"{}", "connection closed after 2 of 100 bytes"),
        (struct.pack(">I", 2) + b"[]", "malformed"),
    ],
)
def test_client_fails_cleanly_on_a_bad_server(answer, match):
    server = RawServer(answer)
    try:
        with pytest.raises(HandshakeError, match=match):
            fetch_handshake("127.0.0.1", server.port, timeout=0.5)
    finally:
        server.close()


def hello_from(source: str, port: int) -> bytes:
    """The handshake by hand, from a chosen loopback address: the answer's bytes ("" when
    the server closed without one)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0)) as s:
        s.sendall(b"PDKV" + struct.pack(">H", 1))
        return s.recv(4)


def lease_answer(sock: socket.socket) -> dict:
    (length,) = struct.unpack(">I", sock.recv(4))
    return json.loads(sock.recv(length))


def test_a_peer_that_trickles_its_request_is_cut_off_at_the_deadline():
    """A timeout per read alone would let one byte every so often hold a thread for hours."""
    with HandshakeServer(
        document(), host="127.0.0.1", port=0, io_timeout_s=1.0, lease_handler=lambda m: {}
    ) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(b"PDKL" + struct.pack(">I", 100))
            closed = False
            for _ in range(30):  # a byte every 0.3 s: 9 s, were it never cut off
                try:
                    s.sendall(b"{")
                    s.settimeout(0.3)
                    closed = s.recv(1) == b""
                except socket.timeout:
                    continue
                except OSError:
                    closed = True
                if closed:
                    break
            assert closed
        # Deep nesting is no JSON a peer sends: an answer, not a thread lost to a traceback.
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            deep = b"[" * 200_000 + b"]" * 200_000
            s.sendall(b"PDKL" + struct.pack(">I", len(deep)) + deep)
            assert lease_answer(s) == {"ok": False, "error": "a lease message is JSON"}


def test_one_host_cannot_hold_every_connection(monkeypatch):
    monkeypatch.setattr(handshake, "MAX_CONNECTIONS_PER_HOST", 4)
    with HandshakeServer(document(), host="127.0.0.1", port=0, io_timeout_s=30) as server:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
        try:
            time.sleep(0.3)  # each is being served (waits for its hello)
            assert hello_from("127.0.0.1", server.port) == b""  # a fifth from that host: closed
            assert len(hello_from("127.0.0.2", server.port)) == 4  # another host: served
        finally:
            for s in idle:
                s.close()
        deadline = time.monotonic() + 10
        while hello_from("127.0.0.1", server.port) == b"":  # its turns come back
            assert time.monotonic() < deadline
            time.sleep(0.1)
