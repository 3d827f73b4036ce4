"""From a (host, port) named in `kv_transfer_params` to a peer the transport can read from.

allowlist -> handshake -> compatibility -> add to the transport, each step failing with its
own error type so the engine can report exactly why a peer was refused. `PeerAgents` keeps
the agents a consumer reads from, as producers name them when they open a lease.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

from pdpool.engine.connector.allowlist import Allowlist, Resolver, resolve_allowed, system_resolver
from pdpool.engine.connector.handshake import (
    HandshakeDocument,
    HandshakeError,
    check_compatible,
    fetch_handshake,
)

log = logging.getLogger("pdpool.connector")


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


class PeerAgents:
    """The NIXL agents of the producers this consumer reads from, by handshake address.
    A producer names its agent in its answer to every open: a new name (it restarted)
    replaces the old agent, so transfers heal with the next request."""

    def __init__(self, transport: Any, local_layout: Mapping[str, Any], counters: dict[str, int]):
        self.transport = transport
        self.local_layout = local_layout
        self.counters = counters  # the connector's: peers_replaced, peers_refused
        self._agents: dict[tuple[str, int], str] = {}

    def known(self, key: tuple[str, int]) -> str | None:
        return self._agents.get(key)

    def from_reply(self, key: tuple[str, int], reply: dict) -> str:
        """The agent to read from, as the producer's answer to an open names it (added to
        the transport when new). Raises HandshakeError (a refused lease, an inconsistent
        or incompatible peer) or TransportError."""
        where = f"{key[0]}:{key[1]}"
        if not reply.get("ok"):
            raise HandshakeError(
                f"KV lease refused by {where}: {reply.get('error', 'no reason given')}"
            )
        agent = reply.get("agent_name")
        if isinstance(agent, str) and agent == self._agents.get(key) and "peer" not in reply:
            return agent
        if not isinstance(reply.get("peer"), dict):
            raise HandshakeError(f"KV peer {where} did not describe its agent")
        doc = HandshakeDocument.from_json(reply["peer"])
        if doc.agent_name != agent or doc.epoch != reply.get("epoch"):
            raise HandshakeError(f"KV peer {where}: inconsistent agent or epoch")
        old = self._agents.pop(key, None)
        if old is not None and old != agent:
            self.counters["peers_replaced"] += 1
            log.info("KV peer %s restarted (epoch %s): new NIXL agent", where, doc.epoch[:8])
            self._remove(old)
        try:
            self._agents[key] = admit_peer(self.transport, doc, self.local_layout, where)
        except HandshakeError:
            self.counters["peers_refused"] += 1
            raise
        return self._agents[key]

    def forget(self, key: tuple[str, int], reading_from: set[str]) -> None:
        """After a failed read: the next load asks the producer for its agent again. The
        agent stays while another address names it or a READ in flight uses it."""
        agent = self._agents.pop(key, None)
        if agent is not None and agent not in self._agents.values() and agent not in reading_from:
            self._remove(agent)

    def _remove(self, agent: str) -> None:
        try:
            self.transport.remove_peer(agent)
        except Exception as exc:  # already gone
            log.debug("removing NIXL agent %s: %s", agent, exc)
