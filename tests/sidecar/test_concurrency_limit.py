"""The adaptive concurrency limit (concurrency_limit.py) and the fair shares it is split
into (sidecar/flow/queues.py), without HTTP: an engine modelled by its step time against its
batch, a virtual clock, closed-loop tenants. No pool section anywhere: nothing is tuned."""

from __future__ import annotations

import asyncio
import heapq
import itertools

import pytest

from pdpool.sidecar.flow.concurrency_limit import (
    PATIENCE,
    SMALL_BATCH,
    TOLERANCE,
    AdaptiveLimit,
    EngineSample,
)
from pdpool.sidecar.flow.queues import FlowController, FlowRequest
from pdpool.sidecar.flow.saturation import FULL, ROOM, Saturation
from pdpool.sidecar.flow.tenants import PoolLimits, Tenant, TenantsConfig

BASE = 0.01  # the modelled engine's step time for a small batch


def step_time(batch: float) -> float:
    """Batching is free up to 4 requests, then each one lengthens every step by a quarter
    (a CPU, or a GPU past its memory-bound region): throughput stops growing at 4."""
    return BASE * (1 + 0.25 * max(0.0, batch - 4))


def test_the_limit_rises_near_the_baseline_and_falls_when_latency_grows():
    limit = AdaptiveLimit()
    for _ in range(5):  # the engine runs all it is let, at its unloaded step time
        before = limit.limit
        limit.update(BASE, running=limit.limit, waiting=0, kv=0.1)
        assert limit.limit > before
    grown = limit.limit
    seen = [grown]
    for _ in range(4):  # steps 4x past the tolerance at this batch: it shrinks each sample
        limit.update(BASE * TOLERANCE * 4, running=grown, waiting=0, kv=0.1)
        seen.append(limit.limit)
    assert seen == sorted(seen, reverse=True) and seen[-1] <= grown / 4 + 1e-9
    for _ in range(50):  # however slow (a batch of other routers' requests), never below 1
        limit.update(BASE * 100, running=10, waiting=0, kv=0.1)
    assert limit.limit == 1 and limit.value == 1


def test_a_small_batch_measures_the_baseline_again():
    """A slower step at a batch of one or two is the new baseline (longer prompts, a slower
    machine), not congestion: the limit is not held at 1 for ever."""
    limit = AdaptiveLimit()
    limit.update(BASE, running=1, waiting=0, kv=0.1)
    for _ in range(10):
        limit.update(BASE * 3, running=min(2, limit.value), waiting=0, kv=0.1)
    assert limit.baseline == pytest.approx(BASE * 3, rel=0.01)
    assert limit.limit >= 2


def test_an_engine_flooded_before_its_first_sample_starts_slow_and_measures_a_small_batch():
    """A first sample from a batch of 16 is not the baseline (16 would then look as cheap as
    one, and nothing would ever be held): the limit drops to a small batch until one has been
    measured, then grows from there."""
    limit = AdaptiveLimit(initial=16)
    limit.update(step_time(16), running=16, waiting=0, kv=0.1)
    assert limit.baseline is None and limit.value == SMALL_BATCH
    limit.update(step_time(16), running=12, waiting=0, kv=0.1)  # draining: still unmeasured
    assert limit.baseline is None and limit.value == SMALL_BATCH
    limit.update(step_time(2), running=2, waiting=0, kv=0.1)
    assert limit.baseline == pytest.approx(BASE)
    for _ in range(30):
        limit.update(step_time(limit.limit), running=limit.limit, waiting=0, kv=0.1)
    # held where the step is TOLERANCE x the small batch's, not TOLERANCE x the flood's
    assert limit.value > SMALL_BATCH and step_time(limit.value) <= TOLERANCE * BASE * 1.25


def test_without_a_small_batch_for_long_the_step_time_seen_is_the_baseline():
    """Other routers keep the engine busy: after PATIENCE samples the batch it runs is the
    baseline, so the limit is not held at a small batch for ever."""
    limit = AdaptiveLimit(initial=16)
    for _ in range(PATIENCE + 1):
        limit.update(step_time(8), running=8, waiting=0, kv=0.1)
    assert limit.baseline == pytest.approx(step_time(8))
    for _ in range(5):
        limit.update(step_time(8), running=limit.limit, waiting=0, kv=0.1)
    assert limit.value > SMALL_BATCH


def test_the_limit_grows_only_when_in_use_and_below_the_engines_own_limits():
    limit = AdaptiveLimit(initial=8)
    limit.update(BASE, running=1, waiting=0, kv=0.1)  # one request: nothing learned
    assert limit.limit == 8
    limit.update(BASE, running=8, waiting=0, kv=0.9)  # KV nearly full: no growth
    assert limit.limit == 8
    limit.update(BASE, running=6, waiting=3, kv=0.1)  # a request waits once: no cap yet
    limit.update(BASE, running=6, waiting=3, kv=0.1)  # still: the engine batches 6 at most
    assert limit.ceiling == 6 and limit.limit == 6 - 6 / 4  # a few places kept free
    for _ in range(20):  # no queue any more: it grows, but stays below the engine's limit
        limit.update(BASE, running=limit.limit, waiting=0, kv=0.1)
    assert 4 <= limit.limit < 6


def test_below_a_full_engines_batch_limit_places_stay_free():
    """An engine that runs at most 64 (its max_num_seqs) and queues the rest, 200 streams
    offered: the limit settles a few places below 64, so a request let past the bound (a
    quiet tenant, a higher band) starts at once; the engine queues again only rarely (the
    ceiling is retried upward slowly)."""
    limit = AdaptiveLimit()
    limit.update(BASE, running=1, waiting=0, kv=0.1)
    queued_samples, settled = 0, []
    for n in range(400):
        admitted = min(200, limit.value)
        running, waiting = min(64, admitted), max(0, admitted - 64)
        limit.update(BASE, running=running, waiting=waiting, kv=0.1)  # batching free
        if n >= 100:
            settled.append(limit.value)
            queued_samples += waiting > 0
    assert max(settled) <= 66 and min(settled) >= 56, settled
    assert queued_samples <= 0.1 * len(settled)
    before = limit.ceiling
    for _ in range(200):  # a minute idle (one request now and then): the ceiling stays
        limit.update(BASE, running=1, waiting=0, kv=0.1)
    assert limit.ceiling == before and limit.value <= before - 4


def test_the_itl_of_each_interval_comes_from_the_histograms_totals():
    limit = AdaptiveLimit()
    limit.observe(EngineSample(running=1, itl_sum=5.0, itl_count=500))  # totals so far
    assert limit.baseline is None
    limit.observe(EngineSample(running=1, itl_sum=5.1, itl_count=510))  # 10 tokens: too few
    assert limit.baseline is None
    limit.observe(EngineSample(running=1, itl_sum=5.4, itl_count=540))  # 40 tokens, 10 ms
    assert limit.baseline == pytest.approx(0.01)
    limit.observe(EngineSample(running=1, itl_sum=0.1, itl_count=10))  # engine restarted
    assert limit.baseline == pytest.approx(0.01)


def test_against_a_modelled_engine_the_limit_settles_at_its_knee():
    """Closed loop: the engine runs whatever the limit lets in (40 waiting streams). The
    limit ends near where more requests stop adding throughput: the throughput of batching
    all 40, at a fraction of their step time."""
    limit = AdaptiveLimit()
    seen = []
    for _ in range(200):
        batch = min(40, limit.value)
        limit.update(step_time(batch), running=batch, waiting=0, kv=0.1)
        seen.append(batch)
    settled = seen[100:]
    assert min(settled) >= 4 and max(settled) <= 10, settled
    throughput = sum(b / step_time(b) for b in settled) / len(settled)
    assert throughput >= 0.9 * 40 / step_time(40)
    assert max(step_time(b) for b in settled) <= TOLERANCE * BASE * 1.25 <= step_time(40) / 4


class FixedBound:
    """The saturation view with a given bound (what the adaptive limit says now)."""

    def __init__(self, bound: int) -> None:
        self.value = bound

    def level(self, admitted: int, limits: PoolLimits) -> int:
        return FULL if admitted >= self.value else ROOM

    def bound(self, limits: PoolLimits) -> int:
        return self.value

    def starting_bound(self, limits: PoolLimits) -> int:
        return 0  # the requests here have no first token to wait for


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def closed_loop(weights: dict[str, float], bound: int, seconds: float) -> dict:
    """Each tenant keeps 20 requests outstanding, each holding its slot 1 s (virtual);
    returns the slot-seconds each was served after the first 20 s."""
    now = [0.0]
    config = TenantsConfig(tenants={}, pool=PoolLimits(max_queued=10_000))
    flow = FlowController(lambda: config, FixedBound(bound), clock=lambda: now[0])
    tenants = {
        n: Tenant(n, weight=w, max_queued=1000, queue_timeout_s=1e9) for n, w in weights.items()
    }
    ends: list = []
    seq = itertools.count()
    served = dict.fromkeys(weights, 0.0)
    peak = dict.fromkeys(weights, 0)

    async def one(name: str) -> None:
        slot = await flow.acquire(FlowRequest(tenants[name], 0, 10))
        slot.started()
        heapq.heappush(ends, (now[0] + 1.0, next(seq), name, slot))
        peak[name] = max(peak[name], flow.in_flight(name))

    tasks = [asyncio.ensure_future(one(n)) for n in weights for _ in range(20)]
    await settle()
    while ends and now[0] < seconds:
        end, _, name, slot = heapq.heappop(ends)
        now[0] = end
        slot.release()
        if end > 20:
            served[name] += 1.0
        tasks.append(asyncio.ensure_future(one(name)))
        await settle()
    for t in tasks:
        t.cancel()
    await settle()
    return {"served": served, "peak": peak, "admitted_peak": max(peak.values())}


async def test_a_lone_tenant_holds_the_whole_limit():
    result = await closed_loop({"alone": 1.0}, bound=5, seconds=60)
    assert result["peak"]["alone"] == 5


async def test_contending_tenants_share_a_small_limit_by_weight():
    """Three tenants of weights 1:2:4, a limit of 3 (fewer slots than the weights need):
    over time each holds the pool in proportion to its weight, within 15%."""
    weights = {"w1": 1.0, "w2": 2.0, "w4": 4.0}
    served = (await closed_loop(weights, bound=3, seconds=400))["served"]
    total = sum(served.values())
    for name, w in weights.items():
        share, want = served[name] / total, w / sum(weights.values())
        assert abs(share - want) <= 0.15 * want, (name, share, want, served)


def itl_page(running: int, itl_sum: float, itl_count: int, waiting: int = 0) -> str:
    labels = '{engine="0",model_name="m"}'
    return (
        f"vllm:num_requests_running{labels} {running}\n"
        f"vllm:num_requests_waiting{labels} {waiting}\n"
        f"vllm:kv_cache_usage_perc{labels} 0.1\n"
        f"vllm:inter_token_latency_seconds_sum{labels} {itl_sum}\n"
        f"vllm:inter_token_latency_seconds_count{labels} {itl_count}\n"
    )


async def test_with_no_pool_section_the_bound_is_the_engines_learned_limits():
    """The pending view's bound comes from the engines' ITL when the file sets none; an
    explicit maxInFlightPerBackend stays the override."""
    pages: dict[str, str] = {}

    async def fetch(backend: str) -> str:
        return pages[backend]

    sat = Saturation(lambda: ["a", "b"], fetch)
    totals = {"a": [0.0, 0], "b": [0.0, 0]}
    none = PoolLimits()
    assert sat.bound(none) == 0  # nothing read yet: no bound (as before)
    for _ in range(6):  # both engines run all they are let, at their baseline step time
        for b, t in totals.items():
            t[0] += 0.5
            t[1] += 50
            running = sat.limits[b].value if b in sat.limits else 1
            pages[b] = itl_page(running, t[0], t[1])
        await sat.scrape_once()
    grown = sat.bound(none)
    assert grown == sat.limits["a"].value + sat.limits["b"].value and grown > 4
    for b, t in totals.items():  # steps 40x slower (past the tolerance): both limits shrink
        t[0] += 20.0
        t[1] += 50
        pages[b] = itl_page(sat.limits[b].value, t[0], t[1])
    await sat.scrape_once()
    assert sat.bound(none) < grown
    assert sat.level(sat.bound(none), none) == FULL
    assert sat.bound(PoolLimits(max_in_flight_per_backend=7)) == 14
