"""Which records a tier holds, least-recently-used first: pure bookkeeping, no I/O.

One record holds many blocks (a request's blocks of one step), and each block is found by
its own key, so a record is named by several keys. The tier evicts keys, least recently
used first; a record's bytes are freed when the last key naming it goes. `bytes_used`
counts each record once, while any key names it. Not thread-safe: the stores lock it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional


class RecordIndex:
    def __init__(self) -> None:
        self._keys: "OrderedDict[str, Hashable]" = OrderedDict()  # key -> record, LRU first
        self._records: dict[Hashable, list[int]] = {}  # record -> [bytes, keys naming it]
        self.bytes_used = 0

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def record_of(self, key: str) -> Optional[Hashable]:
        return self._keys.get(key)

    def touch(self, key: str) -> None:
        if key in self._keys:
            self._keys.move_to_end(key)

    def add(self, key: str, record: Hashable, nbytes: int) -> bool:
        """Names `record` (of `nbytes`) by `key`; False if the key already names one."""
        if key in self._keys:
            return False
        self._keys[key] = record
        entry = self._records.get(record)
        if entry is None:
            self._records[record] = [nbytes, 1]
            self.bytes_used += nbytes
        else:
            entry[1] += 1
        return True

    def remove(self, key: str) -> Optional[Hashable]:
        """Forgets `key`; returns its record when no key names that record any more."""
        record = self._keys.pop(key, None)
        if record is None:
            return None
        entry = self._records[record]
        entry[1] -= 1
        if entry[1] > 0:
            return None
        del self._records[record]
        self.bytes_used -= entry[0]
        return record

    def oldest(self) -> Optional[str]:
        return next(iter(self._keys), None)

    def keys_of(self, record: Hashable) -> list[str]:
        """Every key naming `record` (a linear scan: only for a record found bad)."""
        return [k for k, r in self._keys.items() if r == record]
