"""One I/O thread per tier: record encoding, MACs, writes and reads happen here, never on
the step loop (the MAC and the file I/O release the GIL).

Jobs are queued by the engine thread and results come back through a queue it drains once
per step. Loads go before saves (a waiting request is worth more than a future hit), and
saves beyond a byte budget are dropped rather than queued without bound: an offload write
is best effort, so a slow disk costs hits (a dropped write is a later miss), never memory
or step time. A load reads each record once, however many of its blocks it wants.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from pdpool.engine.kv.offload.record import (
    Entry,
    RecordRejected,
    TensorBlob,
    decode_record,
    record_parts,
)
from pdpool.engine.kv.offload.store import RecordStore

log = logging.getLogger("pdpool.kv.offload")


@dataclass
class SaveJob:
    """One record: its entries built on the I/O thread from host copies the engine thread
    took (views of them, no copy)."""

    keys: list[str]
    entries: Callable[[], list[Entry]]
    nbytes: int


@dataclass
class LoadJob:
    request_id: str
    keys: list[str]  # in order: a failure keeps only what came before it


@dataclass
class Saved:
    keys: list[str]
    ok: bool
    nbytes: int
    evicted: list[str]
    error: Optional[str] = None
    seconds: float = 0.0  # encoding, MAC and write


@dataclass
class Loaded:
    request_id: str
    records: list[list[TensorBlob]]  # the first len(records) keys, each checked
    nbytes: int
    seconds: float
    error: Optional[str] = None
    rejected_key: Optional[str] = None  # a record that failed its check (discarded)


Result = Union[Saved, Loaded]


@dataclass(order=True)
class _Queued:
    priority: int
    seq: int
    job: Union[SaveJob, LoadJob, None] = field(compare=False)


class IOWorker:
    def __init__(
        self,
        store: RecordStore,
        fingerprint: str,
        secret: Optional[bytes] = None,
        max_pending_save_bytes: int = 256 << 20,
    ) -> None:
        self.store, self.fingerprint, self.secret = store, fingerprint, secret
        self.max_pending_save_bytes = max_pending_save_bytes
        self._jobs: "queue.PriorityQueue[_Queued]" = queue.PriorityQueue()
        self._results: "queue.SimpleQueue[Result]" = queue.SimpleQueue()
        self._seq = itertools.count()
        self._pending_save_bytes = 0
        self._lock = threading.Lock()
        # Set when a result is ready: an engine with nothing to compute waits on it.
        self._ready = threading.Event()
        self.saves_dropped = 0
        self._thread = threading.Thread(target=self._run, name="kv-offload-io", daemon=True)
        self._thread.start()

    # --- the engine thread ---------------------------------------------------------------
    def submit_save(self, job: SaveJob) -> bool:
        with self._lock:
            if self._pending_save_bytes + job.nbytes > self.max_pending_save_bytes:
                self.saves_dropped += 1
                return False
            self._pending_save_bytes += job.nbytes
        self._jobs.put(_Queued(1, next(self._seq), job))
        return True

    def submit_load(self, job: LoadJob) -> None:
        self._jobs.put(_Queued(0, next(self._seq), job))

    def wait(self, timeout: float) -> None:
        """Returns when a result is ready, or after `timeout` seconds."""
        self._ready.wait(timeout)

    def results(self) -> list[Result]:
        self._ready.clear()  # before draining: a result put after this sets it again
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def close(self, timeout: float = 5.0) -> None:
        self._jobs.put(_Queued(2, next(self._seq), None))
        self._thread.join(timeout)

    # --- the I/O thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item.job is None:
                return
            try:
                if isinstance(item.job, SaveJob):
                    self._results.put(self._save(item.job))
                else:
                    self._results.put(self._load(item.job))
            except Exception as exc:  # never let one job end the thread
                log.exception("KV offload I/O job failed")
                if isinstance(item.job, LoadJob):
                    self._results.put(Loaded(item.job.request_id, [], 0, 0.0, str(exc)))
            self._ready.set()

    def _save(self, job: SaveJob) -> Saved:
        start = time.monotonic()
        try:
            parts = record_parts(self.fingerprint, job.entries(), self.secret)
            evicted = self.store.put(job.keys, parts)
            size = sum(memoryview(p).nbytes for p in parts)
            return Saved(job.keys, True, size, evicted, None, time.monotonic() - start)
        except OSError as exc:
            log.warning("KV offload write failed (%s): the blocks stay uncached", exc)
            return Saved(job.keys, False, 0, [], str(exc), time.monotonic() - start)
        finally:
            with self._lock:
                self._pending_save_bytes -= job.nbytes

    def _load(self, job: LoadJob) -> Loaded:
        start = time.monotonic()
        records: list[list[TensorBlob]] = []
        read: dict[str, list[TensorBlob]] = {}  # entries of the records read so far
        nbytes = 0

        def stop(error: str, rejected: Optional[str] = None) -> Loaded:
            took = time.monotonic() - start
            return Loaded(job.request_id, records, nbytes, took, error, rejected)

        for key in job.keys:
            if key not in read:
                try:
                    data = self.store.get(key)
                    if data is None:
                        return stop(f"{key} is gone")
                    read.update(decode_record(data, self.fingerprint, key, self.secret))
                except RecordRejected as exc:
                    log.warning("KV offload record %s rejected: %s (recomputing)", key, exc)
                    self.store.discard(key)
                    return stop(str(exc), key)
                except OSError as exc:
                    return stop(str(exc))
                nbytes += len(data)
            records.append(read[key])
        return Loaded(job.request_id, records, nbytes, time.monotonic() - start)
