"""A producer's answers to its peers' lease operations (open, renew, release), on the
handshake server's threads. They touch only the lease table, never NIXL: the engine thread
stays the transport's one user."""

from __future__ import annotations

import logging
import math
from typing import Any

from pdpool.engine.connector.handshake import HandshakeDocument
from pdpool.engine.kv.leases import LeaseRefused, LeaseTable

log = logging.getLogger("pdpool.connector")


class LeaseDesk:
    def __init__(
        self,
        leases: LeaseTable,
        document: HandshakeDocument,
        epoch: str,
        default_read_timeout_s: float,
    ) -> None:
        self.leases = leases
        self.document = document  # names our NIXL agent; sent to peers that do not know it
        self.epoch = epoch
        self.default_read_timeout_s = default_read_timeout_s

    def answer(self, message: dict) -> dict:
        try:
            return self._answer(message)
        except Exception as exc:  # a malformed message must not cost the server a thread
            log.warning("bad KV lease op from a peer: %r", exc)
            return {"ok": False, "error": "malformed lease op"}

    def _answer(self, message: dict) -> dict:
        op, lease_id, epoch = message.get("op"), message.get("lease_id"), message.get("epoch")
        if not isinstance(lease_id, str) or not isinstance(epoch, str):
            return {"ok": False, "error": "a lease op names lease_id and epoch"}
        try:
            if op == "open":
                reply: dict[str, Any] = {
                    "ok": True,
                    "lease": self.leases.open(lease_id, epoch, self._read_timeout(message)),
                    "agent_name": self.document.agent_name,
                    "epoch": self.epoch,
                }
                if message.get("known_agent") != self.document.agent_name:
                    reply["peer"] = self.document.to_json()
                return reply
            if op == "renew":
                return {"ok": True, "held_s": self.leases.renew(lease_id, epoch)}
            if op == "release":
                return {"ok": epoch == self.epoch and self.leases.release(lease_id)}
        except LeaseRefused as exc:
            return {"ok": False, "error": str(exc), "epoch": self.epoch}
        return {"ok": False, "error": f"unknown lease op {op!r}"}

    def _read_timeout(self, message: dict) -> float:
        """How long the opened lease stays pinned for the peer's READ: its own figure when it
        gives a sane one."""
        timeout = message.get("read_timeout_s")
        if (
            isinstance(timeout, (int, float))
            and not isinstance(timeout, bool)
            and math.isfinite(timeout)
        ):
            return float(timeout)
        return self.default_read_timeout_s
