"""The planner on a recorded trace: every scrape `pdpool up --autoscale --autoscale-trace`
read during `benchmarks/autoscale.py --backend sim --users 12 --step-s 8 --interval-s 1`
(llm-d-inference-sim engines; users ramp 1 -> 12 -> 1 with long prompts, then again with
long outputs), with the replicas the live planner counted at each tick.

Replayed through plan(): the live decisions come back exactly (the planner is a function of
its inputs), and other settings decide as they should on the same real metrics."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest

from pdpool.planner.policy import PlannerConfig, RoleBounds
from pdpool.planner.stabilize import Decision, initial_state, plan, with_replicas
from pdpool.planner.trace import Tick, read_trace

TRACE = Path(__file__).parent / "traces" / "sim-ramp.jsonl.gz"
ROLES = ("prefill", "decode")


def live_config(**over) -> PlannerConfig:
    """What `pdpool up` made of the benchmark's flags (targets 1 s / 50 ms, 1..3 engines per
    role, interval 1 s, scale-down window 10 s)."""
    base = dict(
        prefill=RoleBounds(1, 3),
        decode=RoleBounds(1, 3),
        ttft_seconds=1.0,
        itl_seconds=0.05,
        down_window_s=10.0,
        up_cooldown_s=2.0,
        down_cooldown_s=5.0,
    )
    base.update(over)
    return PlannerConfig(**base).validate()


@pytest.fixture(scope="module")
def ticks() -> list[Tick]:
    return list(read_trace(TRACE))


def replay(cfg: PlannerConfig, ticks: list[Tick], follow_recording: bool) -> list[Decision]:
    """Each tick's decision. follow_recording: the replicas each tick are the recorded
    ones (as the live run counted them); otherwise those the replay decided, as if the
    metrics had been the same (open loop)."""
    first = ticks[0].replicas
    state = initial_state(first["prefill"], first["decode"])
    decisions = []
    for tick in ticks:
        if follow_recording:
            state = with_replicas(state, tick.replicas["prefill"], tick.replicas["decode"])
        state, decision = plan(cfg, state, tick.snapshot)
        decisions.append(decision)
    return decisions


def test_the_recording_is_a_whole_ramp(ticks):
    assert len(ticks) > 100
    for role in ROLES:
        counts = [t.replicas[role] for t in ticks]
        assert counts[0] == counts[-1] == 1 and max(counts) == 3, (role, counts)
    assert any(e.role == "sidecar" for t in ticks for e in t.snapshot.endpoints)


def test_replaying_gives_back_the_live_decisions(ticks):
    """What the live planner decided at each tick is what the next tick counted."""
    decisions = replay(live_config(), ticks, follow_recording=True)
    for decision, now, after in zip(decisions, ticks, ticks[1:], strict=False):
        for role in ROLES:
            d = decision.role(role)
            assert d.current == now.replicas[role]
            assert d.desired == after.replicas[role], (now.snapshot.at, role, d.reason)


def test_each_role_scales_up_on_its_own_phase(ticks):
    """Long prompts first: prefill is the first role asked for more; long outputs later:
    only decode grows then (prefill's second half has no scale-up)."""
    decisions = replay(live_config(), ticks, follow_recording=True)
    ups = [
        (i, r)
        for i, d in enumerate(decisions)
        for r in ROLES
        if d.role(r).desired > d.role(r).current
    ]
    assert ups[0][1] == "prefill"
    half = len(decisions) // 2
    assert {r for i, r in ups if i >= half} == {"decode"}, ups
    for i, role in ups:
        reason = decisions[i].role(role).reason
        assert "x target" in reason and "suffice" not in reason, reason


def direction_changes(series: list[int]) -> int:
    steps = [b - a for a, b in pairwise(series) if b != a]
    return sum(1 for a, b in pairwise(steps) if (a > 0) != (b > 0))


def test_a_longer_scale_down_window_keeps_the_engines_through_the_ramp(ticks):
    """Open loop on the same metrics: with a 60 s scale-down window nothing is removed
    while the load comes and goes within it, so each role only grows until the window
    has passed after the last busy tick."""
    decisions = replay(live_config(down_window_s=60.0), ticks, follow_recording=False)
    for role in ROLES:
        series = [d.role(role).desired for d in decisions]
        peak = series.index(max(series))
        assert max(series) >= 2, (role, series)
        assert all(b >= a for a, b in pairwise(series[: peak + 1]))
        assert direction_changes(series) <= 1, (role, series)
        drops = [i for i, (a, b) in enumerate(pairwise(series)) if b < a]
        times = [decisions[i + 1].at - decisions[peak].at for i in drops]
        assert all(t >= 60.0 for t in times), (role, times)


def test_tighter_bounds_and_steps_hold_on_real_metrics(ticks):
    decisions = replay(
        live_config(decode=RoleBounds(1, 2), max_step_up=1, up_cooldown_s=5.0),
        ticks,
        follow_recording=False,
    )
    decode = [d.decode.desired for d in decisions]
    assert max(decode) == 2 and all(b - a <= 1 for a, b in pairwise(decode)), decode
    ups = [d.at for d in decisions if d.decode.desired > d.decode.current]
    assert all(b - a >= 5.0 for a, b in pairwise(ups)), ups


def test_a_recording_keeps_only_the_planners_series_and_reads_while_still_written(tmp_path):
    from pdpool.planner.metrics import EndpointMetrics, Snapshot, parse_text
    from pdpool.planner.trace import TraceWriter

    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m"} 3\n'
        "# TYPE process_cpu_seconds counter\n"
        "process_cpu_seconds_total 9\n"
    )
    snap = Snapshot(2.5, (EndpointMetrics("decode", "d0", parse_text(text)),))
    path = tmp_path / "t.jsonl.gz"
    writer = TraceWriter(str(path))
    writer.write(snap, {"prefill": 1, "decode": 2})
    got = list(read_trace(path))  # the writer is still open: a run killed mid-way reads too
    writer.close()
    assert len(got) == 1 and got[0].replicas == {"prefill": 1, "decode": 2}
    assert got[0].snapshot.at == 2.5
    assert got[0].snapshot.endpoints[0].samples == {
        "vllm:num_requests_running": {(("model_name", "m"),): 3.0}
    }
