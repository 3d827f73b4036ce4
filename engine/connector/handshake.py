"""Metadata exchange over TCP (`--kv-port`): how an engine learns how to read a peer's KV.

Wire format (version 1), one exchange per connection:
  client -> server   b"PDKV" + u16 version (big endian)
  server -> client   u32 length (big endian) + that many bytes of UTF-8 JSON, then closes
The JSON document:
  {"protocol": 1, "engine_id": str, "agent_name": str,
   "agent_metadata": base64 of the NIXL agent metadata,
   "compatibility": {"hash": sha256 hex, "layout": {model, dtype, block_size, ...}},
   "regions": {name: {num_units, unit_bytes, slice_bytes, base_addrs, mem_type, device_id}}}
A peer whose compatibility hash differs from ours is refused (`IncompatiblePeerError`,
naming the fields that differ): reading its blocks would silently produce garbage.

Lease operations share the port (a peer opens, renews or releases a lease on our KV):
  client -> server   b"PDKL" + u32 length + JSON object {"op": ..., ...}
  server -> client   u32 length + JSON object {"ok": bool, ...}, then closes

The server runs in daemon threads and only ever serves a prepared document; it never calls
into NIXL, so the engine's single-threaded use of its transport stays single-threaded.
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import socketserver
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from pdpool.engine.connector.allowlist import Allowlist, is_allowed
from pdpool.engine.connector.regions import RegionError, RegionLayout

PROTOCOL_VERSION = 1
MAGIC = b"PDKV"
LEASE_MAGIC = b"PDKL"
MAX_LEASE_MESSAGE_BYTES = 1 << 20
_HELLO = MAGIC + struct.pack(">H", PROTOCOL_VERSION)
MAX_DOCUMENT_BYTES = 16 << 20  # metadata is a few KB; refuse absurd answers
# Connections served at once: far above what a pool's peers open (an engine makes at most
# eight lease calls at once, each done in milliseconds), far below what a thread per
# connection can afford.
MAX_CONNECTIONS = 1024
MAX_CONNECTIONS_PER_HOST = 128


class HandshakeError(RuntimeError):
    """The peer could not be reached, or answered something that is not a handshake."""


class IncompatiblePeerError(HandshakeError):
    """The peer's KV layout differs from ours."""


# ---- compatibility ------------------------------------------------------------------------


def _canonical(layout: Mapping[str, Any]) -> str:
    try:
        return json.dumps(layout, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"a compatibility layout must be plain JSON data: {exc}") from None


def compatibility_hash(layout: Mapping[str, Any]) -> str:
    """sha256 of the layout (model, dtype, block size, kv layout, layers, heads, ...).

    Key order does not matter; values must be JSON data (str, numbers, bools, lists, dicts).
    """
    if not isinstance(layout, Mapping) or not layout:
        raise ValueError("a compatibility layout must be a non-empty mapping")
    return hashlib.sha256(_canonical(layout).encode()).hexdigest()


def layout_differences(local: Mapping[str, Any], remote: Mapping[str, Any]) -> list[str]:
    """`["block_size: ours 16, peer 32", ...]` for every field that differs."""
    out = []
    for key in sorted(set(local) | set(remote)):
        mine, theirs = local.get(key, "<missing>"), remote.get(key, "<missing>")
        if _canonical({"v": mine}) != _canonical({"v": theirs}):
            out.append(f"{key}: ours {mine!r}, peer {theirs!r}")
    return out


# ---- the document -------------------------------------------------------------------------


@dataclass(frozen=True)
class HandshakeDocument:
    engine_id: str
    agent_name: str
    agent_metadata: bytes
    layout: dict[str, Any]
    compat_hash: str
    regions: dict[str, RegionLayout]
    epoch: str = ""  # new at every engine start: leases of an earlier life are void

    def to_json(self) -> dict[str, Any]:
        return {
            "protocol": PROTOCOL_VERSION,
            "engine_id": self.engine_id,
            "epoch": self.epoch,
            "agent_name": self.agent_name,
            "agent_metadata": base64.b64encode(self.agent_metadata).decode(),
            "compatibility": {"hash": self.compat_hash, "layout": self.layout},
            "regions": {n: r.to_dict() for n, r in self.regions.items()},
        }

    @classmethod
    def from_json(cls, doc: Any) -> "HandshakeDocument":
        try:
            if doc.get("protocol") != PROTOCOL_VERSION:
                raise HandshakeError(
                    f"unsupported handshake protocol {doc.get('protocol')!r}"
                    f" (this engine speaks {PROTOCOL_VERSION})"
                )
            compat = doc["compatibility"]
            regions = {str(n): RegionLayout.from_dict(str(n), r) for n, r in doc["regions"].items()}
            return cls(
                engine_id=str(doc["engine_id"]),
                agent_name=str(doc["agent_name"]),
                agent_metadata=base64.b64decode(doc["agent_metadata"], validate=True),
                layout=dict(compat["layout"]),
                compat_hash=str(compat["hash"]),
                regions=regions,
                epoch=str(doc.get("epoch") or ""),
            )
        except HandshakeError:
            raise
        except (AttributeError, KeyError, TypeError, ValueError, RegionError) as exc:
            raise HandshakeError(f"malformed handshake document: {exc!r}") from None


def build_document(
    engine_id: str,
    agent_name: str,
    agent_metadata: bytes,
    regions: Mapping[str, RegionLayout],
    layout: Mapping[str, Any],
    epoch: str = "",
) -> HandshakeDocument:
    """Our handshake document; `layout` is what must match for blocks to be exchangeable."""
    return HandshakeDocument(
        engine_id,
        agent_name,
        bytes(agent_metadata),
        dict(layout),
        compatibility_hash(layout),
        dict(regions),
        epoch,
    )


def document_for(transport: Any, layout: Mapping[str, Any], epoch: str = "") -> HandshakeDocument:
    """The document of a `NixlTransport` (call after registering every region)."""
    return build_document(
        transport.engine_id,
        transport.agent_name,
        transport.agent_metadata(),
        transport.regions,
        layout,
        epoch,
    )


def check_compatible(local_layout: Mapping[str, Any], peer: HandshakeDocument) -> None:
    """Raise IncompatiblePeerError, naming the differing fields, unless layouts match."""
    if compatibility_hash(peer.layout) != peer.compat_hash:
        raise IncompatiblePeerError(
            f"engine {peer.engine_id}: its compatibility hash does not match its own layout"
        )
    if compatibility_hash(local_layout) != peer.compat_hash:
        diff = layout_differences(local_layout, peer.layout)
        raise IncompatiblePeerError(
            f"engine {peer.engine_id} has an incompatible KV layout: " + "; ".join(diff)
        )


# ---- server -------------------------------------------------------------------------------


def _recv_exactly(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """`n` bytes; with a `deadline` (monotonic), socket.timeout once it passes, however the
    bytes trickle in (a timeout per recv alone lets one byte a while hold a thread for hours)."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"{len(buf)} of {n} bytes before the deadline")
            sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


class _Handler(socketserver.BaseRequestHandler):
    server: "_TCPServer"

    def handle(self):
        owner = self.server.owner
        # One deadline for the whole exchange: a peer has io_timeout_s to send its request.
        self.deadline = time.monotonic() + owner.io_timeout_s
        self.request.settimeout(owner.io_timeout_s)
        try:
            if owner.client_allowlist is not None and not is_allowed(
                self.client_address[0], owner.client_allowlist
            ):
                return  # close without a word: nothing to learn for a stranger
            magic = _recv_exactly(self.request, len(MAGIC), self.deadline)
            if magic == LEASE_MAGIC and owner.lease_handler is not None:
                self._lease_op(owner)
                return
            if magic + _recv_exactly(self.request, 2, self.deadline) != _HELLO:
                return
            payload = owner.payload()
            self.request.sendall(struct.pack(">I", len(payload)) + payload)
        except OSError:
            pass  # a client that went away is its own problem

    def _lease_op(self, owner: "HandshakeServer") -> None:
        (length,) = struct.unpack(">I", _recv_exactly(self.request, 4, self.deadline))
        if length > MAX_LEASE_MESSAGE_BYTES:
            return
        raw = _recv_exactly(self.request, length, self.deadline)
        try:
            message = json.loads(raw)
            handler = owner.lease_handler
            reply = (
                handler(message)
                if handler is not None and isinstance(message, dict)
                else {"ok": False, "error": "a lease message is a JSON object"}
            )
        except (ValueError, RecursionError):
            reply = {"ok": False, "error": "a lease message is JSON"}
        payload = json.dumps(reply, separators=(",", ":")).encode()
        self.request.sendall(struct.pack(">I", len(payload)) + payload)


class _TCPServer(socketserver.ThreadingTCPServer):
    """A thread per connection, at most MAX_CONNECTIONS at once and MAX_CONNECTIONS_PER_HOST
    from one address: a connection beyond them is closed at once (a peer's lease call then
    fails and its request recomputes), so a flood of idle connections from one host can
    neither pile up threads nor take every other peer's turn."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, owner: "HandshakeServer", family: int):
        self.address_family = family
        self.owner = owner
        self._count_lock = threading.Lock()
        self._open: dict[str, int] = {}  # client address -> connections being served
        super().__init__(address, _Handler)

    def _admit(self, host: str) -> bool:
        with self._count_lock:
            total = sum(self._open.values())
            if total >= MAX_CONNECTIONS or self._open.get(host, 0) >= MAX_CONNECTIONS_PER_HOST:
                return False
            self._open[host] = self._open.get(host, 0) + 1
            return True

    def _leave(self, host: str) -> None:
        with self._count_lock:
            left = self._open.pop(host) - 1
            if left:
                self._open[host] = left

    def process_request(self, request, client_address):
        host = client_address[0]
        if not self._admit(host):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: nothing else would count it out
            self._leave(host)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._leave(client_address[0])


class HandshakeServer:
    """Serves our handshake document on (host, port); port 0 picks a free one."""

    def __init__(
        self,
        document: HandshakeDocument,
        host: str = "0.0.0.0",
        port: int = 0,
        client_allowlist: Allowlist | None = None,
        io_timeout_s: float = 5.0,
        lease_handler: Callable[[dict], dict] | None = None,
    ):
        self.client_allowlist = client_allowlist
        # Answers lease operations (open, renew, release) from peers; runs on the server's
        # threads, so it must only touch thread-safe state (the lease table).
        self.lease_handler = lease_handler
        self.io_timeout_s = io_timeout_s
        self._lock = threading.Lock()
        self.set_document(document)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = _TCPServer((host, port), self, family)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kv-handshake", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def set_document(self, document: HandshakeDocument) -> None:
        """Swap the served document (e.g. after registering another region)."""
        payload = json.dumps(document.to_json(), separators=(",", ":")).encode()
        with self._lock:
            self._payload = payload

    def payload(self) -> bytes:
        with self._lock:
            return self._payload

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "HandshakeServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- client -------------------------------------------------------------------------------


def fetch_handshake(host: str, port: int, timeout: float = 5.0) -> HandshakeDocument:
    """Fetch and parse a peer's handshake document; HandshakeError on any failure."""
    where = f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(_HELLO)
            (length,) = struct.unpack(">I", _recv_exactly(sock, 4))
            if length > MAX_DOCUMENT_BYTES:
                raise HandshakeError(
                    f"KV handshake with {where}: document of {length} bytes "
                    f"exceeds {MAX_DOCUMENT_BYTES}"
                )
            raw = _recv_exactly(sock, length)
    except socket.timeout:
        raise HandshakeError(f"KV handshake with {where} timed out after {timeout}s") from None
    except OSError as exc:
        raise HandshakeError(f"KV handshake with {where} failed: {exc}") from None
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise HandshakeError(f"KV handshake with {where}: not JSON ({exc})") from None
    return HandshakeDocument.from_json(doc)


def lease_call(host: str, port: int, message: dict, timeout: float = 5.0) -> dict:
    """One lease operation with a peer; HandshakeError when there is no well-formed answer."""
    where = f"{host}:{port}"
    body = json.dumps(message, separators=(",", ":")).encode()
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(LEASE_MAGIC + struct.pack(">I", len(body)) + body)
            (length,) = struct.unpack(">I", _recv_exactly(sock, 4))
            if length > MAX_DOCUMENT_BYTES:
                raise HandshakeError(f"lease call to {where}: answer of {length} bytes")
            raw = _recv_exactly(sock, length)
    except socket.timeout:
        raise HandshakeError(f"lease call to {where} timed out after {timeout}s") from None
    except (OSError, struct.error) as exc:
        raise HandshakeError(f"lease call to {where} failed: {exc}") from None
    try:
        reply = json.loads(raw)
    except ValueError as exc:
        raise HandshakeError(f"lease call to {where}: not JSON ({exc})") from None
    if not isinstance(reply, dict):
        raise HandshakeError(f"lease call to {where}: the answer is not an object")
    return reply
