"""From a (host, port) named in `kv_transfer_params` to a peer the transport can read from.

allowlist -> handshake -> compatibility -> add to the transport, each step failing with its
own error type so the engine can report exactly why a peer was refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from pdpool.engine.connector.allowlist import Allowlist, Resolver, resolve_allowed, system_resolver
from pdpool.engine.connector.handshake import (
    HandshakeDocument,
    HandshakeError,
    check_compatible,
    fetch_handshake,
)


@dataclass(frozen=True)
class Peer:
    engine_id: str
    agent_name: str  # what the transport calls it
    address: str  # the vetted address we connected to
    port: int
    document: HandshakeDocument


def connect_peer(
    transport: Any,
    host: str,
    port: int,
    *,
    allowlist: Allowlist,
    local_layout: Mapping[str, Any],
    timeout: float = 5.0,
    resolver: Resolver = system_resolver,
) -> Peer:
    """Raises PeerNotAllowedError, HandshakeError, IncompatiblePeerError or TransportError."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise HandshakeError(f"invalid KV port {port!r}")
    address = resolve_allowed(host, allowlist, resolver)
    doc = fetch_handshake(address, port, timeout)
    return Peer(
        doc.engine_id,
        admit_peer(transport, doc, local_layout, f"{host}:{port}"),
        address,
        port,
        doc,
    )


def admit_peer(
    transport: Any, doc: HandshakeDocument, local_layout: Mapping[str, Any], where: str
) -> str:
    """Adds a peer described by its handshake document to the transport, after checking
    that its KV layout is ours and that its metadata is the agent it announced; returns the
    agent name. Raises IncompatiblePeerError, HandshakeError or TransportError."""
    check_compatible(local_layout, doc)
    name: str = transport.add_peer(doc.agent_metadata, doc.regions)
    if name != doc.agent_name:
        transport.remove_peer(name)
        raise HandshakeError(
            f"engine {doc.engine_id} at {where} announced agent "
            f"{doc.agent_name!r} but its metadata is for {name!r}"
        )
    return name
