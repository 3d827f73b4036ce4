"""Host memory as a tier (vLLM's `native` backend): the same records as on disk, in a dict
bounded in bytes, least-recently-used out. On a GPU it keeps what leaves the device pool;
on CPU it only adds room beside the pool. Records are still checked on every read: one
format, one path, whatever the medium."""

from __future__ import annotations

import errno
import itertools
import threading
from typing import Optional, Sequence

from pdpool.engine.kv.offload.lru_index import RecordIndex
from pdpool.engine.kv.offload.record import Buffer
from pdpool.engine.kv.offload.store import nbytes


class MemoryStore:
    shared = False

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError("a KV offload tier needs a positive size")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._index = RecordIndex()
        self._records: dict[int, bytearray] = {}
        self._ids = itertools.count()

    @property
    def bytes_used(self) -> int:
        return self._index.bytes_used

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def get(self, key: str) -> Optional[bytearray]:
        """The record holding `key` (shared, never written to by readers)."""
        with self._lock:
            record = self._index.record_of(key)
            if record is None:
                return None
            self._index.touch(key)
            return self._records[record]  # type: ignore[index]

    def put(self, keys: Sequence[str], parts: Sequence[Buffer]) -> list[str]:
        size = nbytes(parts)
        if size > self.capacity_bytes:
            raise OSError(errno.EFBIG, f"a {size}-byte record exceeds the tier's size")
        data = bytearray().join(parts)
        evicted = []
        with self._lock:
            new = [k for k in keys if k not in self._index]
            for k in keys:
                self._index.touch(k)
            if not new:
                return []
            while self._index.bytes_used + size > self.capacity_bytes:
                old = self._index.oldest()
                if old is None:
                    break
                self._forget(old)
                evicted.append(old)
            record = next(self._ids)
            self._records[record] = data
            for k in new:
                self._index.add(k, record, size)
        return evicted

    def discard(self, key: str) -> None:
        with self._lock:
            record = self._index.record_of(key)
            for k in self._index.keys_of(record) if record is not None else []:
                self._forget(k)

    def _forget(self, key: str) -> None:
        freed = self._index.remove(key)
        if freed is not None:
            del self._records[freed]  # type: ignore[arg-type]

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)
