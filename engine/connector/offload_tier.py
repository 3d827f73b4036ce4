"""The offload tier as the scheduler and the engine see it.

Scheduler side (engine thread, no I/O beyond a directory lookup on a shared tier):
- `lookup`: how many blocks past the local prefix hit the tier holds, for every KV group
  (and, for recurrent-state models, the state snapshot at the hit's end);
- `prefetch`: a request just arrived whose prefix the tier holds: its read starts now,
  into host memory, while it waits in line for blocks (bounded in bytes; dropped with
  `cancel`);
- `start_load`: the blocks allocated for them; a read staged and done already is copied
  into them at once (the request runs in this step), else the read (the staged one, or a
  new one) runs on the I/O thread while the request waits as it waits on a remote load;
- `note_block` / `note_snapshot`: blocks and state snapshots just published to the prefix
  cache, to be written through to the tier.
Engine side: `save_pending` takes host copies of the noted blocks (right after the step
that computed them, before anything can reuse them) and queues their writes; `poll`
copies finished reads into the blocks and answers `LoadResult`s as a connector does.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from pdpool.engine.connector.base import LoadResult
from pdpool.engine.kv.offload.keys import KIND_KV, KIND_STATE, block_key
from pdpool.engine.kv.offload.record import Entry, TensorBlob
from pdpool.engine.kv.offload.store import RecordStore
from pdpool.engine.kv.offload.worker import IOWorker, LoadJob, Loaded, Saved, SaveJob

if TYPE_CHECKING:
    from pdpool.kv_events import KVEventPublisher

log = logging.getLogger("pdpool.kv.offload")

# vLLM's KV-event media (vllm/v1/kv_offload/base.py Medium): host memory, or storage.
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


@dataclass(frozen=True)
class BlockNote:
    """A block just published to the prefix cache (what its events need, too)."""

    group: int
    block_id: int
    block_hash: bytes
    parent_hash: Optional[bytes]
    token_ids: tuple[int, ...]
    kind: str  # full_attention / sliding_window, for the event
    owner: str = ""  # the request that computed it: a request's blocks share a record


@dataclass
class _Load:
    """Where a read's blocks go: the request's blocks, allocated."""

    tables: list[list[int]]
    state_slot: Optional[int]
    first: int  # first block loaded
    last: int  # one past the last block loaded
    offset: int = 0  # blocks of the read before `first` (the pool had them at admission)


@dataclass
class _Read:
    """One read of the I/O thread, for a request: staged (started at arrival, `load` None
    until its admission) or a load (blocks allocated, the request waiting on it)."""

    request_id: str
    first: int
    last: int
    num_keys: int
    staged_bytes: int = 0  # of the staging budget, held until the read is dropped or used
    load: Optional[_Load] = None
    result: Optional[Loaded] = None  # a staged read done before its request's admission
    cancelled: bool = False


# What one record may carry (the I/O thread's queue drops saves past 256 MiB in flight).
RECORD_MAX_BYTES = 64 << 20
RECORD_MAX_ENTRIES = 1024
# Host memory that reads staged for requests still in line may hold; past it a request
# reads at admission instead.
STAGE_MAX_BYTES = 256 << 20


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def _blob(t: torch.Tensor) -> TensorBlob:
    """A host tensor's bytes as a view (no copy: the tensor lives as long as the view)."""
    raw = t.reshape(-1).view(torch.uint8).numpy().data
    return TensorBlob(str(t.dtype).replace("torch.", ""), tuple(t.shape), raw)


def _block_entries(keys: list[str], copy: torch.Tensor) -> list[Entry]:
    """One entry per block of a gathered copy ([blocks, ...]): views of its rows."""
    whole = _blob(copy)
    per = memoryview(whole.data).nbytes // len(keys)
    shape = tuple(copy.shape[1:])
    return [
        Entry(k, [TensorBlob(whole.dtype, shape, whole.data[i * per : (i + 1) * per])])
        for i, k in enumerate(keys)
    ]


def _tensor(b: TensorBlob, like: torch.Tensor) -> Optional[torch.Tensor]:
    """The blob as a tensor shaped like the slot it goes into (a view of the record's
    buffer), None if it does not fit."""
    if b.dtype != str(like.dtype).replace("torch.", "") or tuple(b.shape) != tuple(like.shape):
        return None
    if memoryview(b.data).nbytes != like.numel() * like.element_size():
        return None
    flat = torch.frombuffer(b.data, dtype=torch.uint8)
    return flat.view(like.dtype).reshape(like.shape)


class KVOffload:
    def __init__(
        self,
        store: RecordStore,
        fingerprint: str,
        cache: torch.Tensor,
        group_layers: list[int],
        block_size: int,
        state_tensors: list[torch.Tensor],
        secret: Optional[bytes] = None,
        locality: str = "LOCAL",
        medium: str = "STORAGE",
        stage_max_bytes: int = STAGE_MAX_BYTES,
    ) -> None:
        self.medium = medium
        self.store = store
        self.fingerprint = fingerprint
        self.cache = cache
        self.group_layers = group_layers
        self.block_size = block_size
        self.state_tensors = state_tensors
        self.locality = locality
        self.worker = IOWorker(store, fingerprint, secret)
        self.events: Optional["KVEventPublisher"] = None
        self._notes: list[BlockNote] = []
        self._snapshot_notes: list[tuple[int, bytes]] = []
        self._saving: dict[str, Optional[BlockNote]] = {}  # keys being written
        # key -> what it names, for the removal events of keys this engine wrote
        self._named: dict[str, BlockNote] = {}
        # Reads in flight or staged, by ticket (a request may drop a staged read and start
        # another: the ticket tells their results apart); the request's current one.
        self._reads: dict[int, _Read] = {}
        self._ticket_of: dict[str, int] = {}
        self._tickets = itertools.count()
        self.stage_max_bytes = stage_max_bytes
        self._staged_bytes = 0
        self.counters: dict[str, float] = {
            "lookup_hits": 0,
            "hit_tokens": 0,
            "loads_ok": 0,
            "loads_failed": 0,
            "records_rejected": 0,
            "loaded_tokens": 0,
            "load_bytes": 0,
            "load_seconds": 0.0,
            "stores": 0,
            "store_failures": 0,
            "store_bytes": 0,
            "store_seconds": 0.0,
            "evictions": 0,
            "staged_reads": 0,  # reads started at a request's arrival
            "staged_ready": 0,  # ... done by its admission: copied at once, no wait
            "staged_skipped": 0,  # not staged: the staging budget was full
        }

    @property
    def has_state(self) -> bool:
        return bool(self.state_tensors)

    def _key(self, kind: str, group: int, block_hash: bytes) -> str:
        return block_key(self.fingerprint, kind, group, block_hash, None)

    def _has(self, key: str) -> bool:
        return key in self._saving or self.store.contains(key)

    # --- scheduler side ------------------------------------------------------------------
    def lookup(self, hashes: list[bytes], first: int, limit: int) -> int:
        """Blocks from `first` (the end of the local hit, in blocks) up to `limit` that the
        tier can serve, all groups and (state models) the state at the end; 0 if none."""
        if limit <= first:
            return 0
        end = first
        groups = range(len(self.group_layers))
        while end < limit and all(self._has(self._key(KIND_KV, g, hashes[end])) for g in groups):
            end += 1
        if self.has_state:
            while end > first and not self._has(self._key(KIND_STATE, 0, hashes[end - 1])):
                end -= 1
        return end - first

    def _keys(self, hashes: list[bytes], first: int, last: int) -> list[str]:
        keys = [
            self._key(KIND_KV, g, hashes[i])
            for i in range(first, last)
            for g in range(len(self.group_layers))
        ]
        if self.has_state:
            keys.append(self._key(KIND_STATE, 0, hashes[last - 1]))
        return keys

    def _block_bytes(self) -> int:
        per_layer = self.cache[0, 0].numel() * self.cache.element_size()
        return per_layer * sum(self.group_layers)

    def _submit_read(self, read: _Read, keys: list[str]) -> None:
        ticket = next(self._tickets)
        self._reads[ticket] = read
        self._ticket_of[read.request_id] = ticket
        self.worker.submit_load(LoadJob(str(ticket), keys))

    def prefetch(self, request_id: str, hashes: list[bytes], first: int, last: int) -> bool:
        """Starts reading blocks [first, last) of a request that just arrived, so the read
        overlaps its wait in line; False when the staging budget has no room (the read
        then starts at its admission)."""
        if request_id in self._ticket_of or last <= first:
            return False
        state = sum(t[0].numel() * t.element_size() for t in self.state_tensors)
        nbytes = (last - first) * self._block_bytes() + state
        if self._staged_bytes + nbytes > self.stage_max_bytes:
            self.counters["staged_skipped"] += 1
            return False
        self._staged_bytes += nbytes
        self.counters["staged_reads"] += 1
        keys = self._keys(hashes, first, last)
        self._submit_read(_Read(request_id, first, last, len(keys), nbytes), keys)
        return True

    def start_load(
        self,
        request_id: str,
        hashes: list[bytes],
        tables: list[list[int]],
        state_slot: Optional[int],
        first: int,
        last: int,
    ) -> Optional[LoadResult]:
        """Loads blocks [first, last) into the request's blocks. A read staged at its
        arrival that covers `first` serves (up to where it ends); done already, it is
        copied now and its result returned; else the result comes from `poll`."""
        # Counted here, not at lookup: a request waiting for blocks looks up every step.
        self.counters["lookup_hits"] += 1
        self.counters["hit_tokens"] += (last - first) * self.block_size
        tables = [list(t) for t in tables]
        ticket = self._ticket_of.get(request_id)
        read = self._reads.get(ticket) if ticket is not None else None
        # A state model resumes from the state at the read's end: it must be in the blocks.
        if (
            read is not None
            and read.load is None
            and read.first <= first < read.last
            and (read.last <= last if self.has_state else True)
        ):
            read.load = _Load(tables, state_slot, first, min(last, read.last), first - read.first)
            if read.result is None:
                return None  # still reading: the request waits on it
            self.counters["staged_ready"] += 1
            assert ticket is not None
            return self._finish_read(ticket, read.result)
        self.cancel(request_id)
        keys = self._keys(hashes, first, last)
        self._submit_read(
            _Read(request_id, first, last, len(keys), load=_Load(tables, state_slot, first, last)),
            keys,
        )
        return None

    def cancel(self, request_id: str) -> None:
        """The request went away, or will not use its staged read: the read's data is
        dropped (now, or when it comes back: a read writes only host memory, so the
        request's blocks may go at once)."""
        ticket = self._ticket_of.pop(request_id, None)
        if ticket is None:
            return
        read = self._reads[ticket]
        if read.result is not None:
            self._drop(ticket)
        else:
            read.cancelled = True

    def _drop(self, ticket: int) -> _Read:
        read = self._reads.pop(ticket)
        self._staged_bytes -= read.staged_bytes
        if self._ticket_of.get(read.request_id) == ticket:
            del self._ticket_of[read.request_id]
        return read

    def note_block(self, note: BlockNote) -> None:
        self._notes.append(note)

    def note_snapshot(self, slot: int, block_hash: bytes) -> None:
        self._snapshot_notes.append((slot, block_hash))

    # --- engine side ---------------------------------------------------------------------
    def save_pending(self) -> None:
        """Host copies of the noted blocks and snapshots, now (their memory may be reused
        once this step is over): one gather per request and KV group. Encoding, MAC and
        write go to the I/O thread, one record per request and group."""
        notes, self._notes = self._notes, []
        runs: dict[tuple[str, int], list[tuple[str, BlockNote]]] = {}
        seen: set[str] = set()
        for note in notes:
            key = self._key(KIND_KV, note.group, note.block_hash)
            if key in seen or self._has(key):
                continue
            seen.add(key)
            runs.setdefault((note.owner, note.group), []).append((key, note))
        for (_, group), run in runs.items():
            n = self.group_layers[group]
            block_bytes = self.cache[0, :n].numel() * self.cache.element_size()
            step = max(1, min(RECORD_MAX_ENTRIES, RECORD_MAX_BYTES // block_bytes))
            for i in range(0, len(run), step):
                self._submit_blocks(run[i : i + step], n)
        snaps, self._snapshot_notes = self._snapshot_notes, []
        entries: list[Entry] = []
        for slot, block_hash in snaps:
            key = self._key(KIND_STATE, 0, block_hash)
            if key in seen or self._has(key):
                continue
            seen.add(key)
            entries.append(Entry(key, [_blob(_host_copy(t[slot])) for t in self.state_tensors]))
        for i in range(0, len(entries), RECORD_MAX_ENTRIES):
            chunk = entries[i : i + RECORD_MAX_ENTRIES]
            size = sum(memoryview(t.data).nbytes for e in chunk for t in e.tensors)
            self._submit([e.key for e in chunk], [None] * len(chunk), chunk.copy, size)

    def _submit_blocks(self, run: list[tuple[str, BlockNote]], num_layers: int) -> None:
        keys = [k for k, _ in run]
        ids = torch.tensor([note.block_id for _, note in run], device=self.cache.device)
        copy = _host_copy(self.cache[ids, :num_layers])
        nbytes = copy.numel() * copy.element_size()
        notes: list[Optional[BlockNote]] = [note for _, note in run]
        self._submit(keys, notes, lambda: _block_entries(keys, copy), nbytes)

    def _submit(
        self,
        keys: list[str],
        notes: list[Optional[BlockNote]],
        entries: Callable[[], list[Entry]],
        nbytes: int,
    ) -> None:
        """Best effort: a save the I/O thread has no room for is dropped (a later miss)."""
        if self.worker.submit_save(SaveJob(keys, entries, nbytes)):
            for key, note in zip(keys, notes, strict=True):
                self._saving[key] = note

    def poll(self) -> list[LoadResult]:
        """Applies what the I/O thread finished: writes (events, evictions) and reads
        (copied into their blocks; a staged read is kept until its request is admitted).
        Call on the engine thread."""
        out = []
        for res in self.worker.results():
            if isinstance(res, Saved):
                self._on_saved(res)
                continue
            ticket = int(res.request_id)
            read = self._reads.get(ticket)
            if read is None:
                continue
            if read.cancelled:
                self._drop(ticket)
            elif read.load is None:
                read.result = res  # staged: its request still waits in line
            else:
                result = self._finish_read(ticket, res)
                if result is not None:
                    out.append(result)
        return out

    def _on_saved(self, res: Saved) -> None:
        notes = [self._saving.pop(key, None) for key in res.keys]
        self.counters["store_seconds"] += res.seconds
        for key in res.evicted:
            self.counters["evictions"] += 1
            gone = self._named.pop(key, None)
            if gone is not None:
                self._record_removed(gone)
        if not res.ok:
            self.counters["store_failures"] += len(res.keys)
            return
        self.counters["stores"] += len(res.keys)
        self.counters["store_bytes"] += res.nbytes
        for key, note in zip(res.keys, notes, strict=True):
            if note is not None:
                self._named[key] = note
                self._record_stored(note)

    def _finish_read(self, ticket: int, res: Loaded) -> LoadResult:
        """Copies a read's records into the request's blocks (whole blocks only, up to the
        first that failed its check); the request's LoadResult."""
        read = self._drop(ticket)
        load = read.load
        assert load is not None
        self.counters["load_seconds"] += res.seconds
        self.counters["load_bytes"] += res.nbytes
        if res.rejected_key is not None:
            self.counters["records_rejected"] += 1
        groups = len(self.group_layers)
        num_blocks = load.last - load.first
        records = res.records[load.offset * groups :]
        # Whole blocks only: block i counts when every group's record of it arrived.
        whole = min(len(records) // groups, num_blocks)
        state_ok = self.has_state and len(res.records) == read.num_keys
        applied = 0
        for i in range(whole):
            for g in range(groups):
                block_id = load.tables[g][load.first + i]
                dst = self.cache[block_id, : self.group_layers[g]]
                src = _tensor(records[i * groups + g][0], dst)
                if src is None:
                    break
                dst.copy_(src)
            else:
                applied += 1
                continue
            break
        rid = read.request_id
        if self.has_state:
            if state_ok and applied == num_blocks and self._apply_state(res.records[-1], load):
                return self._loaded(rid, num_blocks)
            # Without the state at the end, the prefix cannot resume: start over.
            self.counters["loads_failed"] += 1
            log.info("tier load for %s: %s; recomputing", rid, res.error or "no state")
            return LoadResult(rid, 0, None, restart=True)
        return self._loaded(rid, applied, res.error)

    def _apply_state(self, blobs: list[TensorBlob], load: _Load) -> bool:
        """Copies a state record into the request's running slot; False if it does not fit."""
        slot = load.state_slot
        if slot is None or len(blobs) != len(self.state_tensors):
            return False
        srcs = [_tensor(b, t[slot]) for b, t in zip(blobs, self.state_tensors, strict=True)]
        if any(s is None for s in srcs):
            return False
        for s, t in zip(srcs, self.state_tensors, strict=True):
            t[slot].copy_(s)  # type: ignore[arg-type]
        return True

    def _loaded(self, request_id: str, num_blocks: int, error: Optional[str] = None) -> LoadResult:
        """A tier miss is never a request's failure (whatever --kv-load-failure-policy says
        of remote loads): what did not load is computed."""
        tokens = num_blocks * self.block_size
        self.counters["loads_ok" if error is None else "loads_failed"] += 1
        self.counters["loaded_tokens"] += tokens
        if error is not None:
            log.info("tier load for %s stopped after %d tokens: %s", request_id, tokens, error)
        return LoadResult(request_id, tokens, None)

    # --- KV events -----------------------------------------------------------------------
    def _record_stored(self, note: BlockNote) -> None:
        if self.events is None:
            return
        from pdpool.kv_events import BlockStored

        self.events.record(
            BlockStored(
                [note.block_hash],
                note.parent_hash,
                list(note.token_ids),
                self.block_size,
                None,
                self.medium,
                note.group,
                note.kind,
                None,
                locality=self.locality,
            )
        )

    def _record_removed(self, note: BlockNote) -> None:
        if self.events is None:
            return
        from pdpool.kv_events import BlockRemoved

        self.events.record(
            BlockRemoved([note.block_hash], self.medium, note.group, locality=self.locality)
        )

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters,
            "bytes_used": self.store.bytes_used,
            "capacity_bytes": self.store.capacity_bytes,
            "records": len(self.store),
            "saves_dropped": self.worker.saves_dropped,
            "loads_in_flight": sum(r.load is not None for r in self._reads.values()),
            "staged_bytes": self._staged_bytes,
        }

    def close(self) -> None:
        self.worker.close()
