"""Per-request block tables for every KV group, on one block pool, with prefix caching.

The coordinator of the hybrid design (see docs/hybrid_kv.md): each group (full attention,
sliding window, recurrent state) says how long a prefix it can serve, and the hit is the
longest prefix all of them can serve, found by iterating until they agree.

Allocation follows the prefix-cache-aware scheduling seed: admission asks only for the
blocks a request does not already hold through the cache; a cached block another request
is using costs no free block, a cached block on the free list is taken off it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from pdpool.engine.kv.block_pool import Block, BlockPool
from pdpool.engine.kv.facts import KVCacheSpec, KVCacheUsage, KVStepView
from pdpool.engine.kv.groups import KVGroup
from pdpool.engine.kv.state_cache import StateSnapshotCache
from pdpool.engine.request import Request, published_extra_keys

if TYPE_CHECKING:
    from pdpool.kv_events import KVEventPublisher

FULL = KVGroup(num_layers=1)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _key(group: int, block_hash: bytes) -> bytes:
    """Prefix-cache key: the same tokens hold different KV in different groups."""
    return bytes([group]) + block_hash


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_state_slots: int = 0,
        groups: Optional[list[KVGroup]] = None,
        num_snapshot_slots: int = 0,
    ):
        self.block_size = block_size
        self.groups = list(groups) if groups else [FULL]
        sliding = any(g.is_sliding for g in self.groups)
        self.pool = BlockPool(num_blocks, enable_caching, reserve_null=sliding)
        self.req_blocks: dict[str, list[list[Block]]] = {}
        # Recurrent-state models (Gated DeltaNet) keep one running state slot per request
        # and snapshots of it at block boundaries.
        self.num_state_slots = num_state_slots
        self._free_slots = list(range(num_state_slots - 1, -1, -1))
        self.req_slot: dict[str, int] = {}
        self.snapshots = StateSnapshotCache(num_state_slots, num_snapshot_slots)
        self.pending_restores: list[tuple[int, int]] = []  # (snapshot slot, running slot)
        self._num_published: dict[str, int] = {}  # per request: blocks already published
        self.last_hit_lengths: dict[str, int] = {}
        self.events: Optional["KVEventPublisher"] = None  # set by attach_events
        # Blocks and state slots held for other engines, by lease id: the connector
        # decides what to lease and when a lease ends, the manager holds.
        self._lease_holds: dict[str, tuple[list[Block], tuple[int, ...]]] = {}
        # An offload tier's write-through (connector/offload_tier.py), set by the scheduler: told of
        # each block that becomes the cached copy of its hash (request, group, index,
        # block) and of each state snapshot published (slot, block hash).
        self.on_block_cached: Optional[Callable[[Request, int, int, Block], None]] = None
        self.on_snapshot: Optional[Callable[[int, bytes], None]] = None

    @classmethod
    def from_spec(cls, spec: KVCacheSpec) -> KVCacheManager:
        return cls(
            spec.num_blocks,
            spec.block_size,
            spec.enable_caching,
            spec.num_state_slots,
            list(spec.groups),
            spec.num_snapshot_slots,
        )

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def has_state(self) -> bool:
        return self.num_state_slots > 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def capacity_tokens(self) -> int:
        """Tokens one request could hold if it had the whole cache (every group needs its
        own blocks for the same tokens)."""
        return self.pool.num_usable_blocks // len(self.groups) * self.block_size

    def usage(self) -> KVCacheUsage:
        pool = self.pool
        return KVCacheUsage(
            pool.num_used_blocks, pool.num_blocks, pool.usage(), pool.queries, pool.hits
        )

    def step_view(self, request_ids: list[str]) -> KVStepView:
        """Copies of the block tables and state slots of `request_ids`, with the pending
        state restores (taken: the runner makes them before this step's forward)."""
        tables = {
            rid: [[b.block_id for b in blocks] for blocks in self.req_blocks[rid]]
            for rid in request_ids
        }
        slots = {rid: self.req_slot[rid] for rid in request_ids} if self.has_state else {}
        return KVStepView(tables, slots, tuple(self.take_pending_restores()))

    def holds(self, request: Request) -> bool:
        """The request has blocks (running, or allocated for a remote load)."""
        return request.request_id in self.req_blocks

    def blocks_of(self, request: Request, num_tokens: int) -> list[list[Block]]:
        """Per group, the request's blocks covering its first `num_tokens` tokens."""
        n = cdiv(num_tokens, self.block_size)
        return [blocks[:n] for blocks in self.req_blocks.get(request.request_id, [])]

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        tables = self.req_blocks.get(request_id)
        return [b.block_id for b in tables[group]] if tables else []

    def block_tables(self, request_id: str) -> list[list[int]]:
        return [[b.block_id for b in blocks] for blocks in self.req_blocks.get(request_id, [])]

    def state_slot(self, request_id: str) -> int:
        return self.req_slot[request_id]

    # --- prefix cache: per-group hit lengths and the coordinator ----------------------
    def _group_hit_len(self, g: int, hashes: list[bytes], limit: int) -> int:
        """Blocks (<= limit) of prefix that group g can serve."""
        return self.groups[g].hit_len(
            lambda h: self.pool.get_cached_block(_key(g, h)) is not None,
            hashes,
            limit,
            self.block_size,
        )

    def _state_hit_len(self, hashes: list[bytes], limit: int) -> int:
        for n in range(limit, 0, -1):
            if hashes[n - 1] in self.snapshots:
                return n
        return 0

    def _group_hit_blocks(self, g: int, hashes: list[bytes], n: int) -> list[Block]:
        first = self.groups[g].first_needed_block(n * self.block_size, self.block_size)
        hits = [self.pool.get_cached_block(_key(g, h)) for h in hashes[first:n]]
        null = self.pool.null_block
        # hit_len found every one of these; the null block stands for the ones out of window
        outside = [null] * first if null is not None else []
        return outside + [b for b in hits if b is not None]

    def get_computed_blocks(
        self, request: Request, skip_state: bool = False
    ) -> tuple[list[list[Block]], int]:
        """The longest prefix every group can serve, as per-group block lists, and its
        length in tokens. At least one token is always left to compute so the last prompt
        token produces logits. `skip_state`: the recurrent state will come from elsewhere
        (a KV consumer), so the state group does not limit the hit (vLLM PR #42524)."""
        empty: list[list[Block]] = [[] for _ in self.groups]
        if not self.enable_caching:
            return empty, 0
        hashes = request.block_hashes
        n, lengths = self._hit_len(request, skip_state)
        self.last_hit_lengths = {k: v * self.block_size for k, v in lengths.items()}
        self.pool.queries += request.num_tokens
        self.pool.hits += n * self.block_size
        if n == 0:
            return empty, 0
        return [
            self._group_hit_blocks(g, hashes, n) for g in range(len(self.groups))
        ], n * self.block_size

    def peek_computed_tokens(self, request: Request) -> int:
        """The local hit get_computed_blocks would find now, counting nothing (for a look
        ahead at a request still in line)."""
        return self._hit_len(request, False)[0] * self.block_size if self.enable_caching else 0

    def _hit_len(self, request: Request, skip_state: bool) -> tuple[int, dict[str, int]]:
        """The blocks every group (and the state) agree on, and each one's own length."""
        if request.computes_prompt_rows:
            return 0, {}
        hashes = request.block_hashes
        n = min((request.num_tokens - 1) // self.block_size, len(hashes))
        while True:
            agreed = n
            lengths = {}
            for g in range(len(self.groups)):
                agreed = self._group_hit_len(g, hashes, agreed)
                lengths[self.groups[g].name] = agreed
            if self.has_state and not skip_state:
                agreed = self._state_hit_len(hashes, agreed)
                lengths["state"] = agreed
            if agreed == n:
                return n, lengths
            n = agreed

    # --- allocation ---------------------------------------------------------------------
    def _release_outside_window(self, request: Request) -> None:
        """Sliding-window blocks no future query can see go back to the pool."""
        tables = self.req_blocks.get(request.request_id)
        if not tables:
            return
        for g, group in enumerate(self.groups):
            cutoff = group.first_needed_block(request.num_computed_tokens, self.block_size)
            blocks = tables[g]
            null = self.pool.null_block
            if null is None:  # no sliding group
                continue
            for i in range(min(cutoff, len(blocks))):
                if blocks[i] is not null:
                    self.pool.free([blocks[i]])
                    blocks[i] = null

    def blocks_needed(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed: Optional[list[list[Block]]] = None,
    ) -> int:
        """Free blocks this allocation would consume, over all groups (cache hits on the
        free list count: taking them removes them from the free list)."""
        tables = self.req_blocks.get(request.request_id)
        total = 0
        for g in range(len(self.groups)):
            held = tables[g] if tables else []
            hits = new_computed[g] if new_computed else []
            num_computed = request.num_computed_tokens + len(hits) * self.block_size
            fresh = cdiv(num_computed + num_new_tokens, self.block_size) - len(held) - len(hits)
            revived = sum(1 for b in hits if b.ref_cnt == 0 and b is not self.pool.null_block)
            total += max(fresh, 0) + revived
        return total

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed: Optional[list[list[Block]]] = None,
    ) -> bool:
        if self.has_state and request.request_id not in self.req_slot and not self._free_slots:
            return False
        return (
            self.blocks_needed(request, num_new_tokens, new_computed) <= self.pool.num_free_blocks
        )

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed: Optional[list[list[Block]]] = None,
    ) -> bool:
        """Gives the request blocks for `num_new_tokens` more tokens (after its cached ones).
        Returns False, changing nothing, when the pool cannot."""
        self._release_outside_window(request)
        if not self.can_allocate(request, num_new_tokens, new_computed):
            return False
        if self.has_state and request.request_id not in self.req_slot:
            self.req_slot[request.request_id] = self._free_slots.pop()
        tables = self.req_blocks.setdefault(request.request_id, [[] for _ in self.groups])
        for g, held in enumerate(tables):
            hits = new_computed[g] if new_computed else []
            self.pool.touch(hits)
            held.extend(hits)
            num_computed = request.num_computed_tokens + len(hits) * self.block_size
            fresh = cdiv(num_computed + num_new_tokens, self.block_size) - len(held)
            if fresh > 0:
                held.extend(self.pool.allocate(fresh))
        return True

    # --- recurrent-state slots ---------------------------------------------------------
    def snapshot_at(self, block_hash: bytes) -> Optional[int]:
        """The snapshot slot holding the state after the block named `block_hash`."""
        return self.snapshots.lookup(block_hash)

    def has_snapshot(self, block_hash: bytes) -> bool:
        return block_hash in self.snapshots

    def reserve_snapshot_slot(self) -> Optional[int]:
        """A pinned slot to receive a state (e.g. from a peer); give it back with
        `release_snapshot_slot`, after `publish_snapshot` if it should stay cached."""
        slot = self.snapshots.take_slot()
        if slot is not None:
            self.snapshots.pin(slot)
        return slot

    def publish_snapshot(self, block_hash: bytes, slot: int) -> None:
        if block_hash not in self.snapshots:
            self.snapshots.publish(block_hash, slot)

    def release_snapshot_slot(self, slot: int) -> None:
        self.snapshots.release(slot)

    def take_pending_restores(self) -> list[tuple[int, int]]:
        """(snapshot slot, running slot) copies the runner makes before the next forward."""
        restores, self.pending_restores = self.pending_restores, []
        return restores

    def commit_computed(self, request: Request) -> list[tuple[int, int]]:
        """After a forward advanced `request`: publishes its newly full blocks and returns
        the state copies (running slot -> snapshot slot) the runner must make."""
        self.cache_full_blocks(request, request.num_computed_tokens)
        return [
            c
            for c in (self.snapshot_state(request), self.pin_state_for_transfer(request))
            if c is not None
        ]

    def restore_state(self, request: Request, num_cached: int) -> None:
        """A state-model request admitted on a prefix hit resumes from that snapshot."""
        if not self.has_state or num_cached == 0:
            return
        snap = self.snapshots.lookup(request.block_hashes[num_cached // self.block_size - 1])
        if snap is None:
            raise RuntimeError(
                f"no state snapshot for the {num_cached}-token hit of {request.request_id}"
            )
        self.pending_restores.append((snap, self.req_slot[request.request_id]))

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Publishes the request's blocks that are full once `num_tokens` are computed."""
        tables = self.req_blocks.get(request.request_id)
        if not tables or not self.enable_caching:
            return
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        done = self._num_published.get(request.request_id, 0)
        if num_full <= done:
            return
        for g, blocks in enumerate(tables):
            stored = [
                i
                for i in range(done, min(num_full, len(blocks)))
                if self.pool.cache_block(blocks[i], _key(g, request.block_hashes[i]))
            ]
            if stored and self.events is not None:
                self._record_stored(request, g, stored)
            if self.on_block_cached is not None:
                for i in stored:
                    self.on_block_cached(request, g, i, blocks[i])
        self._num_published[request.request_id] = num_full

    # --- KV cache events ----------------------------------------------------------------
    def attach_events(self, publisher: "KVEventPublisher") -> None:
        """Publishes this cache's changes in vLLM's KV-events format (pdpool/kv_events.py):
        BlockStored when a block becomes the cached copy of its hash, BlockRemoved when
        that copy is evicted, AllBlocksCleared on a reset. Every group publishes with its
        `group_idx`; the hash is the 32-byte chained digest (the group is not in it)."""
        from pdpool.kv_events import AllBlocksCleared, BlockRemoved

        self.events = publisher
        self.pool.on_removed = lambda key: publisher.record(BlockRemoved([key[1:]], "GPU", key[0]))
        self.pool.on_cleared = lambda: publisher.record(AllBlocksCleared())

    def _record_stored(self, request: Request, g: int, stored: list[int]) -> None:
        from pdpool.kv_events import BlockStored

        events = self.events
        assert events is not None
        bs, hashes, tokens = self.block_size, request.block_hashes, request.all_token_ids
        kind = "sliding_window" if self.groups[g].is_sliding else "full_attention"
        run: list[int] = []
        for i in [*stored, -1]:  # one event per run of consecutive blocks
            if run and i != run[-1] + 1:
                first, last = run[0], run[-1]
                # As vLLM: the adapter's name and the salt are published (untagged) with
                # the block whose hash they went into.
                first_keys = published_extra_keys(request)
                extra = (
                    [first_keys if j == 0 else None for j in run]
                    if first_keys and first == 0
                    else None
                )
                events.record(
                    BlockStored(
                        [hashes[j] for j in run],
                        hashes[first - 1] if first else None,
                        list(tokens[first * bs : (last + 1) * bs]),
                        bs,
                        request.lora.lora_id if request.lora is not None else None,
                        "GPU",
                        g,
                        kind,
                        extra,
                        lora_name=request.lora.name if request.lora is not None else None,
                    )
                )
                run = []
            run.append(i)

    def snapshot_state(self, request: Request) -> Optional[tuple[int, int]]:
        """After a step that ended on a block boundary: (running slot, snapshot slot) to
        copy, published under the last block's hash; None if nothing to do."""
        n = request.num_computed_tokens
        if not self.has_state or not self.enable_caching or n == 0 or n % self.block_size:
            return None
        i = n // self.block_size - 1
        if i >= len(request.block_hashes) or request.block_hashes[i] in self.snapshots:
            return None
        slot = self.snapshots.take_slot()
        if slot is None:
            return None
        self.snapshots.publish(request.block_hashes[i], slot)
        if self.on_snapshot is not None:
            self.on_snapshot(slot, request.block_hashes[i])
        return self.req_slot[request.request_id], slot

    def pin_state_for_transfer(self, request: Request) -> Optional[tuple[int, int]]:
        """A prefill leg that has computed all but its last prompt token keeps a copy of its
        state there for the decode engine: (running slot, pinned slot) to copy."""
        n = request.num_computed_tokens
        if (
            not self.has_state
            or not request.is_prefill_leg
            or n == 0
            or n != request.num_prompt_tokens - 1
            or request.transfer_state_slot is not None
        ):
            return None
        slot = self.snapshots.take_slot()
        if slot is None:
            return None
        self.snapshots.pin(slot)
        request.transfer_state_slot = slot
        return self.req_slot[request.request_id], slot

    # --- freeing ------------------------------------------------------------------------
    def free(self, request: Request) -> None:
        self.release(self.detach(request))

    def detach(self, request: Request) -> list[Block]:
        """Takes a request's blocks (all groups, tail first) without freeing them, e.g. for
        a connector to hold for a peer; give them back with `release`."""
        tables = self.req_blocks.pop(request.request_id, [])
        self._num_published.pop(request.request_id, None)
        slot = self.req_slot.pop(request.request_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        if request.transfer_state_slot is not None:  # nobody took it over
            self.snapshots.release(request.transfer_state_slot)
            request.transfer_state_slot = None
        return [b for blocks in tables for b in reversed(blocks)]

    # --- leases: blocks and state slots held for another engine ---------------------------
    def hold_for_lease(
        self, lease_id: str, tables: list[list[Block]], state_slots: tuple[int, ...] = ()
    ) -> None:
        """Holds `tables` (per group, the leased blocks) and pins `state_slots` until
        `end_lease_hold(lease_id)`. A slot handed in is pinned once more here."""
        if lease_id in self._lease_holds:
            raise ValueError(f"lease {lease_id} is held already")
        blocks = self.hold([b for blocks in tables for b in reversed(blocks)])
        for slot in state_slots:
            self.snapshots.pin(slot)
        self._lease_holds[lease_id] = (blocks, tuple(state_slots))

    def end_lease_hold(self, lease_id: str) -> bool:
        """Gives back what a lease held; False when it holds nothing (any more)."""
        held = self._lease_holds.pop(lease_id, None)
        if held is None:
            return False
        blocks, slots = held
        self.release(blocks)
        for slot in slots:
            self.snapshots.release(slot)
        return True

    def lease_holds(self) -> list[str]:
        """The ids of the leases holding blocks or slots now."""
        return list(self._lease_holds)

    def hold(self, blocks: list[Block]) -> list[Block]:
        """An extra reference on blocks (e.g. a cached prefix described to a peer)."""
        self.pool.touch(blocks)
        return list(blocks)

    def release(self, blocks: list[Block]) -> None:
        """Drops one reference from each block, in the order given (tails first)."""
        self.pool.free(blocks)
