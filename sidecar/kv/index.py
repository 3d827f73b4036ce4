"""Who caches what: one index of KV blocks across engines, fed by KV cache events.

Keys are our own names for blocks: `hash_key` of pdpool's chained hash (`pdpool/block_hash.py`)
of the block's tokens, recomputed here from each `BlockStored`'s token ids, parent and extra
keys (the salt). So an engine that names blocks its own way (stock vLLM: sha256 of CBOR or
Python's hash, seeded per process) is indexed under the names a request's prompt gets here,
and one lookup serves every engine. An engine's own hash is kept only where it differs from
ours, to follow its parent links and removals; a block whose chain cannot be followed (its
parent was never seen, or no token ids) is indexed under the engine's hash as published.
No torch.

Per engine:
- an LRU-ordered set of the block keys it holds (capped: `max_blocks_per_engine`; the oldest
  are forgotten first, which can only under-estimate a hit);
- the next sequence number it should send. A gap (a message lost) asks the engine's replay
  socket for the missing messages (the caller passes a `replay` function); when that fails
  the engine is marked *unknown* (its hits are not trusted, routing falls back to hash
  affinity) until an `AllBlocksCleared` arrives or a replay of its whole history (from
  seq 0, tried every `RESYNC_EVERY_S` while unknown, until the engine's buffer no longer
  reaches back to 0) rebuilds the index of it;
- a sequence number that goes backwards means the engine restarted: its blocks are dropped;
- joining late (first message seq > 0), what the replay buffer still holds is applied first;
- an engine subscribed to (`watch`) that has published nothing yet counts as holding nothing
  (an engine publishes from its first stored block on), so requests routed before its first
  event leave expectations and pending work there; had the gateway joined an idle engine
  late, its blocks come with its first message's replay.

`prefix_hit_blocks(engine, keys)` is the number of leading blocks of a request that the
engine holds: the caller computes the request's chained hashes exactly as engines do
(`request_block_keys`).

Offload tiers (vLLM's `medium`): events with medium CPU or STORAGE name blocks in a tier
below an engine's pool, kept apart from the pool's (a pool eviction leaves the tier's copy,
and a tier eviction the pool's). A tier that is REMOTE (a directory shared by the pool) is
one set for every engine that publishes to it: a prefix one engine wrote there is a load,
not a recompute, for all of them. `tier_hit_blocks` counts the blocks after a pool hit
that a tier holds; the router prices them between a pool hit and a recompute.

Routed, not yet stored: `expect(engine, keys)` records that a request was just sent there, so
its blocks count as held for `expect_s` (events arrive only after the engine has computed
them; meanwhile a burst of requests sharing a new prefix would each see an empty cache and
scatter). A stored or removed event replaces the expectation; unconfirmed ones lapse. The
expectations not yet confirmed are also the engine's queued prefill work (`pending_blocks`),
which the router counts as load.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from pdpool.block_hash import chain_hashes, hash_block
from pdpool.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, hash_key

log = logging.getLogger(__name__)

# How often an engine whose index is untrusted asks for its whole history again.
RESYNC_EVERY_S = 2.0

Replay = Callable[[int], list[tuple[int, KVEventBatch]]]


@dataclass
class EngineBlocks:
    blocks: "OrderedDict[int, None]" = field(default_factory=OrderedDict)
    # The engine's key for a block -> our chained digest of it, where the two differ.
    ours: "OrderedDict[int, bytes]" = field(default_factory=OrderedDict)
    # Blocks of requests just routed here, not yet reported stored: key -> until (monotonic).
    expected: "OrderedDict[int, float]" = field(default_factory=OrderedDict)
    next_seq: Optional[int] = None
    known: bool = True
    gaps: int = 0
    restarts: int = 0
    resync_at: float = 0.0  # while unknown: when to ask for the whole history again
    events: int = 0
    # The group whose events count (the first full-attention group seen); None: any.
    group: Optional[int] = None
    # Blocks in the engine's own offload tier (medium CPU/STORAGE, locality not REMOTE).
    tier: "OrderedDict[int, None]" = field(default_factory=OrderedDict)
    # It publishes to the pool's shared tier (so it mounts it).
    shares_tier: bool = False


# vLLM's media below the device pool (vllm/v1/kv_offload/base.py Medium).
TIER_MEDIA = ("CPU", "STORAGE")


class KVIndex:
    def __init__(self, max_blocks_per_engine: int = 1_000_000, expect_s: float = 5.0):
        self.max_blocks = max_blocks_per_engine
        self.expect_s = expect_s
        self.engines: dict[str, EngineBlocks] = {}
        # Blocks in the tier shared by the pool (REMOTE), whoever wrote them.
        self.shared_tier: "OrderedDict[int, None]" = OrderedDict()
        # LoRA adapters engines published blocks under (BlockStored.lora_name): a request
        # whose `model` is one of them is keyed as that adapter's blocks.
        self.lora_names: set[str] = set()
        self._lock = threading.Lock()

    # --- feeding -------------------------------------------------------------------------
    def on_message(
        self,
        engine: str,
        seq: int,
        batch: KVEventBatch,
        replay: Optional[Replay] = None,
    ) -> None:
        """One PUB message from `engine`. `replay(start)` fetches missed messages; it is
        called without the lock held (a replay socket that is slow to answer must not
        stall the routing decisions that read this index meanwhile). One thread feeds each
        engine, so its state cannot move on between the two locked parts."""
        with self._lock:
            st = self.engines.setdefault(engine, EngineBlocks())
            start = self._replay_start(st, seq) if replay is not None else None
        fetched = replay(start) if replay is not None and start is not None else []
        with self._lock:
            st = self.engines.setdefault(engine, EngineBlocks())
            self._catch_up(engine, st, seq, start, fetched)
            st.next_seq = seq + 1
            self._apply(st, batch)

    @staticmethod
    def _replay_start(st: EngineBlocks, seq: int) -> Optional[int]:
        """Where the messages before `seq` must be replayed from (None: nothing to fetch)."""
        if st.next_seq is None:
            return 0 if seq > 0 else None  # joined late: what the engine still buffers
        if seq > st.next_seq:
            return st.next_seq  # a gap
        if seq == st.next_seq and not st.known and time.monotonic() >= st.resync_at:
            return 0  # untrusted: its whole history, to rebuild it
        return None

    def _catch_up(
        self,
        engine: str,
        st: EngineBlocks,
        seq: int,
        start: Optional[int],
        fetched: list[tuple[int, KVEventBatch]],
    ) -> None:
        """Brings the engine's state up to just before message `seq`, with the messages
        replayed from `start`."""
        got = [(s, b) for s, b in fetched if start is not None and start <= s < seq]
        complete = start is not None and [s for s, _ in got] == list(range(start, seq))
        if st.next_seq is None:
            # Joined late (the gateway restarted). If the buffer no longer reaches back to
            # 0 the index starts partial (it under-estimates).
            self._apply_all(st, got)
            if start is not None and not complete:
                log.warning("%s: joined at event %d, %d earlier replayed", engine, seq, len(got))
        elif seq < st.next_seq:
            # The counter went back: the engine restarted with an empty cache.
            self._clear(st)
            st.restarts += 1
        elif seq > st.next_seq:
            st.gaps += 1
            if complete:
                self._apply_all(st, got)
            else:
                log.warning(
                    "%s: events %d-%d lost and not replayed: its blocks are not trusted",
                    engine,
                    st.next_seq,
                    seq - 1,
                )
                st.known = False
                st.resync_at = time.monotonic() + RESYNC_EVERY_S
        elif start == 0 and not st.known:
            wrapped = bool(got) and got[0][0] > 0  # its buffer has let go of the start
            # Once wrapped, never whole again: no more fetching and decoding it for nothing.
            st.resync_at = float("inf") if wrapped else time.monotonic() + RESYNC_EVERY_S
            if complete:  # the whole history is still buffered: rebuild from it
                self._clear(st)
                st.tier.clear()
                self._apply_all(st, got)
                log.warning("%s: its blocks are trusted again (%d events replayed)", engine, seq)

    @staticmethod
    def _clear(st: EngineBlocks) -> None:
        """Its pool holds nothing, and is trusted to (an engine that restarted or cleared
        its cache; what its offload tier holds is told by the tier's own events)."""
        st.blocks.clear()
        st.ours.clear()
        st.expected.clear()
        st.known = True

    def _apply_all(self, st: EngineBlocks, messages: list[tuple[int, KVEventBatch]]) -> None:
        for _, batch in messages:
            self._apply(st, batch)

    def _apply(self, st: EngineBlocks, batch: KVEventBatch) -> None:
        for ev in batch.events:
            st.events += 1
            if isinstance(ev, AllBlocksCleared):
                self._clear(st)
            elif isinstance(ev, BlockStored):
                self._stored(st, ev)
            elif isinstance(ev, BlockRemoved):
                self._removed(st, ev)

    @staticmethod
    def _other_group(st: EngineBlocks, group: Optional[int]) -> bool:
        """The event is of a KV cache group other than the one this index follows."""
        return group is not None and st.group is not None and group != st.group

    def _stored(self, st: EngineBlocks, ev: BlockStored) -> None:
        if isinstance(ev.lora_name, str) and len(self.lora_names) < MAX_LORA_NAMES:
            self.lora_names.add(ev.lora_name)
        group = ev.group_idx
        if (
            st.group is None
            and group is not None
            and ev.kv_cache_spec_kind in (None, "full_attention")
        ):
            st.group = group
        if self._other_group(st, group):
            return
        if ev.medium in TIER_MEDIA:
            self._tier_stored(st, ev)
            return
        for k in self._our_keys(st, ev):
            st.blocks[k] = None
            st.blocks.move_to_end(k)
            st.expected.pop(k, None)
        while len(st.blocks) > self.max_blocks:
            st.blocks.popitem(last=False)
        while len(st.ours) > self.max_blocks:
            st.ours.popitem(last=False)

    def _tier_set(self, st: EngineBlocks, locality: Optional[str]) -> "OrderedDict[int, None]":
        if locality == "REMOTE":
            st.shares_tier = True
            return self.shared_tier
        return st.tier

    def _tier_stored(self, st: EngineBlocks, ev: BlockStored) -> None:
        tier = self._tier_set(st, ev.locality)
        for k in self._our_keys(st, ev):
            tier[k] = None
            tier.move_to_end(k)
        while len(tier) > self.max_blocks:
            tier.popitem(last=False)

    def _removed(self, st: EngineBlocks, ev: BlockRemoved) -> None:
        if self._other_group(st, ev.group_idx):
            return
        if ev.medium in TIER_MEDIA:  # the pool's copy (if any) stays, and the name mapping
            tier = self._tier_set(st, ev.locality)
            for h in ev.block_hashes:
                k = hash_key(h)
                digest = st.ours.get(k)
                tier.pop(hash_key(digest) if digest is not None else k, None)
            return
        for h in ev.block_hashes:
            k = hash_key(h)
            digest = st.ours.pop(k, None)
            ours = hash_key(digest) if digest is not None else k
            st.blocks.pop(ours, None)
            st.expected.pop(ours, None)

    @staticmethod
    def _our_keys(st: EngineBlocks, ev: BlockStored) -> list[int]:
        """Our keys for a stored run of blocks, chained from its parent; the engine's own
        where the chain cannot be followed."""
        native = [hash_key(h) for h in ev.block_hashes]
        bs, tokens = ev.block_size, ev.token_ids
        if bs <= 0 or len(tokens) != bs * len(native):
            return native
        parent: Optional[bytes] = None
        if ev.parent_block_hash is not None:
            pk = hash_key(ev.parent_block_hash)
            parent = st.ours.get(pk)
            if parent is None:
                raw = ev.parent_block_hash
                if not (isinstance(raw, bytes) and len(raw) == 32 and pk in st.blocks):
                    return native  # a parent we never saw: the chain is lost
                parent = raw  # the engine names blocks as we do
        extras = ev.extra_keys or [None] * len(native)
        keys = []
        for i, k in enumerate(native):
            extra = extras[i] if i < len(extras) and extras[i] else ()
            parent = hash_block(parent, tokens[i * bs : (i + 1) * bs], tuple(extra))
            ours = hash_key(parent)
            if ours != k:
                st.ours[k] = parent
                st.ours.move_to_end(k)
            keys.append(ours)
        return keys

    def watch(self, engine: str) -> None:
        """`engine`'s events are subscribed to: it counts as known (and empty) from now."""
        with self._lock:
            self.engines.setdefault(engine, EngineBlocks())

    def forget(self, engine: str) -> None:
        with self._lock:
            self.engines.pop(engine, None)

    # --- queries -------------------------------------------------------------------------
    def knows(self, engine: str) -> bool:
        st = self.engines.get(engine)
        return st is not None and st.known

    def prefix_hit_blocks(self, engine: str, keys: Sequence[int]) -> Optional[int]:
        """Leading blocks of `keys` the engine holds or is about to (see `expect`); None
        when the engine is unknown."""
        st = self.engines.get(engine)
        if st is None or not st.known:
            return None
        blocks, expected, now, n = st.blocks, st.expected, time.monotonic(), 0
        for k in keys:
            if k not in blocks and expected.get(k, 0.0) < now:
                break
            n += 1
        return n

    def tier_hit_blocks(self, engine: str, keys: Sequence[int], start: int) -> int:
        """Blocks of `keys` from `start` (the end of the pool hit) that the engine can load
        from its own tier or the pool's shared one."""
        st = self.engines.get(engine)
        if st is None or not st.known:
            return 0
        shared = self.shared_tier if st.shares_tier else None
        n = 0
        for k in keys[start:]:
            if k not in st.tier and (shared is None or k not in shared):
                break
            n += 1
        return n

    def expect(self, engine: str, keys: Sequence[int]) -> None:
        """A request with these block keys was just routed to `engine`."""
        with self._lock:
            st = self.engines.get(engine)
            if st is None or not st.known:
                return
            until = time.monotonic() + self.expect_s
            for k in keys:
                if k not in st.blocks:
                    st.expected[k] = until
                    st.expected.move_to_end(k)
            self._lapse(st)
            while len(st.expected) > self.max_blocks:
                st.expected.popitem(last=False)

    def pending_blocks(self, engine: str, own: Sequence[int] = ()) -> int:
        """Blocks routed to `engine` that it has not reported stored yet: prefill work queued
        or running there. Those among `own` (the keys of the request being routed) are left
        out: a request that shares them waits for them instead of computing them itself."""
        with self._lock:
            st = self.engines.get(engine)
            if st is None:
                return 0
            self._lapse(st)
            expected = st.expected
            return len(expected) - sum(1 for k in own if k in expected)

    @staticmethod
    def _lapse(st: EngineBlocks) -> None:
        """Drops expectations past their time (oldest first: they were set in time order)."""
        now = time.monotonic()
        while st.expected and next(iter(st.expected.values())) < now:
            st.expected.popitem(last=False)

    def block_count(self, engine: str) -> int:
        st = self.engines.get(engine)
        return len(st.blocks) if st else 0

    def block_counts(self) -> dict[str, int]:
        """{engine: blocks it holds} for every engine whose events are followed."""
        with self._lock:
            return {e: len(st.blocks) for e, st in self.engines.items() if st.known}


MAX_LORA_NAMES = 4096  # adapter names remembered (events are trusted, but bounded anyway)


def request_block_keys(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: Optional[str] = None,
    lora_name: Optional[str] = None,
) -> list[int]:
    """The index keys of a prompt's full blocks, chained exactly as pdpool engines hash
    them (`pdpool/block_hash.py`, shared with the engine), or as the index names an
    adapter's blocks: the first block's extra keys as events publish them (the adapter's
    name, then the salt)."""
    extra = ((lora_name,) if lora_name else ()) + ((cache_salt,) if cache_salt else ())
    return [hash_key(h) for h in chain_hashes(token_ids, block_size, extra)]
