"""Leases: every hold of KV blocks for another engine, bound to what it holds.

A lease is granted when a prefill leg finishes (its prompt's blocks, for a decode engine)
or when a request is rejected below its cache-hit threshold (the cached prefix, for a
prefill engine to pull). It names the blocks and state slots it holds, the chained block
hashes of the tokens in them, and the engine epoch it was granted in. A peer reads through
a lease only after opening it; a lease opens once, so a replayed read finds nothing.

Lifecycle (see docs/nixl.md):
  granted --renew--> granted            a consumer still wants it (its request waits)
  granted --open---> reading            pinned for the read's duration, single use
  granted/reading --release|notify|expiry--> ended   blocks and slots go back to the pool

The table itself is only metadata behind a lock: the handshake server's threads open,
renew and release leases. The blocks and slots a lease names are held by the scheduler
(under the lease id); the connector reports the ended ones (`take_ended`) on the engine
thread and the scheduler gives them back there, so the block pool stays single-threaded.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from pdpool.engine.kv.hashing import prefix_hash
from pdpool.engine.request import Request

# A read pinned by `open` outlives the consumer's own timeout by this much, so the blocks
# cannot be reused while a read the consumer still trusts is in flight.
READ_GRACE_S = 5.0


def read_pin_s(read_timeout_s: float, max_read_s: float) -> float:
    """How long an opened lease stays pinned for the consumer's read, whether or not the
    consumer lives to notify its end."""
    return min(max(read_timeout_s, 0.0), max_read_s) + READ_GRACE_S


def longest_hold_s(hold_s: float, read_timeout_s: float, max_read_s: float) -> float:
    """The longest a lease holds its blocks once nobody renews it: its hold, or the pin of
    a read opened just before the hold would have ended."""
    return hold_s + read_pin_s(read_timeout_s, max_read_s)


class LeaseRefused(Exception):
    """A lease cannot be opened or renewed: unknown, ended, already opened, other epoch."""


@dataclass
class Lease:
    lease_id: str
    epoch: str
    block_ids: list[list[int]]  # per KV group, the positions the lease covers
    state_slots: tuple[int, ...]  # pinned recurrent-state slots (running state, boundary)
    num_tokens: int  # tokens whose KV the lease holds
    hashes: list[bytes]  # chained hashes of the full blocks of those tokens
    tail_hash: Optional[bytes]  # chained hash of a final partial block, if any
    deadline: float  # monotonic
    state_tokens: Optional[int] = None  # the token count the pinned state slots are at
    read_until: float = 0.0
    opened: bool = False
    released: bool = False

    @property
    def prefix_hash(self) -> Optional[bytes]:
        """The chained hash of all the leased tokens (it commits to every one of them)."""
        return self.tail_hash or (self.hashes[-1] if self.hashes else None)

    def live(self, now: float) -> bool:
        return not self.released and now <= max(self.deadline, self.read_until)

    def describe(self) -> dict[str, Any]:
        """What an `open` answers: where the blocks are and what they hold."""
        return {
            "lease_id": self.lease_id,
            "epoch": self.epoch,
            "block_ids": self.block_ids,
            "state_slots": list(self.state_slots),
            "num_tokens": self.num_tokens,
            "hashes": [h.hex() for h in self.hashes],
            "tail_hash": self.tail_hash.hex() if self.tail_hash else None,
            "state_tokens": self.state_tokens,
        }


class LeaseTable:
    def __init__(self, epoch: str, hold_s: float, max_read_s: float):
        self.epoch = epoch
        self.hold_s = hold_s
        self.max_read_s = max_read_s
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self.counters = {
            "leases_granted": 0,
            "leases_opened": 0,
            "leases_renewed": 0,
            "leases_released": 0,
            "leases_expired": 0,
            "lease_opens_refused": 0,
        }

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def grant_new(
        self,
        lease_id: str,
        request: Request,
        block_ids: list[list[int]],
        num_tokens: int,
        block_size: int,
        state_slots: tuple[int, ...] = (),
        state_tokens: Optional[int] = None,
    ) -> Lease:
        """Grants a lease over `block_ids` (per group, the blocks of the first `num_tokens`
        tokens of `request`) and `state_slots`, bound to those tokens' hashes. The caller
        holds the blocks and slots themselves until the lease ends."""
        lease = Lease(
            lease_id=lease_id,
            epoch=self.epoch,
            block_ids=block_ids,
            state_slots=tuple(state_slots),
            num_tokens=num_tokens,
            hashes=list(request.block_hashes[: num_tokens // block_size]),
            tail_hash=prefix_hash(
                request.all_token_ids,
                request.block_hashes,
                num_tokens,
                block_size,
                request.hasher.extra_keys,
            )
            if num_tokens % block_size
            else None,
            deadline=time.monotonic() + self.hold_s,
            state_tokens=state_tokens if state_slots else None,
        )
        self.grant(lease)
        return lease

    def grant(self, lease: Lease) -> None:
        with self._lock:
            if lease.lease_id in self._leases:
                raise ValueError(f"lease {lease.lease_id} exists")
            self._leases[lease.lease_id] = lease
            self.counters["leases_granted"] += 1

    def _live(self, lease_id: str, epoch: str, now: float) -> Lease:
        if epoch != self.epoch:
            raise LeaseRefused(
                f"lease from engine epoch {epoch!r}; this engine is epoch "
                f"{self.epoch!r} (it restarted)"
            )
        lease = self._leases.get(lease_id)
        if lease is None or not lease.live(now):
            raise LeaseRefused(f"no live lease {lease_id!r} (expired, released or never granted)")
        return lease

    def open(self, lease_id: str, epoch: str, read_timeout_s: float) -> dict[str, Any]:
        """Pins a live lease for one read and describes it; a second open is refused."""
        now = time.monotonic()
        with self._lock:
            try:
                lease = self._live(lease_id, epoch, now)
                if lease.opened:
                    raise LeaseRefused(f"lease {lease_id!r} was already opened (single use)")
            except LeaseRefused:
                self.counters["lease_opens_refused"] += 1
                raise
            lease.opened = True
            lease.read_until = now + read_pin_s(read_timeout_s, self.max_read_s)
            self.counters["leases_opened"] += 1
            return lease.describe()

    def renew(self, lease_id: str, epoch: str) -> float:
        """Extends a live, unopened lease by the hold time; returns the seconds granted."""
        now = time.monotonic()
        with self._lock:
            lease = self._live(lease_id, epoch, now)
            if not lease.opened:
                lease.deadline = max(lease.deadline, now + self.hold_s)
                self.counters["leases_renewed"] += 1
            return max(lease.deadline, lease.read_until) - now

    def release(self, lease_id: str) -> bool:
        """Marks a lease ended (its blocks go back on the engine thread's next tick)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.released:
                return False
            lease.released = True
            self.counters["leases_released"] += 1
            return True

    def take_ended(self, now: Optional[float] = None) -> list[Lease]:
        """Removes and returns the leases that are released or expired."""
        now = time.monotonic() if now is None else now
        ended = []
        with self._lock:
            for lease_id, lease in list(self._leases.items()):
                if lease.released or not lease.live(now):
                    if not lease.released:
                        self.counters["leases_expired"] += 1
                    del self._leases[lease_id]
                    ended.append(lease)
        return ended

    def take_all(self) -> list[Lease]:
        with self._lock:
            leases, self._leases = list(self._leases.values()), {}
        return leases
