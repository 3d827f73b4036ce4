"""Host memory as a tier (vLLM's `native` backend): the same records as on disk, in a dict
bounded in bytes, least-recently-used out. On a GPU it keeps what leaves the device pool;
on CPU it only adds room beside the pool. Records are still checked on every read: one
format, one path, whatever the medium."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional


class MemoryStore:
    shared = False

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError("a KV offload tier needs a positive size")
        self.capacity_bytes = capacity_bytes
        self.bytes_used = 0
        self._lock = threading.Lock()
        self._records: "OrderedDict[str, bytes]" = OrderedDict()

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._records

    def get(self, key: str) -> Optional[bytes]:
        with self._lock:
            data = self._records.get(key)
            if data is not None:
                self._records.move_to_end(key)
            return data

    def put(self, key: str, data: bytes) -> list[str]:
        if len(data) > self.capacity_bytes:
            raise OSError(f"a {len(data)}-byte record exceeds the tier's size")
        evicted = []
        with self._lock:
            if key in self._records:
                self._records.move_to_end(key)
                return []
            while self._records and self.bytes_used + len(data) > self.capacity_bytes:
                old, blob = self._records.popitem(last=False)
                self.bytes_used -= len(blob)
                evicted.append(old)
            self._records[key] = data
            self.bytes_used += len(data)
        return evicted

    def discard(self, key: str) -> None:
        with self._lock:
            blob = self._records.pop(key, None)
            if blob is not None:
                self.bytes_used -= len(blob)

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)
