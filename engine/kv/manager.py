"""Per-request block tables on top of the block pool, with prefix-cache lookups.

The arithmetic follows the prefix-cache-aware scheduling seed: admission asks only for the
blocks a request does not already hold through the cache; a cached block that another
request is using costs no free block, a cached block on the free list is taken off it.
"""
from __future__ import annotations

from typing import Optional

from pdpool.engine.kv.block_pool import Block, BlockPool
from pdpool.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_state_slots: int = 0):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[Block]] = {}
        # Recurrent-state models (Gated DeltaNet) keep one running state slot per request.
        self.num_state_slots = num_state_slots
        self._free_slots = list(range(num_state_slots - 1, -1, -1))
        self.req_slot: dict[str, int] = {}

    def state_slot(self, request_id: str) -> int:
        return self.req_slot[request_id]

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    # --- prefix cache -------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """The longest cached prefix of a request not yet holding blocks.

        At least one token is left to compute, so the last prompt token always produces
        logits: a fully cached prompt reuses all blocks but the one holding its last token.
        """
        if not self.enable_caching or self.num_state_slots:
            # A recurrent state cannot resume from attention blocks alone.
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.pool.queries += request.num_tokens
        self.pool.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    # --- allocation ---------------------------------------------------------------------
    def blocks_needed(self, request: Request, num_new_tokens: int,
                      new_computed_blocks: list[Block]) -> int:
        """Free blocks this allocation would consume (cache hits that sit on the free list
        count: taking them removes them from the free list)."""
        held = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        fresh = cdiv(num_computed + num_new_tokens, self.block_size) - len(held) \
            - len(new_computed_blocks)
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return max(fresh, 0) + revived

    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed_blocks: Optional[list[Block]] = None) -> bool:
        if self.num_state_slots and request.request_id not in self.req_slot \
                and not self._free_slots:
            return False
        return self.blocks_needed(request, num_new_tokens, new_computed_blocks or []) \
            <= self.pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Optional[list[Block]] = None) -> bool:
        """Gives the request blocks for `num_new_tokens` more tokens (after its cached ones).
        Returns False, changing nothing, when the pool cannot."""
        new_computed_blocks = new_computed_blocks or []
        if not self.can_allocate(request, num_new_tokens, new_computed_blocks):
            return False
        if self.num_state_slots and request.request_id not in self.req_slot:
            self.req_slot[request.request_id] = self._free_slots.pop()
        held = self.req_blocks.setdefault(request.request_id, [])
        self.pool.touch(new_computed_blocks)
        held.extend(new_computed_blocks)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        fresh = cdiv(num_computed + num_new_tokens, self.block_size) - len(held)
        if fresh > 0:
            held.extend(self.pool.allocate(fresh))
        return True

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Publishes the request's blocks that are full once `num_tokens` are computed."""
        held = self.req_blocks.get(request.request_id, [])
        num_full = min(num_tokens // self.block_size, len(request.block_hashes), len(held))
        for i in range(num_full):
            self.pool.cache_block(held[i], request.block_hashes[i])

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self.pool.free(reversed(blocks))
        slot = self.req_slot.pop(request.request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def detach(self, request: Request) -> list[Block]:
        """Takes a request's blocks away from it without freeing them (a connector holds
        them for a peer); give them back with `release`."""
        blocks = self.req_blocks.pop(request.request_id, [])
        slot = self.req_slot.pop(request.request_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        return blocks

    def hold(self, blocks: list[Block]) -> list[Block]:
        """An extra reference on blocks (e.g. a cached prefix described to a peer)."""
        self.pool.touch(blocks)
        return list(blocks)

    def release(self, blocks: list[Block]) -> None:
        self.pool.free(reversed(blocks))

    def usage(self) -> float:
        return self.pool.usage()
