"""--scheduling-policy priority against fcfs, with vLLM 0.32's semantics: the waiting line by
(priority, arrival), lower first; when blocks run out the lowest-priority running request is
preempted (fcfs: the newest); waiting requests never preempt; fcfs ignores priorities."""

from __future__ import annotations

import pytest

from pdpool.engine.config import EngineConfig
from pdpool.engine.kv.manager import KVCacheManager
from pdpool.engine.request import Request
from pdpool.engine.sampling_params import SamplingParams
from pdpool.engine.scheduler import Scheduler, SchedulerConfig

BS = 4


def make(rid, n_tokens, priority=0, arrival=0.0, max_tokens=20):
    start = 1000 * (ord(rid[0]) % 32)  # distinct prompts: no prefix sharing
    return Request(
        rid,
        list(range(start, start + n_tokens)),
        SamplingParams(max_tokens=max_tokens),
        block_size=BS,
        arrival_time=arrival,
        priority=priority,
    )


def sched(policy, num_blocks=64, max_seqs=8, budget=64):
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, policy=policy),
        KVCacheManager(num_blocks, BS),
    )


def run_step(s: Scheduler, out, token=1):
    for item in out.scheduled:
        r = item.request
        r.num_computed_tokens += item.num_new_tokens
        s.kv.cache_full_blocks(r, r.num_computed_tokens)
        if r.num_computed_tokens == r.num_tokens:
            r.append_output_token(token)


def ids(requests):
    return [r.request_id for r in requests]


def admitted_order(policy, requests, first=None):
    """The order requests start running with one batch slot: `first` runs alone, then the
    others are queued; each runs to completion before the next is admitted."""
    s = sched(policy, max_seqs=1)
    order = []
    if first is not None:
        s.add_request(first)
        run_step(s, s.schedule())
        order.append(first.request_id)
    for r in requests:
        s.add_request(r)
    while s.waiting:
        for running in list(s.running):
            s.finish_request(running, running.status.FINISHED_LENGTH)
        out = s.schedule()
        order += [x.request.request_id for x in out.scheduled]
        run_step(s, out)
    return order


def test_priority_orders_the_line_by_priority_then_arrival():
    mix = [
        make("low1", 5, priority=5, arrival=1.0),
        make("mid", 5, priority=0, arrival=2.0),
        make("low2", 5, priority=5, arrival=3.0),
        make("high", 5, priority=-1, arrival=4.0),
        make("mid2", 5, priority=0, arrival=5.0),
    ]
    first = make("busy", 5, priority=9, arrival=0.0)
    order = admitted_order("priority", mix, first)
    assert order == ["busy", "high", "mid", "mid2", "low1", "low2"]


def test_fcfs_ignores_priority():
    mix = [
        make("low1", 5, priority=5, arrival=1.0),
        make("high", 5, priority=-1, arrival=2.0),
        make("mid", 5, priority=0, arrival=3.0),
    ]
    assert admitted_order("fcfs", mix, make("busy", 5, priority=9)) == [
        "busy",
        "low1",
        "high",
        "mid",
    ]


def three_running(policy):
    """a, b, c running in that order (2 blocks each, all 6 taken), c admitted a step after
    the others; at the next step a needs a 3rd block."""
    s = sched(policy, num_blocks=6)
    a = make("a", 7, priority=0, arrival=1.0)
    b = make("b", 7, priority=5, arrival=2.0)
    c = make("c", 7, priority=1, arrival=3.0)
    s.add_request(a)
    s.add_request(b)
    run_step(s, s.schedule())
    s.add_request(c)
    out = s.schedule()
    assert ids(x.request for x in out.scheduled) == ["a", "b", "c"]
    run_step(s, out)
    return s, a, b, c


def test_priority_preempts_the_lowest_priority_running_request():
    s, _, b, _ = three_running("priority")
    out = s.schedule()
    assert out.preempted == [b]  # not c, the newest: b has the highest value
    assert ids(x.request for x in out.scheduled) == ["a", "c"]
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1


def test_fcfs_preempts_the_newest_running_request():
    s, _, _, c = three_running("fcfs")
    out = s.schedule()
    assert out.preempted == [c]
    assert ids(x.request for x in out.scheduled) == ["a", "b"]


def test_a_victim_scheduled_earlier_in_the_step_is_taken_back_out():
    """b (priority 5) runs ahead of a (priority 0) and was scheduled this step when a runs
    out of blocks: b is preempted, its tokens leave the step and its blocks go to a."""
    s = sched("priority", num_blocks=4)
    b = make("b", 5, priority=5, arrival=1.0)  # needs its 3rd block one step after a
    a = make("a", 7, priority=0, arrival=2.0)
    s.add_request(b)
    s.add_request(a)
    run_step(s, s.schedule())
    run_step(s, s.schedule())
    out = s.schedule()
    assert out.preempted == [b]
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1)]
    assert list(s.running) == [a] and not s.kv.holds(b)
    assert set(out.kv_view.block_tables) == {"a"}  # the runner sees a alone


def test_a_preempted_request_goes_back_behind_higher_priorities():
    s, _, b, _ = three_running("priority")
    high = make("high", 3, priority=-1, arrival=9.0)
    s.add_request(high)
    out = s.schedule()
    assert out.preempted == [b]
    assert ids(s.waiting) == ["high", "b"]  # fcfs would put b back at the head


def test_a_waiting_request_never_preempts_a_running_one():
    """As vLLM v1: a full batch makes the highest priority wait for a slot, too."""
    s = sched("priority", max_seqs=1)
    low = make("low", 5, priority=10, arrival=1.0)
    s.add_request(low)
    run_step(s, s.schedule())
    s.add_request(make("high", 5, priority=-10, arrival=2.0))
    out = s.schedule()
    assert out.preempted == [] and ids(x.request for x in out.scheduled) == ["low"]


def test_scheduling_policy_is_validated():
    with pytest.raises(ValueError, match="--scheduling-policy"):
        EngineConfig(model="m", scheduling_policy="lifo").validate()
