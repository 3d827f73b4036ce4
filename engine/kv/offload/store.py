"""A directory of KV records, bounded in bytes, least-recently-used out.

Writes are atomic: a record is written to a temporary name in its final directory, then
renamed over its final name, so a reader sees a whole record or none. fsync policy: off by
default. Every read checks the record's digest (record.py), so a crash or power loss that
leaves a torn or empty file costs a miss, never a wrong token; `fsync=True` (the
`--kv-offloading-fsync` flag) adds durability across power loss for those who want the
tier to survive a node reboot, at a disk flush per record.

A shared directory (one volume mounted by every engine of a pool) is read by all: a key
this engine has not seen is looked up on disk, and each engine bounds the bytes it knows
of, deleting its least recently used. A record another engine deleted is a miss.
The index is guarded by a lock: the engine thread asks `contains`, I/O threads put and get.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Optional, Protocol

log = logging.getLogger("pdpool.kv.offload")

SUFFIX = ".kv"
TMP_PREFIX = ".tmp."
# A temporary file this old in a shared directory belongs to a writer that died.
STALE_TMP_S = 600.0
# Test-only: each record write stops this many seconds after half of it, so a test can
# kill the engine mid-write (armed from the engine's environment, never by a client).
STALL_WRITE_ENV = "PDPOOL_TEST_OFFLOAD_STALL_WRITE_S"


class RecordStore(Protocol):
    """What the I/O thread and the tier need of a store (FileStore, MemoryStore)."""

    shared: bool
    capacity_bytes: int
    bytes_used: int

    def contains(self, key: str) -> bool: ...

    def get(self, key: str) -> Optional[bytes]: ...

    def put(self, key: str, data: bytes) -> list[str]: ...

    def discard(self, key: str) -> None: ...

    def __len__(self) -> int: ...


class FileStore:
    def __init__(
        self, root: str | Path, capacity_bytes: int, shared: bool = False, fsync: bool = False
    ) -> None:
        if capacity_bytes < 1:
            raise ValueError("a KV offload tier needs a positive size")
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.shared = shared
        self.fsync = fsync
        self._stall_s = float(os.environ.get(STALL_WRITE_ENV) or 0)
        self._lock = threading.Lock()
        self._index: "OrderedDict[str, int]" = OrderedDict()  # key -> bytes, LRU first
        self.bytes_used = 0
        self.root.mkdir(parents=True, exist_ok=True)
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise ValueError(f"KV offload path {self.root} is not a writable directory")
        self._scan()

    # --- layout ---------------------------------------------------------------------------
    def path_of(self, key: str) -> Path:
        return self.root / key[:2] / (key + SUFFIX)

    def _scan(self) -> None:
        """Adopts the records already there (a restarted engine, or a pool's shared
        volume), oldest first, and removes temporary files left by dead writers."""
        found = []
        now = time.time()
        for sub in self.root.iterdir():
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for f in sub.iterdir():
                try:
                    st = f.stat()
                except OSError:
                    continue
                if f.name.startswith(TMP_PREFIX):
                    if not self.shared or now - st.st_mtime > STALE_TMP_S:
                        _unlink(f)
                elif f.name.endswith(SUFFIX):
                    found.append((st.st_mtime, f.name[: -len(SUFFIX)], st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.bytes_used += size
        self._evict_over(self.capacity_bytes)

    # --- the engine thread's question ---------------------------------------------------
    def contains(self, key: str) -> bool:
        with self._lock:
            if key in self._index:
                return True
        if not self.shared:
            return False
        # Another engine of the pool may have written it.
        try:
            size = self.path_of(key).stat().st_size
        except OSError:
            return False
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self.bytes_used += size
        return True

    # --- I/O threads ---------------------------------------------------------------------
    def get(self, key: str) -> Optional[bytes]:
        """The record's bytes (unchecked: the caller decodes and checks), None if absent."""
        try:
            data = self.path_of(key).read_bytes()
        except FileNotFoundError:
            self._forget(key)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        return data

    def put(self, key: str, data: bytes) -> list[str]:
        """Writes a record atomically; returns the keys evicted to make room. Raises
        OSError when the disk refuses (full, read-only): nothing partial stays behind."""
        size = len(data)
        if size > self.capacity_bytes:
            raise OSError(errno.EFBIG, f"a {size}-byte record exceeds the tier's size")
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return []
        evicted = self._evict_over(self.capacity_bytes - size)
        final = self.path_of(key)
        final.parent.mkdir(exist_ok=True)
        tmp = final.parent / f"{TMP_PREFIX}{key}.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            with open(tmp, "wb") as f:
                if self._stall_s:
                    f.write(data[: len(data) // 2])
                    f.flush()
                    time.sleep(self._stall_s)
                f.write(data[len(data) // 2 :] if self._stall_s else data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            _unlink(tmp)
            raise
        with self._lock:
            if key not in self._index:
                self.bytes_used += size
            self._index[key] = size
        return evicted

    def discard(self, key: str) -> None:
        """Deletes a record found bad, so nobody reads it again."""
        _unlink(self.path_of(key))
        self._forget(key)

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.bytes_used -= size

    def _evict_over(self, limit: int) -> list[str]:
        evicted: list[str] = []
        while True:
            with self._lock:
                if self.bytes_used <= limit or not self._index:
                    return evicted
                key, size = self._index.popitem(last=False)
                self.bytes_used -= size
            _unlink(self.path_of(key))
            evicted.append(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)
