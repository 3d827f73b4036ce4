"""The offload tier as the scheduler and the engine see it.

Scheduler side (engine thread, no I/O beyond a directory lookup on a shared tier):
- `lookup`: how many blocks past the local prefix hit the tier holds, for every KV group
  (and, for recurrent-state models, the state snapshot at the hit's end);
- `start_load`: the blocks allocated for them; the read runs on the I/O thread while the
  request waits as it waits on a remote load;
- `note_block` / `note_snapshot`: blocks and state snapshots just published to the prefix
  cache, to be written through to the tier.
Engine side: `save_pending` takes host copies of the noted blocks (right after the step
that computed them, before anything can reuse them) and queues their writes; `poll`
copies finished reads into the blocks and answers `LoadResult`s as a connector does.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
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
    tables: list[list[int]]
    state_slot: Optional[int]
    first: int  # first block loaded
    last: int  # one past the last block loaded
    started: float = field(default_factory=time.monotonic)
    cancelled: bool = False


# What one record may carry (the I/O thread's queue drops saves past 256 MiB in flight).
RECORD_MAX_BYTES = 64 << 20
RECORD_MAX_ENTRIES = 1024


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
        self._loads: dict[str, _Load] = {}
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
            "evictions": 0,
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

    def start_load(
        self,
        request_id: str,
        hashes: list[bytes],
        tables: list[list[int]],
        state_slot: Optional[int],
        first: int,
        last: int,
    ) -> None:
        keys = [
            self._key(KIND_KV, g, hashes[i])
            for i in range(first, last)
            for g in range(len(self.group_layers))
        ]
        if self.has_state:
            keys.append(self._key(KIND_STATE, 0, hashes[last - 1]))
        # Counted here, not at lookup: a request waiting for blocks looks up every step.
        self.counters["lookup_hits"] += 1
        self.counters["hit_tokens"] += (last - first) * self.block_size
        self._loads[request_id] = _Load([list(t) for t in tables], state_slot, first, last)
        self.worker.submit_load(LoadJob(request_id, keys))

    def cancel(self, request_id: str) -> None:
        """The request went away: its read's data is dropped when it comes back (the read
        writes only host memory, so its blocks may go at once)."""
        load = self._loads.get(request_id)
        if load is not None:
            load.cancelled = True

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
        (copied into their blocks). Call on the engine thread."""
        out = []
        for res in self.worker.results():
            if isinstance(res, Saved):
                self._on_saved(res)
            else:
                result = self._on_loaded(res)
                if result is not None:
                    out.append(result)
        return out

    def _on_saved(self, res: Saved) -> None:
        notes = [self._saving.pop(key, None) for key in res.keys]
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

    def _on_loaded(self, res: Loaded) -> Optional[LoadResult]:
        load = self._loads.pop(res.request_id, None)
        if load is None or load.cancelled:
            return None
        self.counters["load_seconds"] += res.seconds
        self.counters["load_bytes"] += res.nbytes
        if res.rejected_key is not None:
            self.counters["records_rejected"] += 1
        groups = len(self.group_layers)
        num_blocks = load.last - load.first
        # Whole blocks only: block i counts when every group's record of it arrived.
        whole = min(len(res.records) // groups, num_blocks)
        state_ok = self.has_state and len(res.records) == num_blocks * groups + 1
        applied = 0
        for i in range(whole):
            for g in range(groups):
                block_id = load.tables[g][load.first + i]
                dst = self.cache[block_id, : self.group_layers[g]]
                src = _tensor(res.records[i * groups + g][0], dst)
                if src is None:
                    break
                dst.copy_(src)
            else:
                applied += 1
                continue
            break
        if self.has_state:
            if state_ok and applied == num_blocks and self._apply_state(res.records[-1], load):
                return self._loaded(res.request_id, num_blocks)
            # Without the state at the end, the prefix cannot resume: start over.
            self.counters["loads_failed"] += 1
            log.info("tier load for %s: %s; recomputing", res.request_id, res.error or "no state")
            return LoadResult(res.request_id, 0, None, restart=True)
        return self._loaded(res.request_id, applied, res.error)

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
            "loads_in_flight": len(self._loads),
        }

    def close(self) -> None:
        self.worker.close()
