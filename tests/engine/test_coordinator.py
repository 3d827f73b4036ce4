"""The hybrid coordinator without a model: per-group hit lengths and their agreement,
sliding-window release, state snapshots, and no leaks."""

from __future__ import annotations

import random

import pytest

from pdpool.engine.kv.groups import KVGroup, SlidingWindowGroup, attention_groups
from pdpool.engine.kv.manager import KVCacheManager
from pdpool.engine.request import Request, RequestStatus
from pdpool.engine.sampling_params import SamplingParams
from pdpool.engine.scheduler import Scheduler, SchedulerConfig

BS = 4
FULL, SLIDE8 = KVGroup(num_layers=1), SlidingWindowGroup(num_layers=1, window=8)


def make(rid, tokens, **kw):
    return Request(rid, tokens, SamplingParams(max_tokens=4), block_size=BS, **kw)


def compute(kv: KVCacheManager, req: Request, upto: int, snapshot: bool = True) -> None:
    """Admit (if needed) and mark tokens computed up to `upto`, as the engine would."""
    if req.request_id not in kv.req_blocks:
        hits, cached = kv.get_computed_blocks(req)
        assert kv.allocate_slots(req, upto - cached, hits)
        req.num_computed_tokens = cached
    else:
        assert kv.allocate_slots(req, upto - req.num_computed_tokens)
    req.num_computed_tokens = upto
    kv.cache_full_blocks(req, upto)
    if snapshot:
        kv.snapshot_state(req)


def test_attention_groups_from_layer_windows():
    groups, place = attention_groups([32, None, 32, None, None])
    assert [g.name for g in groups] == ["full", "sliding32"]
    assert [g.num_layers for g in groups] == [3, 2]
    assert place == [(1, 0), (0, 0), (1, 1), (0, 1), (0, 2)]


@pytest.mark.parametrize(
    "full_blocks,window_tail,state_at,expected",
    [
        # full hit, sliding tail cached, state snapshot at: -> agreed blocks
        (5, True, 5, 5),
        (5, True, 3, 3),  # the state limits
        (5, True, None, 0),  # no snapshot at all: nothing can resume
        (2, True, 5, 2),  # the full group limits (snapshots beyond it are useless)
        (5, False, 5, 0),  # sliding tail evicted: no resumable position
    ],
)
def test_hit_length_for_each_combination(full_blocks, window_tail, state_at, expected):
    kv = KVCacheManager(64, BS, groups=[FULL, SLIDE8], num_state_slots=2, num_snapshot_slots=8)
    tokens = list(range(100, 124))  # 6 blocks
    warm = make("warm", tokens)
    compute(kv, warm, 24, snapshot=False)
    h = warm.block_hashes
    pool = kv.pool
    # Shape the cache: drop full-group blocks after `full_blocks`, sliding tail if asked.
    for i, blocks in enumerate(kv.req_blocks["warm"][0]):
        if i >= full_blocks:
            pool._evict(blocks)
    if not window_tail:
        for b in kv.req_blocks["warm"][1]:
            pool._evict(b)
    if state_at is not None:
        for n in range(1, state_at + 1):
            kv.snapshots.publish(h[n - 1], kv.snapshots.take_slot())
    probe = make("probe", [*tokens, 7])
    hits, cached = kv.get_computed_blocks(probe)
    assert cached == expected * BS
    if expected:
        assert len(hits[0]) == expected and len(hits[1]) == expected
        # Sliding hits keep only the last window: earlier positions are the null block.
        first_needed = (expected * BS - 8 + 1) // BS
        assert all(b is pool.null_block for b in hits[1][:first_needed])
        assert all(b is not pool.null_block for b in hits[1][first_needed:])


def test_per_group_hits_for_a_kv_consumer():
    """A request whose state comes from a remote engine keeps its attention hit."""
    kv = KVCacheManager(64, BS, num_state_slots=2, num_snapshot_slots=4)
    warm = make("warm", list(range(16)))
    compute(kv, warm, 16, snapshot=False)  # attention cached, no snapshot
    probe = make("probe", [*list(range(16)), 1, 2])
    assert kv.get_computed_blocks(probe)[1] == 0
    assert kv.get_computed_blocks(probe, skip_state=True)[1] == 16
    assert kv.last_hit_lengths == {"full": 16}


def test_sliding_blocks_outside_window_are_released():
    kv = KVCacheManager(64, BS, groups=[FULL, SLIDE8])
    r = make("r", list(range(40)))
    compute(kv, r, 8)
    compute(kv, r, 24)
    compute(kv, r, 32)
    assert kv.allocate_slots(r, 1)  # the next step (query at 32) releases lazily
    live = [b for b in kv.req_blocks["r"][1] if b is not kv.pool.null_block]
    # The query at 32 sees keys 25..32: blocks 6, 7 and the new block 8.
    assert len(live) == 3
    assert len(kv.req_blocks["r"][0]) == 9
    kv.free(r)
    assert kv.pool.num_used_blocks == 0


def test_snapshots_taken_on_block_boundaries_and_restored():
    kv = KVCacheManager(64, BS, num_state_slots=2, num_snapshot_slots=4)
    a = make("a", list(range(13)))
    compute(kv, a, 8)  # boundary: snapshot of block 1
    assert len(kv.snapshots) == 1
    compute(kv, a, 13)  # mid-block: none
    assert len(kv.snapshots) == 1
    kv.free(a)
    b = make("b", [*list(range(13)), 50])
    hits, cached = kv.get_computed_blocks(b)
    assert cached == 8
    assert kv.allocate_slots(b, b.num_tokens - cached, hits)
    kv.restore_state(b, cached)
    ((src, dst),) = kv.pending_restores
    assert src >= 2 and dst == kv.state_slot("b")


def test_scheduler_aligns_prefill_chunks_for_state_models():
    kv = KVCacheManager(64, BS, num_state_slots=4, num_snapshot_slots=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv)
    r = make("r", list(range(10)))
    s.add_request(r)
    out = s.schedule()
    assert out.scheduled[0].num_new_tokens == 8  # stops at the last block boundary


def test_no_leak_after_random_mix():
    rng = random.Random(0)
    kv = KVCacheManager(18, BS, groups=[FULL, SLIDE8], num_state_slots=4, num_snapshot_slots=6)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4), kv)
    reqs = []
    shared = list(range(200, 212))
    for i in range(30):
        tokens = (shared if i % 2 else []) + [rng.randrange(500) for _ in range(rng.randint(1, 20))]
        reqs.append(make(f"r{i}", tokens, cache_hit_threshold=0.7 if i % 5 == 0 else None))
        s.add_request(reqs[-1])
        for _ in range(rng.randint(2, 6)):
            out = s.schedule()
            for item in out.scheduled:
                q = item.request
                q.num_computed_tokens += item.num_new_tokens
                kv.cache_full_blocks(q, q.num_computed_tokens)
                kv.snapshot_state(q)
                if q.num_computed_tokens == q.num_tokens:
                    q.append_output_token(1)
                    if len(q.output_token_ids) >= 20:
                        s.finish_request(q, RequestStatus.FINISHED_LENGTH)
            kv.pending_restores.clear()
        if rng.random() < 0.25:
            s.finish_request(rng.choice(reqs), RequestStatus.FINISHED_ABORTED)
    for q in reqs:
        s.finish_request(q, RequestStatus.FINISHED_ABORTED)
    assert s.num_preemptions > 0
    assert kv.pool.num_used_blocks == 0
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not kv.req_slot and len(kv._free_slots) == 4
