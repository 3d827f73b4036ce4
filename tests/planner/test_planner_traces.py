"""The planner on metric traces: closed-loop pools (trace_model.py) under ramps, spikes and
prompt- or output-heavy mixes; the decisions, their hysteresis, no flapping."""

from __future__ import annotations

from itertools import pairwise

import pytest

from pdpool.planner.policy import PlannerConfig, RoleBounds

from .trace_model import Load, Pool


def config(**over) -> PlannerConfig:
    base = dict(
        prefill=RoleBounds(1, 6),
        decode=RoleBounds(1, 6),
        ttft_seconds=0.5,
        itl_seconds=0.05,
        up_window_s=0.0,
        down_window_s=60.0,
        up_cooldown_s=10.0,
        down_cooldown_s=30.0,
    )
    base.update(over)
    return PlannerConfig(**base).validate()


def direction_changes(series: list[int]) -> int:
    """How often the replica count turned around (up after down or down after up)."""
    steps = [b - a for a, b in pairwise(series) if b != a]
    return sum(1 for a, b in pairwise(steps) if (a > 0) != (b > 0))


def test_ramp_up_adds_engines_step_by_step_and_never_removes_any():
    pool = Pool(config(), prefill=1, decode=1)
    pool.run([Load(users=u, prompt_tokens=1024) for u in range(1, 41, 2) for _ in range(2)])
    for role in ("prefill", "decode"):
        series = pool.replicas(role)
        assert all(b >= a for a, b in pairwise(series)), (role, series)
        assert all(b - a <= 2 for a, b in pairwise(series)), series  # max step up
    assert pool.replicas("prefill")[-1] >= 4 and pool.replicas("decode")[-1] >= 3
    last = pool.decisions[-1]
    assert "target" in last.prefill.reason


def test_spike_scales_up_at_once_then_down_only_after_the_window_one_at_a_time():
    pool = Pool(config(), prefill=1, decode=1)
    quiet, spike = Load(users=2), Load(users=48, output_tokens=128)
    pool.run([quiet] * 3 + [spike] * 4 + [quiet] * 20)
    decode = pool.replicas("decode")
    assert decode[3] > 1  # the spike's first tick already asks for more
    peak_at = decode.index(max(decode))
    assert max(decode) >= 4
    # Held through the down window (60 s = 6 ticks after the spike ended at tick 7).
    first_drop = next(i for i in range(peak_at, len(decode)) if decode[i] < max(decode))
    assert first_drop >= 7 + 5
    assert all(a - b <= 1 for a, b in pairwise(decode))  # max step down
    assert decode[-1] == 1
    assert direction_changes(decode) == 1  # up, then down: no flapping


def test_ramp_down_returns_to_the_minimum_without_turning_back():
    pool = Pool(config(), prefill=4, decode=4)
    pool.run([Load(users=u, prompt_tokens=512) for u in range(30, 0, -2) for _ in range(2)])
    pool.run([Load(users=0)] * 20)
    for role in ("prefill", "decode"):
        series = pool.replicas(role)
        assert all(b <= a for a, b in pairwise(series)), (role, series)
        assert series[-1] == 1, series
    assert "idle" in pool.decisions[-1].decode.reason or pool.decisions[-1].decode.desired == 1


@pytest.mark.parametrize(
    ("load", "grows", "stays"),
    [
        (Load(users=12, prompt_tokens=4096, output_tokens=16), "prefill", "decode"),
        (Load(users=12, prompt_tokens=64, output_tokens=512), "decode", "prefill"),
    ],
    ids=["prefill-heavy", "decode-heavy"],
)
def test_each_role_scales_on_its_own_bottleneck(load, grows, stays):
    pool = Pool(config(), prefill=1, decode=1)
    pool.run([load] * 15)
    assert pool.replicas(grows)[-1] >= 3, pool.replicas(grows)
    assert set(pool.replicas(stays)) == {1}, pool.replicas(stays)
    reason = pool.decisions[3].role(grows).reason
    assert ("ttft" if grows == "prefill" else "itl") in reason, reason


def test_steady_load_near_target_holds_the_replicas():
    pool = Pool(config(), prefill=2, decode=2)
    # About 60 % busy on 2 engines: within the band where neither direction is justified.
    pool.run([Load(users=20, prompt_tokens=512)] * 30)
    for role in ("prefill", "decode"):
        series = pool.replicas(role)
        assert direction_changes(series) == 0, (role, series)
        assert len(set(series[5:])) == 1, (role, series)


def test_alternating_bursts_do_not_flap():
    """Bursts shorter than the down window: the pool stays scaled up instead of
    removing and re-adding engines on every lull."""
    pool = Pool(config(), prefill=1, decode=1)
    burst, lull = Load(users=40, output_tokens=128), Load(users=2)
    pool.run(([burst] * 2 + [lull] * 3) * 6)
    decode = pool.replicas("decode")
    assert direction_changes(decode) == 0, decode
    assert decode[-1] == max(decode)


def test_up_cooldown_spaces_scale_ups_and_max_replicas_caps_them():
    pool = Pool(config(up_cooldown_s=30.0, decode=RoleBounds(1, 3)), prefill=1, decode=1)
    pool.run([Load(users=60, output_tokens=256)] * 12)
    decode = pool.replicas("decode")
    ups = [i for i, (a, b) in enumerate(pairwise(decode)) if b > a]
    assert all(b - a >= 3 for a, b in pairwise(ups)), decode  # 30 s = 3 ticks apart
    assert max(decode) == 3


def test_the_first_scrape_decides_nothing():
    pool = Pool(config(), prefill=1, decode=1)
    first = pool.tick(Load(users=60, output_tokens=512))
    assert not first.changed and "first scrape" in first.decode.reason
    assert pool.tick(Load(users=60, output_tokens=512)).decode.desired > 1


def test_scale_to_zero_is_off_by_default_and_prefill_comes_back_on_demand():
    with pytest.raises(ValueError, match="scaleToZero"):
        config(prefill=RoleBounds(0, 2))
    pool = Pool(config(prefill=RoleBounds(0, 2), scale_to_zero=True), prefill=1, decode=1)
    pool.run([Load(users=0)] * 12)
    assert pool.replicas("prefill")[-1] == 0
    assert pool.replicas("decode")[-1] == 1  # decode never goes to zero


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (dict(decode=RoleBounds(0, 2)), "decode min must be >= 1"),
        (dict(prefill=RoleBounds(3, 2)), "prefill: need 0 <= min <= max"),
        (dict(ttft_seconds=0.0), "must be > 0"),
        (dict(max_step_up=0), "maximum steps"),
        (dict(down_window_s=-1.0), "windows and cool-downs"),
    ],
)
def test_bad_settings_are_refused_with_a_reason(over, message):
    with pytest.raises(ValueError, match=message):
        config(**over)


def test_an_engine_a_scale_up_bought_is_kept_while_the_load_that_needed_it_stays():
    """Below an engine's batch limit latency barely moves with load, so two engines can
    sit at half the ITL target with a load one engine could not carry: the load per engine
    that needed the scale-up must fit n-1 engines before one is removed."""
    from pdpool.planner.policy import recommend
    from pdpool.planner.signals import PoolSignals, RoleSignals, Signals

    def signals(running):
        idle = RoleSignals(1, 0, 0, 0.0, None, None, 0, 0.0, 0.0)
        busy = RoleSignals(2, running, 0, 0.2, 0.05, 0.025, 40, 0.0, 900.0)
        return Signals(idle, busy, PoolSignals(0, 0, 0, None), 10.0)

    cfg = config()
    assert recommend("decode", 2, signals(8), cfg).replicas == 1  # nothing remembered
    held = recommend("decode", 2, signals(8), cfg, saturated_per_engine=6.0)
    assert held.replicas == 2 and "would not fit 1" in held.reason
    assert recommend("decode", 2, signals(3), cfg, saturated_per_engine=6.0).replicas == 1


def test_a_saturation_measured_under_other_targets_is_forgotten():
    """The load per engine a scale-up needed holds engines only while the targets it was
    measured against stand: relaxed targets (a pool's spec edited) let the same load
    scale down at once."""
    from dataclasses import replace

    from pdpool.planner.stabilize import RoleState, plan_role

    cfg = config(down_window_s=0.0, down_cooldown_s=0.0)
    busy = _decode_signals(2, 8, 0, itl_p90=0.01)
    st = RoleState(2, since=0.0, saturated_per_engine=6.0, saturated_targets=cfg.targets())
    kept, held = plan_role(cfg, "decode", st, 100.0, busy)
    assert held.desired == 2 and "would not fit 1" in held.reason
    assert kept.saturated_per_engine == 6.0
    relaxed = replace(cfg, itl_seconds=cfg.itl_seconds * 10)
    after, down = plan_role(relaxed, "decode", st, 100.0, busy)
    assert down.desired == 1, down.reason
    assert after.saturated_per_engine is None and after.saturated_targets is None


def _decode_signals(engines, running, waiting, itl_p90=0.02, decode_ttft_p90=None, ttft_p90=0.1):
    from pdpool.planner.signals import PoolSignals, RoleSignals, Signals

    idle = RoleSignals(1, 0, 0, 0.0, None, None, 0, 0.0, 0.0)
    busy = RoleSignals(engines, running, waiting, 0.3, ttft_p90, itl_p90, 20, 0.0, 500.0)
    pool = PoolSignals(0, 0, 0, None, decode_ttft_p90)
    return Signals(idle, busy, pool, 10.0)


def test_a_queue_asks_at_once_for_the_engines_that_would_run_it():
    """Full engines queue the rest: 4 running and 8 queued on one engine need 3 such
    engines, more than the proportional estimate on the queue's pressure (2)."""
    from pdpool.planner.policy import recommend

    rec = recommend("decode", 1, _decode_signals(1, running=4, waiting=8), config())
    assert rec.replicas == 3 and "waiting at 2.00x" in rec.reason
    # Without a queue the latency alone decides (proportionally).
    assert recommend("decode", 1, _decode_signals(1, 4, 0, itl_p90=0.08), config()).replicas == 2


def test_engines_still_starting_are_not_asked_for_again():
    """Two of three engines are starting (they served nothing in the window): the one that
    did serve at 1.5x target does not make the planner add more."""
    from pdpool.planner.policy import recommend

    rec = recommend("decode", 3, _decode_signals(1, 4, 0, itl_p90=0.075), config())
    assert rec.replicas == 3


def test_the_sidecars_first_token_time_counts_for_decode():
    """An engine that leaves queueing out of its own TTFT still scales: the sidecars' view
    of decode's first bytes (queue included) is one of decode's signals."""
    from pdpool.planner.policy import recommend

    rec = recommend("decode", 1, _decode_signals(1, 4, 2, decode_ttft_p90=1.5), config())
    assert rec.replicas == 3 and "decode_ttft at 3.00x" in rec.reason
    # Near target it holds an engine the engines' own signals alone would give up.
    assert recommend("decode", 2, _decode_signals(2, 2, 0), config()).replicas == 1
    near = recommend("decode", 2, _decode_signals(2, 2, 0, decode_ttft_p90=0.45), config())
    assert near.replicas == 2 and "decode_ttft at 0.90x" in near.reason


def test_a_window_in_which_running_requests_made_no_token_keeps_the_engines():
    """Six streams run, yet no first or next token came out between two scrapes (a step
    longer than the window: a new engine's start-up took the CPU). The other signals
    (KV usage, no queue) are far under target, but that is no evidence of headroom: no
    scale-down, while the same window with tokens in it does scale down."""
    from pdpool.planner.policy import recommend

    stalled = _decode_signals(3, running=6, waiting=0, itl_p90=None, ttft_p90=None)
    rec = recommend("decode", 3, stalled, config())
    assert rec.replicas == 3 and "no token came out while 6 requests" in rec.reason
    flowing = recommend("decode", 3, _decode_signals(3, 6, 0, itl_p90=0.005), config())
    assert flowing.replicas < 3
    # Nothing running is idle, not stalled: down to the minimum as before.
    idle = _decode_signals(3, 0, 0, itl_p90=None, ttft_p90=None)
    assert recommend("decode", 3, idle, config()).replicas < 3
