"""The pool of KV blocks: reference counts, the prefix-cache map and the free list.

A freed block keeps its hash (and its KV) until the pool hands it out again, so a later
request with the same prefix can revive it. Free blocks are kept in LRU order: the block
freed longest ago is reused first, and callers free a request's blocks tail first so that
the end of a prefix is evicted before its beginning.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, Optional


class Block:
    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[bytes] = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, reserve_null: bool = False):
        if num_blocks < 1 + reserve_null:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Block 0 stands for positions a sliding-window layer no longer needs: never
        # handed out, never written, never counted.
        self.null_block: Optional[Block] = self.blocks[0] if reserve_null else None
        self._free: "OrderedDict[int, Block]" = OrderedDict(
            (b.block_id, b) for b in self.blocks if b is not self.null_block
        )
        self._cached: dict[bytes, Block] = {}
        # Prometheus-style counters of prefix-cache lookups, in blocks.
        self.queries = 0
        self.hits = 0
        # KV cache events (see pdpool/kv_events.py): called with a cache key when the
        # canonical block of that key leaves the cache, and when the whole cache is reset.
        self.on_removed: Optional[Callable[[bytes], None]] = None
        self.on_cleared: Optional[Callable[[], None]] = None

    # --- lookups ------------------------------------------------------------------------
    def get_cached_block(self, block_hash: bytes) -> Optional[Block]:
        return self._cached.get(block_hash) if self.enable_caching else None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - (self.null_block is not None)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable_blocks

    # --- reference counting -------------------------------------------------------------
    def touch(self, blocks: Iterable[Block]) -> None:
        """Takes a reference on cache hits; a free hit leaves the free list."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[Block]) -> None:
        """Drops one reference from each block, in the order given (pass tails first)."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    # --- the prefix cache ---------------------------------------------------------------
    def cache_block(self, block: Block, block_hash: bytes) -> bool:
        """Names a full block by its hash. The first block with a hash stays canonical.
        True when this block became the canonical one (the key is new to the cache)."""
        if not self.enable_caching or block.block_hash is not None or block is self.null_block:
            return False
        block.block_hash = block_hash
        return self._cached.setdefault(block_hash, block) is block

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                if self.on_removed is not None:
                    self.on_removed(block.block_hash)
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        if self.on_cleared is not None:
            self.on_cleared()
        return True
