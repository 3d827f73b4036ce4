"""A directory of KV records, bounded in bytes, least-recently-used out.

One record holds many blocks (record.py), and each block is found by its own name: a
record is written whole to a temporary name, then hard-linked under the name of every
block it holds, and the temporary name removed, so a reader sees a whole record or none,
and a write costs one file however many blocks it carries (a file creation costs about a
millisecond here; a link, tens of microseconds). A record's disk space goes with its last
name. fsync policy: off by default. Every read checks the record's MAC (record.py), so a
crash or power loss that leaves a torn or empty file costs a miss, never a wrong token;
`fsync=True` (the `--kv-offloading-fsync` flag) adds durability across power loss for
those who want the tier to survive a node reboot, at a disk flush per record.

A shared directory (one volume mounted by every engine of a pool) is read by all: a key
this engine has not seen is looked up on disk, and each engine bounds the bytes it knows
of, deleting its least recently used. A record another engine deleted is a miss.
The index (lru_index.py; a record is known by its inode) is guarded by a lock: the engine
thread asks `contains`, I/O threads put and get.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
import threading
import time
from pathlib import Path
from typing import Optional, Protocol, Sequence

from pdpool.engine.kv.offload.lru_index import RecordIndex
from pdpool.engine.kv.offload.record import MAX_RECORD_BYTES, Buffer, RecordRejected

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

    @property
    def bytes_used(self) -> int: ...

    def contains(self, key: str) -> bool: ...

    def get(self, key: str) -> Optional[Buffer]: ...

    def put(self, keys: Sequence[str], parts: Sequence[Buffer]) -> list[str]: ...

    def discard(self, key: str) -> None: ...

    def __len__(self) -> int: ...


def nbytes(parts: Sequence[Buffer]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


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
        self._index = RecordIndex()
        self._subdirs: set[str] = set()
        self.root.mkdir(parents=True, exist_ok=True)
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise ValueError(f"KV offload path {self.root} is not a writable directory")
        self._scan()

    @property
    def bytes_used(self) -> int:
        return self._index.bytes_used

    # --- layout ---------------------------------------------------------------------------
    def path_of(self, key: str) -> Path:
        return self.root / key[:2] / (key + SUFFIX)

    def _scan(self) -> None:
        """Adopts the records already there (a restarted engine, or a pool's shared
        volume), oldest first, and removes temporary files left by dead writers."""
        found = []
        now = time.time()
        for sub in [self.root, *(d for d in self.root.iterdir() if d.is_dir())]:
            if sub != self.root and len(sub.name) != 2:
                continue
            for f in sub.iterdir():
                try:
                    st = f.stat()
                except OSError:
                    continue
                if f.name.startswith(TMP_PREFIX):
                    if not self.shared or now - st.st_mtime > STALE_TMP_S:
                        _unlink(f)
                elif sub != self.root and f.name.endswith(SUFFIX):
                    found.append((st.st_mtime, f.name[: -len(SUFFIX)], st.st_ino, st.st_size))
        for _, key, ino, size in sorted(found):
            self._index.add(key, ino, size)
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
            found = self.path_of(key).lstat()
        except OSError:
            return False
        with self._lock:
            self._index.add(key, found.st_ino, found.st_size)
        return True

    # --- I/O threads ---------------------------------------------------------------------
    def get(self, key: str) -> Optional[bytearray]:
        """The bytes of the record holding `key` (unchecked: the caller decodes and
        checks), None if absent; RecordRejected, unread, if larger than any record."""
        try:
            # Never a link, and never blocking on open: a FIFO or a symlink planted in a
            # shared directory must not stall the I/O thread or read another file.
            fd = os.open(self.path_of(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            with self._lock:
                self._index.remove(key)
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise RecordRejected("a symbolic link, not a record") from None
            raise
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RecordRejected("not a regular file")
            if st.st_size > MAX_RECORD_BYTES:
                raise RecordRejected(f"a {st.st_size}-byte file is larger than any record")
            data = bytearray(st.st_size)
            if f.readinto(data) != st.st_size:
                raise RecordRejected("record shorter than its file (changed while read)")
        with self._lock:
            self._index.touch(key)
        return data

    def put(self, keys: Sequence[str], parts: Sequence[Buffer]) -> list[str]:
        """Writes one record (`parts`, in order) named by every key not yet held; returns
        the keys evicted to make room. Raises OSError when the disk refuses (full,
        read-only): nothing partial stays behind."""
        size = nbytes(parts)
        if size > self.capacity_bytes:
            raise OSError(errno.EFBIG, f"a {size}-byte record exceeds the tier's size")
        with self._lock:
            new = [k for k in keys if k not in self._index]
            for k in keys:
                self._index.touch(k)
        if not new:
            return []
        evicted = self._evict_over(self.capacity_bytes - size)
        tmp = self.root / f"{TMP_PREFIX}{os.getpid()}.{secrets.token_hex(6)}"
        linked: list[str] = []
        try:
            ino = self._write(tmp, parts)
            self._link(tmp, new, linked)
        finally:
            _unlink(tmp)
            with self._lock:
                for key in linked:
                    self._index.add(key, ino, size)
        return evicted

    def _write(self, tmp: Path, parts: Sequence[Buffer]) -> int:
        """The whole record under a temporary name; its inode."""
        with open(tmp, "wb") as f:
            half = len(parts) // 2 if self._stall_s else 0
            for p in parts[:half]:
                f.write(p)
            if self._stall_s:
                f.flush()
                time.sleep(self._stall_s)
            for p in parts[half:]:
                f.write(p)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
            return os.fstat(f.fileno()).st_ino

    def _link(self, tmp: Path, keys: list[str], linked: list[str]) -> None:
        """Names the written record by each key, adding to `linked` the keys it did (a
        failure part way keeps those: each is a whole record)."""
        for key in keys:
            final = self.path_of(key)
            if final.parent.name not in self._subdirs:
                final.parent.mkdir(exist_ok=True)
                self._subdirs.add(final.parent.name)
            try:
                os.link(tmp, final)
            except FileExistsError:
                continue  # another engine of the pool wrote this block: its is as good
            linked.append(key)

    def discard(self, key: str) -> None:
        """Deletes a record found bad (every name of it this engine knows), so nobody
        reads it again."""
        with self._lock:
            record = self._index.record_of(key)
            keys = self._index.keys_of(record) if record is not None else []
            for k in keys:
                self._index.remove(k)
        for k in {key, *keys}:
            _unlink(self.path_of(k))

    def _evict_over(self, limit: int) -> list[str]:
        evicted: list[str] = []
        while True:
            with self._lock:
                key = self._index.oldest()
                if self._index.bytes_used <= limit or key is None:
                    return evicted
                self._index.remove(key)
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
