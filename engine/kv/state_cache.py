"""Recurrent-state slots: one running state per request, plus snapshots for prefix hits.

A Gated DeltaNet layer carries a state instead of per-token KV, so a prefix hit can only
resume from a state saved at that exact position. Snapshots are taken where a computed
chunk ends on a block boundary (the scheduler aligns prefill chunks so one does), named by
the hash of the last block, and evicted least-recently-used. Slots 0..R-1 are running
states, R..R+S-1 snapshots; the model's state tensors hold R+S slots.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Optional


class StateSnapshotCache:
    def __init__(self, first_slot: int, num_slots: int):
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self._by_hash: "OrderedDict[bytes, int]" = OrderedDict()
        # Slots held for peers (not evictable), counted: two leases may pin one snapshot.
        self.pinned: Counter[int] = Counter()

    def lookup(self, block_hash: bytes) -> Optional[int]:
        slot = self._by_hash.get(block_hash)
        if slot is not None:
            self._by_hash.move_to_end(block_hash)
        return slot

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    def take_slot(self) -> Optional[int]:
        """A slot to write a new snapshot into: a free one, else the LRU snapshot's."""
        if self._free:
            return self._free.pop()
        for h, slot in self._by_hash.items():
            if slot not in self.pinned:
                del self._by_hash[h]
                return slot
        return None

    def publish(self, block_hash: bytes, slot: int) -> None:
        self._by_hash[block_hash] = slot

    def pin(self, slot: int) -> None:
        self.pinned[slot] += 1

    def release(self, slot: int) -> None:
        """Drops one pin of a slot; a slot neither pinned nor published is free again."""
        if self.pinned[slot] > 1:
            self.pinned[slot] -= 1
            return
        self.pinned.pop(slot, None)
        if slot not in self._by_hash.values() and slot not in self._free:
            self._free.append(slot)

    def __len__(self) -> int:
        return len(self._by_hash)
