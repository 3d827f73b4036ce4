"""A consumer's housekeeping of the leases it holds on producers: a request that names a
peer's lease and waits in the queue keeps it alive (renewals), and a lease it will not read
is given back at once (release). Calls go out on their own small pool, so a peer that
stopped answering cannot hold up the loads from the others; a missed one is covered by a
later one, or by the lease's expiry."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

from pdpool.engine.connector.allowlist import Allowlist, resolve_allowed
from pdpool.engine.connector.handshake import lease_call
from pdpool.engine.connector.lease_token import LeaseToken
from pdpool.engine.request import Request

HOUSEKEEPING_TIMEOUT_S = 2.0
FIRST_RENEWAL_S = 0.05  # a queued request's first renewal

Peer = tuple[str, int]  # (host, port) of a producer's handshake server


@dataclass
class _Wanted:
    """A request that names a peer's lease and has not started loading: kept alive."""

    request: Request
    key: Peer
    token: LeaseToken
    next_renewal: float = 0.0  # monotonic
    renewing: Optional[Future] = None

    def schedule(self, remaining_s: float) -> None:
        """Renews at a third of the remaining hold, so two renewals may fail in a row."""
        self.next_renewal = time.monotonic() + max(remaining_s / 3, 0.1)


class PeerLeases:
    def __init__(self, allowlist: Allowlist, counters: dict[str, int]) -> None:
        self.allowlist = allowlist
        self.counters = counters  # the connector's: lease_renewals_sent, lease_releases_sent
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-lease-hk")
        self._wanted: dict[str, _Wanted] = {}  # by request id

    def want(self, request: Request, key: Peer, token: LeaseToken) -> None:
        wanted = _Wanted(request, key, token)
        # A request admitted at once opens the lease before this; one that waits renews
        # early, whatever the producer's clock says is left.
        wanted.schedule(min(token.expires_ms / 1000 - time.time(), FIRST_RENEWAL_S * 3))
        self._wanted[request.request_id] = wanted

    def take(self, request_id: str) -> Optional[Peer]:
        """The request starts loading: its lease is no longer renewed here (the open keeps
        it); returns the producer it names, if it was wanted."""
        wanted = self._unwant(request_id)
        return None if wanted is None else wanted.key

    def drop(self, request_id: str) -> None:
        """The request will not read its lease: renewals stop and the lease is given back."""
        wanted = self._unwant(request_id)
        if wanted is not None:
            self.release(*wanted.key, wanted.token)

    def _unwant(self, request_id: str) -> Optional[_Wanted]:
        wanted = self._wanted.pop(request_id, None)
        if wanted is not None and wanted.renewing is not None:
            wanted.renewing.cancel()
        return wanted

    def release(self, host: str, port: int, token: LeaseToken) -> None:
        self.counters["lease_releases_sent"] += 1
        self._submit(
            (host, port), {"op": "release", "lease_id": token.lease_id, "epoch": token.epoch}
        )

    def renew_due(self) -> None:
        """Keeps the leases of requests still queued here alive on their producers."""
        now = time.monotonic()
        for rid, w in list(self._wanted.items()):
            if w.request.is_finished:
                self.drop(rid)
                continue
            if w.renewing is not None:
                if not w.renewing.done():
                    continue
                try:
                    reply = w.renewing.result()
                except Exception:  # unreachable this time: try again soon
                    reply = {"ok": True, "held_s": 0.3}
                w.renewing = None
                held = reply.get("held_s")
                if not reply.get("ok") or not isinstance(held, (int, float)):
                    continue  # the lease is gone: the open will say so and we recompute
                w.schedule(float(held))
            if now >= w.next_renewal:
                w.next_renewal = float("inf")  # until the answer reschedules
                self.counters["lease_renewals_sent"] += 1
                w.renewing = self._submit(
                    w.key, {"op": "renew", "lease_id": w.token.lease_id, "epoch": w.token.epoch}
                )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _submit(self, key: Peer, message: dict) -> Optional[Future]:
        try:
            address = resolve_allowed(key[0], self.allowlist)
        except PermissionError:
            return None
        return self._pool.submit(lease_call, address, key[1], message, HOUSEKEEPING_TIMEOUT_S)
