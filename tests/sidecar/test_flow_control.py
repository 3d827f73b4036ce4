"""Flow control's scheduler, tenants file and saturation, without HTTP (pure asyncio).

The pool's capacity is a plain number here (`Pool.capacity` slots), so every test drives
admissions and releases step by step and asserts the order, not timings."""

from __future__ import annotations

import asyncio

import pytest

from pdpool.sidecar.flow.queues import FlowController, FlowRequest, Shed, estimate_tokens
from pdpool.sidecar.flow.saturation import (
    FULL,
    HARD,
    ROOM,
    EngineLoad,
    Saturation,
    engine_load,
)
from pdpool.sidecar.flow.tenants import (
    OBJECTIVE_HEADER,
    PRIORITY_HEADER,
    PoolLimits,
    Tenant,
    TenantsConfig,
    TenantsError,
    TenantsFile,
    parse_tenants,
)

KEY_A, KEY_B = "key-of-tenant-a-0001", "key-of-tenant-b-0002"


class Pool:
    """A pool of `capacity` slots and a controllable clock. `hard`: at capacity the pool
    admits nothing (the engines report saturation); else at capacity it is only FULL (the
    pending view's bound: tenants below their share still go)."""

    def __init__(self, capacity: int, hard: bool = True, starting: int = 0, **pool: int) -> None:
        self.capacity, self.hard, self.now = capacity, hard, 1000.0
        self.starting = starting  # the starting bound (0: none)
        self.config = TenantsConfig(tenants={}, pool=PoolLimits(**pool))
        self.flow = FlowController(lambda: self.config, self, clock=lambda: self.now)
        self.log: list[str] = []  # admissions, in order

    def level(self, admitted: int, limits: PoolLimits) -> int:
        if admitted < self.capacity:
            return ROOM
        return HARD if self.hard else FULL

    def bound(self, limits: PoolLimits) -> int:
        return self.capacity

    def starting_bound(self, limits: PoolLimits) -> int:
        return self.starting

    def submit(self, tenant: Tenant, priority: int | None = None, tokens: int = 10) -> asyncio.Task:
        request = FlowRequest(tenant, tenant.priority if priority is None else priority, tokens)

        async def run():
            slot = await self.flow.acquire(request)
            self.log.append(tenant.name)
            return slot

        return asyncio.ensure_future(run())


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def tenant(name: str, **kw) -> Tenant:
    return Tenant(name=name, **kw)


async def test_admitted_at_once_while_the_pool_has_room():
    pool = Pool(capacity=2)
    a = tenant("a")
    first, second = pool.submit(a), pool.submit(a)
    await settle()
    assert first.done() and second.done()
    third = pool.submit(a)
    await settle()
    assert not third.done() and pool.flow.queue_length("a") == 1
    first.result().release()
    await settle()
    assert third.done() and pool.flow.queue_length("a") == 0
    m = pool.flow.metrics
    assert m.admitted("a", "0")._value.get() == 3


async def test_a_quiet_tenant_waits_only_for_the_next_release_under_a_10x_flood():
    """The noisy tenant has 10x the quiet one's requests queued at all times; every quiet
    request is admitted at the first release after it arrives (its wait is bounded by one
    service time, whatever the flood), and the noisy one keeps the rest of the pool."""
    pool = Pool(capacity=4, max_queued=1000)
    noisy, quiet = tenant("noisy", max_queued=500), tenant("quiet")
    held = [pool.submit(noisy) for _ in range(40)]  # 4 admitted, 36 queued
    await settle()
    running = [t.result() for t in held if t.done()]
    assert len(running) == 4
    for _ in range(10):
        q = pool.submit(quiet)
        await settle()
        assert not q.done()  # saturated: it waits...
        before = len(pool.log)
        running.pop(0).release()  # ...for one release
        await settle()
        assert q.done() and pool.log[before] == "quiet"
        q.result().release()  # quiet served; the freed slot goes to the noisy queue
        await settle()
        running = [t.result() for t in held if t.done() and t.result() not in running] + running
        running = [s for s in running if not s._released][:4]
    assert pool.log.count("quiet") == 10


async def test_at_the_pending_bound_a_tenant_below_its_share_goes_at_once():
    """FULL, not HARD: a tenant that took the whole bound while alone keeps it, but a
    newcomer below its weighted share is admitted without waiting for a release, and the
    flood gets nothing more until it is back under its own share."""
    pool = Pool(capacity=4, hard=False)
    noisy, quiet = tenant("noisy"), tenant("quiet")
    flood = [pool.submit(noisy) for _ in range(20)]
    await settle()
    assert pool.log == ["noisy"] * 4  # alone: the whole bound, the rest wait
    quiet_tasks = [pool.submit(quiet) for _ in range(3)]
    await settle()
    assert [t.done() for t in quiet_tasks] == [True, True, False]  # its share: 4 * 1/2
    running = [t.result() for t in flood if t.done()]
    running[0].release()  # noisy holds 3 > its share 2 and the pool is over the bound
    await settle()
    assert pool.log.count("noisy") == 4 and not quiet_tasks[2].done()
    running[1].release()
    await settle()
    assert pool.log.count("noisy") == 4 and not quiet_tasks[2].done()  # 4 admitted: FULL
    running[2].release()  # 3 admitted: room; the least served goes (noisy 1, quiet 2)
    await settle()
    assert pool.log.count("noisy") == 5 and not quiet_tasks[2].done()
    quiet_tasks[0].result().release()  # now quiet 1, noisy 2
    await settle()
    assert quiet_tasks[2].done() and pool.log.count("noisy") == 5
    for t in flood + quiet_tasks:
        t.cancel()


async def test_weights_share_a_band():
    pool = Pool(capacity=4)
    light, heavy = tenant("light", weight=1.0), tenant("heavy", weight=3.0)
    blocker = [pool.submit(tenant("x")) for _ in range(4)]
    await settle()
    tasks = [pool.submit(light) for _ in range(8)] + [pool.submit(heavy) for _ in range(8)]
    await settle()
    for b in blocker:
        b.result().release()
    await settle()
    assert sorted(pool.log[4:]) == ["heavy", "heavy", "heavy", "light"]
    for t in tasks:
        t.cancel()


async def closed_loop_slot_seconds(
    pool: Pool, weights: dict[str, float], streams: int, hold_s: float, horizon_s: float
) -> dict[str, float]:
    """Each tenant keeps `streams` requests outstanding (a released one is sent again at
    once), each holding its slot hold_s (+-20%, seeded) of the pool's clock, which jumps
    from release to release; the slot-seconds each tenant held until horizon_s."""
    import heapq
    import random

    rng, start = random.Random(7), pool.now
    held = dict.fromkeys(weights, 0.0)
    running: list[tuple[float, int, str, object, float]] = []
    waiting: list[tuple[str, asyncio.Task]] = []
    for name in weights:
        waiting += [(name, pool.submit(tenant(name, weight=weights[name], max_queued=500)))
                    for _ in range(streams)]  # fmt: skip
    while True:
        await settle()
        for name, task in [w for w in waiting if w[1].done()]:
            task.result().started()  # its first token at once: streaming from now on
            end = pool.now + hold_s * rng.uniform(0.8, 1.2)
            heapq.heappush(running, (end, id(task), name, task.result(), pool.now))
        waiting = [w for w in waiting if not w[1].done()]
        end, _, name, slot, granted = heapq.heappop(running)
        if end > start + horizon_s:
            heapq.heappush(running, (end, 0, name, slot, granted))
            break
        pool.now = end
        held[name] += end - granted
        slot.release()  # type: ignore[attr-defined]
        waiting.append((name, pool.submit(tenant(name, weight=weights[name], max_queued=500))))
    for _, _, name, _, granted in running:
        held[name] += start + horizon_s - granted
    for _, task in waiting:
        task.cancel()
    return held


@pytest.mark.parametrize("hard", [False, True])
async def test_weighted_tenants_hold_the_pool_in_proportion_under_contention(hard):
    """Three tenants of weights 1:2:4, 40 streams each, on a bound of 10: over many
    request lifetimes each holds its weight's share of the slot time within 15% (the
    lightest one's 1.25 slots included), whichever tenant's burst came first. (Within one
    request lifetime the first burst decides: slots are never taken back.)"""
    weights = {"w1": 1.0, "w2": 2.0, "w4": 4.0}
    for order in (["w1", "w2", "w4"], ["w4", "w2", "w1"]):
        pool = Pool(capacity=10, hard=hard, max_queued=1000)
        held = await closed_loop_slot_seconds(
            pool, {n: weights[n] for n in order}, streams=40, hold_s=1.0, horizon_s=60.0
        )
        total = sum(held.values())
        for name, w in weights.items():
            ratio = (held[name] / total) / (w / sum(weights.values()))
            assert 0.85 <= ratio <= 1.15, (order, name, ratio, held)


async def test_a_higher_band_is_always_admitted_first():
    pool = Pool(capacity=1)
    low, high = tenant("low", priority=0), tenant("high", priority=5)
    holder = pool.submit(low)
    await settle()
    lows = [pool.submit(low) for _ in range(5)]
    await settle()
    highs = [pool.submit(high) for _ in range(3)]
    await settle()
    slot = holder.result()
    for _ in range(8):
        slot.release()
        await settle()
        slot = next(t.result() for t in lows + highs if t.done() and not t.result()._released)
    assert pool.log[1:] == ["high"] * 3 + ["low"] * 5


async def test_queue_timeout_sheds_with_retry_after_and_leaves_no_entry():
    pool = Pool(capacity=0)
    t = tenant("a", queue_timeout_s=0.05)
    with pytest.raises(Shed) as shed:
        await pool.flow.acquire(FlowRequest(t, 0, 10))
    assert shed.value.reason == "queue_timeout" and shed.value.retry_after_s >= 1
    assert pool.flow.queued == 0 and pool.flow.queue_length("a") == 0
    assert pool.flow.metrics.shed("a", "0", "queue_timeout")._value.get() == 1
    assert pool.flow.metrics.queue_length("a", "0")._value.get() == 0


async def test_limits_shed_with_429_reasons():
    pool = Pool(capacity=0)
    a = tenant("a", max_queued=1)
    first = pool.submit(a)
    await settle()
    with pytest.raises(Shed) as full:
        await pool.flow.acquire(FlowRequest(a, 0, 10))
    assert full.value.reason == "queue_full" and "maxQueued" in full.value.message
    first.cancel()
    # tokens per minute: charged at arrival, Retry-After when the window has room again
    pool = Pool(capacity=10)
    b = tenant("b", tokens_per_minute=100)
    (await pool.flow.acquire(FlowRequest(b, 0, 60))).release()
    pool.now += 20
    with pytest.raises(Shed) as over:
        await pool.flow.acquire(FlowRequest(b, 0, 60))
    assert over.value.reason == "tokens_per_minute" and over.value.retry_after_s == 40
    with pytest.raises(Shed, match="exceeds"):
        await pool.flow.acquire(FlowRequest(b, 0, 101))
    pool.now += 40
    (await pool.flow.acquire(FlowRequest(b, 0, 60))).release(used_tokens=5)  # usage corrects
    (await pool.flow.acquire(FlowRequest(b, 0, 60))).release()


async def test_max_concurrency_holds_a_tenant_back_while_others_go():
    pool = Pool(capacity=10)
    capped, other = tenant("capped", max_concurrency=1), tenant("other")
    first, second = pool.submit(capped), pool.submit(capped)
    await settle()
    third = pool.submit(other)
    await settle()
    assert first.done() and not second.done() and third.done()
    first.result().release()
    await settle()
    assert second.done()


async def test_full_queues_shed_the_lowest_band_first():
    pool = Pool(capacity=0, max_queued=2)
    low, high = tenant("low", priority=0), tenant("high", priority=3)
    lows = [pool.submit(low) for _ in range(2)]
    await settle()
    h = pool.submit(high)
    await settle()
    assert lows[1].done() and isinstance(lows[1].exception(), Shed)
    assert lows[1].exception().reason == "displaced" and not lows[0].done()
    with pytest.raises(Shed) as same:  # nothing lower than the lowest: the newcomer goes
        await pool.flow.acquire(FlowRequest(low, 0, 1))
    assert same.value.reason == "queue_full"
    assert pool.flow.metrics.shed("low", "0", "displaced")._value.get() == 1
    lows[0].cancel()
    h.cancel()


async def test_a_client_that_leaves_is_removed_from_its_queue_at_once():
    pool = Pool(capacity=1)
    a = tenant("a")
    holder = pool.submit(a)
    waiting = pool.submit(a)
    await settle()
    assert pool.flow.queue_length("a") == 1
    waiting.cancel()
    await settle()
    assert pool.flow.queue_length("a") == 0 and pool.flow.queued == 0
    assert pool.flow.metrics.abandoned("a", "0")._value.get() == 1
    holder.result().release()
    assert pool.flow.admitted == 0 and pool.flow.in_flight("a") == 0


def test_estimates_and_engine_metrics():
    assert estimate_tokens({"prompt": "x" * 40, "max_tokens": 8}) == 18
    assert estimate_tokens({"prompt": [1, 2, 3]}, default_max_tokens=16) == 19
    assert estimate_tokens({"messages": [{"role": "user", "content": "abcd"}]}) == 4 + 1 + 16
    text = (
        "# HELP vllm:num_requests_waiting x\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        "vllm:num_requests_running 2.0\n"
    )
    load = engine_load(text, 5.0)
    assert load == EngineLoad(3.0, 0.25, 5.0, running=2.0)
    assert engine_load("pdpool_x 1\n", 0) is None
    limits = PoolLimits(queue_depth_threshold=3, kv_cache_usage_threshold=0.9)
    now = [10.0]
    sat = Saturation(lambda: ["a", "b"], clock=lambda: now[0])
    assert not sat.saturated(0, limits)  # nothing known
    sat.loads = {"a": EngineLoad(3, 0.1, 10.0), "b": EngineLoad(0, 0.95, 10.0)}
    assert sat.saturated(0, limits)  # every engine saturated
    sat.loads["b"] = EngineLoad(0, 0.5, 10.0)
    assert not sat.saturated(0, limits)
    assert sat.saturated(8, PoolLimits(max_in_flight_per_backend=4))  # the pending view
    now[0] = 100.0  # stale metrics say nothing
    sat.loads["b"] = EngineLoad(9, 1, 10.0)
    assert not sat.saturated(0, limits)
    assert not Saturation(lambda: []).saturated(10**6, PoolLimits(max_in_flight_per_backend=1))


GOOD = f"""
tenants:
  - name: a
    keys: ["{KEY_A}"]
    weight: 2
    priority: 1
    maxPriority: 4
    maxConcurrency: 3
    maxQueued: 5
    queueTimeoutSeconds: 2.5
    tokensPerMinute: 1000
  - name: b
    keys: ["{KEY_B}"]
objectives:
  - {{name: critical, priority: 9}}
pool: {{maxInFlightPerBackend: 4, queueDepthThreshold: 2, kvCacheUsageThreshold: 0.7}}
"""


def test_tenants_file_parsing_and_priorities():
    cfg = parse_tenants(GOOD)
    a = cfg.tenant_for_key(KEY_A)
    assert a is not None and a.name == "a" and a.weight == 2.0 and a.max_concurrency == 3
    assert cfg.tenant_for_key(KEY_B).name == "b" and cfg.tenant_for_key("x" * 20) is None
    assert cfg.pool == PoolLimits(4, 2, 0.7, 1000)
    assert cfg.priority_of(a, {}) == 1
    assert cfg.bands == (0, 1, 4, 9)
    assert cfg.priority_of(a, {PRIORITY_HEADER: "4"}) == 4
    assert cfg.priority_of(a, {PRIORITY_HEADER: "3"}) == 1  # the band the file names below
    assert cfg.priority_of(a, {PRIORITY_HEADER: "99"}) == 4  # bounded by maxPriority
    assert cfg.priority_of(a, {PRIORITY_HEADER: " 0 "}) == 0  # lower is always allowed
    assert cfg.priority_of(a, {PRIORITY_HEADER: "-2"}) == 0  # ... down to the lowest band
    # malformed: the tenant's own band, as if the header were absent
    for junk in ("high", "1e3", "1_0", "\u0663", "4" * 40, ""):
        assert cfg.priority_of(a, {PRIORITY_HEADER: junk}) == 1, junk
    assert cfg.priority_of(a, {OBJECTIVE_HEADER: "critical"}) == 4
    assert cfg.priority_of(cfg.tenants["b"], {OBJECTIVE_HEADER: "critical"}) == 0


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", "the file: must be a mapping"),
        ("tenants: []", "tenants: a non-empty list"),
        ("tenants: [{keys: []}]", r"tenants\[0\].name"),
        ("tenants: [{name: a, wieght: 2}]", r"tenants\[0\]: unknown field\(s\) wieght"),
        ("tenants: [{name: a, weight: 0}]", r"tenants\[0\].weight: must be > 0"),
        ("tenants: [{name: a, maxQueued: -1}]", r"maxQueued: must be >= 0"),
        ("tenants: [{name: a, maxConcurrency: 1.5}]", "must be an integer"),
        ("tenants: [{name: a, keys: [short]}]", "shorter than 16"),
        ("tenants: [{name: a}, {name: a}]", "appears twice"),
        (f"tenants: [{{name: a, keys: [{KEY_A}]}}, {{name: b, keys: [{KEY_A}]}}]", "also belongs"),
        ("tenants: [{name: a, priority: 3, maxPriority: 1}]", "maxPriority: must be >= 3"),
        ("tenants: [{name: a}]\npool: {kvCacheUsageThreshold: 2}", "must be <= 1"),
        ("tenants: [{name: a}]\nextra: 1", "unknown field"),
        ("tenants: [", "not valid YAML"),
    ],
)
def test_tenants_file_errors_name_the_field(text, error):
    with pytest.raises(TenantsError, match=error):
        parse_tenants(text)


def test_tenants_file_is_reread_when_it_changes(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(GOOD)
    source = TenantsFile(str(path), recheck_s=0, settle_s=0)
    assert set(source.current().tenants) == {"a", "b"}
    path.write_text(f"tenants: [{{name: c, keys: ['{KEY_A}']}}]\n")
    source.current()  # new content is taken once it reads the same twice
    assert set(source.current().tenants) == {"c"}
    assert source.current().tenant_for_key(KEY_A).name == "c"
    path.write_text("tenants: [{name: c, weight: -1}]\n")  # broken: the last good one stays
    for _ in range(3):
        assert set(source.current().tenants) == {"c"}
    with pytest.raises(TenantsError, match=r"tenants.yaml: tenants\[0\].weight"):
        TenantsFile(str(path))


def test_an_estimate_never_fails_on_what_a_route_leaves_unchecked():
    """A completion's body may carry anything under `messages` (the route does not read it):
    the estimate ignores it instead of failing the request with a 500."""
    from devtools.api_fuzz import ROUTES, BodyMaker

    assert estimate_tokens({"prompt": [1, 2, 3], "messages": 1e308}) == 3 + 16
    maker = BodyMaker("m", seed=3)
    for _ in range(2000):
        estimate_tokens(maker.json_body(maker.rnd.choice(ROUTES)))
