"""A configuration file that is re-read when it changes, and never half-read: the one
reloading for every such file (API keys, tenants).

A change is found by the content, not the modification time (two writes within one tick of
the file system's clock share a time): every `recheck_s` the file is read whole through one
descriptor, stat'ed (inode, size, mtime_ns) before and after the read. A read the writer
overlapped (the stat changed, or fewer bytes than the size) is no content at all, and new
content is taken only once it has read the same for `settle_s`: a file rewritten in place
passes through states that parse (the first 20 lines of a 40-line file), and none of them
may become the configuration. A new content that does not parse keeps the last good one,
with a warning (once per content). Replacing the file atomically (write a temporary file
beside it, then rename it over the old one, as a Kubernetes Secret volume does) is what
writers should do; this is for those that do not.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Callable, Generic, Optional, TypeVar

log = logging.getLogger("pdpool.reload")

T = TypeVar("T")


def read_whole(path: str) -> Optional[bytes]:
    """The file's bytes when no write overlapped the read; None when one did."""
    with open(path, "rb") as f:
        before = os.fstat(f.fileno())
        data = f.read()
        after = os.fstat(f.fileno())
    stamp = (before.st_ino, before.st_size, before.st_mtime_ns, before.st_ctime_ns)
    if stamp != (after.st_ino, after.st_size, after.st_mtime_ns, after.st_ctime_ns):
        return None
    return data if len(data) == after.st_size else None


class ReloadingFile(Generic[T]):
    """`parse(text)` of a file, kept current: `current()` re-reads at most every `recheck_s`.
    `parse` raises ValueError for a file it cannot take. The first load raises (a bad file at
    startup is a configuration error)."""

    def __init__(
        self,
        path: str,
        parse: Callable[[str], T],
        what: str,
        recheck_s: float = 1.0,
        settle_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path, self.parse, self.what = path, parse, what
        self.recheck_s, self.settle_s, self.clock = recheck_s, settle_s, clock
        data = read_whole(path)
        if data is None:  # being written at startup: once more, then refuse
            data = read_whole(path)
        if data is None:
            raise ValueError(f"{what} {path} changed while it was read")
        self._value = parse(data.decode("utf-8"))
        self._digest = hashlib.sha256(data).digest()
        self._seen: Optional[tuple[bytes, float]] = None  # new content, when first read
        self._refused: Optional[bytes] = None  # content that did not parse (warned once)
        self._checked = clock()

    def current(self) -> T:
        now = self.clock()
        wait = self.settle_s if self._seen is not None else self.recheck_s
        if now - self._checked >= wait:
            self._checked = now
            self._check(now)
        return self._value

    def _check(self, now: float) -> None:
        try:
            data = read_whole(self.path)
        except OSError as exc:
            log.warning("%s %s: %s; keeping the last good one", self.what, self.path, exc)
            return
        if data is None:  # a writer is at work: look again soon
            self._seen = (b"", now)
            return
        digest = hashlib.sha256(data).digest()
        if digest in (self._digest, self._refused):
            self._seen = None
            return
        if self._seen is None or self._seen[0] != digest:
            self._seen = (digest, now)  # new: taken once it has stayed so for settle_s
            return
        if now - self._seen[1] < self.settle_s:
            return
        self._seen = None
        self._adopt(data, digest)

    def _adopt(self, data: bytes, digest: bytes) -> None:
        try:
            value = self.parse(data.decode("utf-8"))
        except ValueError as exc:  # UnicodeDecodeError is one
            self._refused = digest
            log.warning("%s %s: %s; keeping the last good one", self.what, self.path, exc)
            return
        self._value, self._digest, self._refused = value, digest, None
        log.warning("%s reloaded from %s", self.what, self.path)
