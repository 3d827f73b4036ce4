"""The block pool and the KV manager's prefix-cache arithmetic, without a model."""

from __future__ import annotations

from pdpool.engine.kv.block_pool import BlockPool
from pdpool.engine.kv.hashing import BlockHasher, hash_block
from pdpool.engine.kv.manager import KVCacheManager
from pdpool.engine.request import Request
from pdpool.engine.sampling_params import SamplingParams

BS = 4


def make(rid: str, tokens: list[int], salt=None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt, block_size=BS)


def admit(kv: KVCacheManager, req: Request) -> int:
    """Admits like the scheduler does and marks the prompt computed; returns cached tokens."""
    hits, cached = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - cached, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req, req.num_tokens)
    return cached


def test_hash_is_deterministic_and_chained():
    h1 = hash_block(None, [1, 2, 3, 4])
    assert h1 == hash_block(None, [1, 2, 3, 4])
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    # A known value: prefill and decode processes (and restarts) must agree.
    assert h1.hex()[:16] == hash_block(None, (1, 2, 3, 4)).hex()[:16]
    hashes = BlockHasher(BS).hash_blocks(list(range(10)), [], 2)
    assert len(hashes) == 2 and hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])


def test_hit_length_is_whole_blocks_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make("a", list(range(10)))  # blocks [0-3] [4-7] + partial
    assert admit(kv, a) == 0
    b = make("b", [*list(range(10)), 99])
    assert kv.get_computed_blocks(b)[1] == 8
    c = make("c", list(range(8)))  # fully cached prompt: last block recomputed
    assert kv.get_computed_blocks(c)[1] == 4
    d = make("d", [0, 1, 2, 77, 4, 5, 6, 7])  # differs in block 0: no hit at all
    assert kv.get_computed_blocks(d)[1] == 0


def test_salt_isolates_tenants():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    admit(kv, make("a", list(range(12)), salt="tenant-a"))
    assert kv.get_computed_blocks(make("b", list(range(12)), salt="tenant-b"))[1] == 0
    assert kv.get_computed_blocks(make("c", list(range(12))))[1] == 0
    assert kv.get_computed_blocks(make("d", list(range(12)), salt="tenant-a"))[1] == 8


def test_refcounts_shared_prefix_and_free():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a, b = make("a", list(range(9))), make("b", [*list(range(8)), 50])
    admit(kv, a)
    admit(kv, b)
    shared = kv.req_blocks["a"][0][:2]
    assert shared == kv.req_blocks["b"][0][:2]
    assert [blk.ref_cnt for blk in shared] == [2, 2]
    kv.free(a)
    assert [blk.ref_cnt for blk in shared] == [1, 1]
    kv.free(b)
    assert kv.pool.num_free_blocks == 16
    # Freed blocks keep their hashes: a later request still hits them.
    assert kv.get_computed_blocks(make("c", [*list(range(8)), 1]))[1] == 8


def test_eviction_is_lru_and_tail_first():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i]))
    pool.free(reversed(blocks[:2]))  # request 1 freed: tail (1) then head (0)
    pool.free(reversed(blocks[2:]))  # request 2 freed later: 3 then 2
    order = [pool.allocate(1)[0].block_id for _ in range(4)]
    assert order == [1, 0, 3, 2]
    assert pool.get_cached_block(bytes([0])) is None  # evicted blocks lose their hash


def test_seed_allocation_arithmetic():
    """A cached block still in use costs no free block; a cached free block does (it leaves
    the free list); only the uncached part needs fresh blocks."""
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make("a", list(range(16)))  # 4 blocks
    admit(kv, a)
    assert kv.pool.num_free_blocks == 6
    b = make("b", list(range(16)) + list(range(100, 108)))  # 24 tokens, 4 blocks cached
    hits, cached = kv.get_computed_blocks(b)
    assert cached == 16
    # 6 blocks in all; 4 held through the cache (in use by a): 2 fresh ones.
    assert kv.blocks_needed(b, b.num_tokens - cached, hits) == 2
    kv.free(a)
    # Now the cached blocks sit on the free list: taking them costs 4 more.
    assert kv.blocks_needed(b, b.num_tokens - cached, hits) == 6
    assert kv.allocate_slots(b, b.num_tokens - cached, hits)
    assert kv.pool.num_free_blocks == 10 - 6


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    r = make("r", list(range(12)))
    assert not kv.allocate_slots(r, 12)
    assert kv.pool.num_free_blocks == 2 and "r" not in kv.req_blocks


def test_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    admit(kv, make("a", list(range(9))))
    assert kv.get_computed_blocks(make("b", list(range(9))))[1] == 0
