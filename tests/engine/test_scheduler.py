"""Scheduling decisions over real request state and the KV manager, without a model."""

from __future__ import annotations

import pytest

from pdpool.engine.connector.base import AllocatedKV, KVConnector
from pdpool.engine.kv.manager import KVCacheManager
from pdpool.engine.request import Request, RequestStatus
from pdpool.engine.sampling_params import SamplingParams
from pdpool.engine.scheduler import Scheduler, SchedulerConfig

BS = 4


def make(rid, n_tokens, start=0, threshold=None, kv_params=None, max_tokens=8):
    return Request(
        rid,
        list(range(start, start + n_tokens)),
        SamplingParams(max_tokens=max_tokens),
        cache_hit_threshold=threshold,
        kv_transfer_params=kv_params,
        block_size=BS,
    )


def sched(num_blocks=64, budget=32, max_seqs=8, **kw):
    kv = KVCacheManager(num_blocks, BS)
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, **kw), kv
    )


def run_step(s: Scheduler, out, token=1):
    """What the engine does after the model: advance, publish blocks, add one token."""
    for item in out.scheduled:
        r = item.request
        r.num_computed_tokens += item.num_new_tokens
        s.kv.cache_full_blocks(r, r.num_computed_tokens)
        if r.num_computed_tokens == r.num_tokens:
            r.append_output_token(token)


def test_chunked_prefill_under_budget_and_mixed_with_decode():
    s = sched(budget=10)
    a, b = make("a", 6), make("b", 20, start=100)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 6), ("b", 4)]
    run_step(s, out)
    out = s.schedule()  # a decodes (1 token), b continues its prompt with the rest
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 9)]
    assert out.num_scheduled_tokens <= 10


def test_no_chunking_waits_for_budget():
    s = sched(budget=10, enable_chunked_prefill=False)
    s.add_request(make("a", 20))
    assert s.schedule().scheduled == []


def test_max_num_seqs():
    s = sched(max_seqs=2)
    for i in range(3):
        s.add_request(make(f"r{i}", 4, start=10 * i))
    assert len(s.schedule().scheduled) == 2


def test_preemption_by_recompute_keeps_place_in_line():
    s = sched(num_blocks=4, budget=64)
    a, b = make("a", 7, max_tokens=20), make("b", 7, start=50, max_tokens=20)  # 2 blocks each
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert len(out.scheduled) == 2
    run_step(s, out)
    run_step(s, s.schedule())  # both now have 9 tokens: position 8 needs a 3rd block each
    out = s.schedule()
    assert out.preempted == [b]
    assert [x.request for x in out.scheduled] == [a]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert s.waiting[0] is b and b.num_preemptions == 1
    c = make("c", 3, start=90)
    s.add_request(c)
    s.finish_request(a, RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert out.scheduled[0].request is b  # ahead of the newer c
    # Recomputes prompt + output tokens, less what its own freed blocks still cache.
    assert b.num_computed_tokens == 4 and out.scheduled[0].num_new_tokens == 5


def test_prefix_aware_budget_charges_only_computed_tokens():
    s = sched(budget=12)
    warm = make("warm", 17)
    s.add_request(warm)
    for _ in range(3):
        out = s.schedule()
        run_step(s, out)
    s.finish_request(warm, RequestStatus.FINISHED_STOPPED)
    r = make("r", 18)  # first 16 tokens cached (4 blocks)
    s.add_request(r)
    out = s.schedule()
    assert r.num_computed_tokens == 16 and out.scheduled[0].num_new_tokens == 2


def test_unaware_admission_charges_cached_tokens():
    s = sched(budget=12, prefix_aware_admission=False)
    warm = make("warm", 17)
    s.add_request(warm)
    for _ in range(3):
        run_step(s, s.schedule())
    s.finish_request(warm, RequestStatus.FINISHED_STOPPED)
    s.add_request(make("r", 18))
    out = s.schedule()
    # The whole 18-token prompt is charged: the budget of 12 allows none of the 2 new tokens.
    assert out.scheduled == [] or out.num_scheduled_tokens < 2


def test_unaware_admission_moves_on_when_the_cached_prefix_fills_the_budget():
    """A cached prefix at least as long as the step's budget once left no room for a new
    token: the request waited at the head of the line forever, and everyone behind it."""
    s = sched(budget=4, prefix_aware_admission=False)
    warm = make("warm", 9)
    s.add_request(warm)
    for _ in range(3):
        run_step(s, s.schedule())
    s.finish_request(warm, RequestStatus.FINISHED_STOPPED)
    r, behind = make("r", 10, max_tokens=1), make("behind", 3, start=50, max_tokens=1)
    s.add_request(r)
    s.add_request(behind)
    for _ in range(20):
        run_step(s, s.schedule())
        for done in [x for x in s.running if x.output_token_ids]:
            s.finish_request(done, RequestStatus.FINISHED_LENGTH)
    assert r.is_finished and behind.is_finished


@pytest.mark.parametrize(
    "threshold,admitted", [(0.0, True), (0.5, True), (0.9, False), (1.0, False)]
)
def test_cache_hit_threshold(threshold, admitted):
    s = sched(budget=64)
    warm = make("warm", 16)
    s.add_request(warm)
    run_step(s, s.schedule())
    s.finish_request(warm, RequestStatus.FINISHED_STOPPED)
    r = make("r", 20, threshold=threshold)  # 12 of 20 cached = 0.6 (one token kept back)
    s.add_request(r)
    out = s.schedule()
    assert (r in [x.request for x in out.scheduled]) == admitted
    assert (r in out.rejected) == (not admitted)
    if not admitted:
        assert r.status == RequestStatus.FINISHED_CACHE_THRESHOLD
        assert r.request_id not in s.kv.req_blocks  # never takes blocks
        assert s.num_threshold_rejections["request"] == 1


def test_global_threshold_and_prefill_legs_are_not_gated():
    s = sched(global_cache_hit_threshold=0.8)
    r = make("r", 8)
    leg = make("leg", 8, start=40, kv_params={"do_remote_decode": True})
    s.add_request(r)
    s.add_request(leg)
    out = s.schedule()
    assert out.rejected == [r] and s.num_threshold_rejections["global"] == 1
    assert [x.request for x in out.scheduled] == [leg]
    # A request's own value wins over the global one, including 0.
    r2 = make("r2", 8, start=80, threshold=0.0)
    s.add_request(r2)
    assert r2 in [x.request for x in s.schedule().scheduled]


def test_threshold_rechecked_when_preempted_request_returns():
    s = sched(num_blocks=4, budget=64)
    a, b = make("a", 7, max_tokens=20), make("b", 7, start=50, max_tokens=20, threshold=0.5)
    b.cache_hit_threshold = None
    s.add_request(a)
    s.add_request(b)
    run_step(s, s.schedule())
    run_step(s, s.schedule())
    assert s.schedule().preempted == [b]
    s.config.global_cache_hit_threshold = 0.9
    s.finish_request(a, RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert out.rejected == [b]  # bounces back to its router instead of prefilling


def test_empty_prompt_does_not_divide_by_zero():
    s = sched()
    r = Request("e", [], SamplingParams(), cache_hit_threshold=0.5, block_size=BS)
    assert s.threshold_decision(r, 0) is None


def test_token_ids_between_matches_a_slice_of_all_token_ids():
    r = Request("t", [10, 11, 12, 13], SamplingParams(), block_size=BS)
    for t in (20, 21, 22):
        r.append_output_token(t)
    every = r.all_token_ids
    for start in range(len(every) + 1):
        for end in range(start, len(every) + 2):
            assert r.token_ids_between(start, end) == every[start:end], (start, end)


class PullsAll(KVConnector):
    """Every request with kv_transfer_params pulls all but its last token from a peer."""

    def get_num_new_matched_tokens(self, request, num_local_computed):
        if not request.kv_transfer_params or request.kv_consumed:
            return 0
        return request.num_tokens - 1 - num_local_computed

    def update_state_after_alloc(self, request, allocated: AllocatedKV, num_local, num_external):
        request.kv_consumed = True


def test_a_request_back_from_a_failed_load_cannot_starve_the_head_of_the_line():
    """A pulled request waits with its blocks (its load failed) behind a request that was
    preempted to the head of the line: nothing runs, the head cannot fit, and the blocks it
    needs were held by the request behind it forever. The holder now gives them back."""
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=8),
        KVCacheManager(6, BS),
        PullsAll(),
    )
    a = make("a", 13, start=100, max_tokens=1, kv_params={"do_remote_prefill": True})
    b = make("b", 16, max_tokens=1)
    s.add_request(a)
    s.add_request(b)
    run_step(s, s.schedule())  # a loads into 3 blocks, b computes its first chunk
    assert a.request_id in s.loading and b in s.running
    s.finish_loading(a, 0)  # nothing arrived: a is recomputed, holding its blocks
    for _ in range(30):
        out = s.schedule()
        run_step(s, out)
        for done in [x for x in s.running if x.output_token_ids]:
            s.finish_request(done, RequestStatus.FINISHED_LENGTH)
        if a.is_finished and b.is_finished:
            break
    assert a.is_finished and b.is_finished
    assert a.num_preemptions == 1 and s.kv.pool.num_free_blocks == 6


def test_unaware_admission_runs_a_request_back_from_a_load():
    """The unaware baseline asked every admission for blocks for its whole sequence, even a
    request back from a load that holds all but one of them already: it never ran."""
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=32, prefix_aware_admission=False),
        KVCacheManager(6, BS),
        PullsAll(),
    )
    a = make("a", 13, max_tokens=1, kv_params={"do_remote_prefill": True})
    s.add_request(a)
    assert s.schedule().scheduled == [] and a.request_id in s.loading
    s.finish_loading(a, 12)
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1)]


def test_a_request_back_from_a_failed_load_cannot_starve_a_running_one():
    """The running request needs the blocks a request waiting behind it holds: it preempted
    itself, was admitted again for a chunk, and preempted itself again, forever. The
    waiting holder gives its blocks back instead."""
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=8),
        KVCacheManager(6, BS, enable_caching=False),
        PullsAll(),
    )
    a = make("a", 13, start=100, max_tokens=1, kv_params={"do_remote_prefill": True})
    b = make("b", 16, max_tokens=1)
    s.add_request(a)
    s.add_request(b)
    run_step(s, s.schedule())
    s.finish_loading(a, 0)
    for _ in range(30):
        run_step(s, s.schedule())
        for done in [x for x in s.running if x.output_token_ids]:
            s.finish_request(done, RequestStatus.FINISHED_LENGTH)
        if a.is_finished and b.is_finished:
            break
    assert a.is_finished and b.is_finished
    assert b.num_preemptions == 0 and s.kv.pool.num_free_blocks == 6
