"""Recommendations -> decisions: stabilization windows, maximum step, cool-downs.

The planner's state is a value (PlannerState); plan() returns the next one with the
decision, so a controller only keeps the last state between ticks and a test replays a
trace through the same function."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

from .metrics import Snapshot
from .policy import ROLES, PlannerConfig, Recommendation, demand, recommend
from .signals import Signals, signals


@dataclass(frozen=True)
class RoleState:
    replicas: int
    # (time, recommended replicas) within the longest window, oldest first
    history: tuple[tuple[float, int], ...] = ()
    last_up: Optional[float] = None
    last_change: Optional[float] = None
    since: Optional[float] = None  # the first tick this state has seen
    saturated_per_engine: Optional[float] = None  # load per engine at the last scale-up
    # The targets that scale-up was measured against (PlannerConfig.targets): once they
    # change (a pool's spec edited), the load that needed it is forgotten.
    saturated_targets: Optional[tuple[float, ...]] = None


@dataclass(frozen=True)
class PlannerState:
    prefill: RoleState
    decode: RoleState
    last_snapshot: Optional[Snapshot] = None

    def role(self, role: str) -> RoleState:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True)
class RoleDecision:
    role: str
    current: int
    desired: int
    recommended: int
    reason: str

    @property
    def changed(self) -> bool:
        return self.desired != self.current

    def as_dict(self) -> dict[str, Any]:
        return {
            "current": self.current,
            "desired": self.desired,
            "recommended": self.recommended,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Decision:
    at: float
    prefill: RoleDecision
    decode: RoleDecision
    inputs: Signals = field(repr=False)

    @property
    def changed(self) -> bool:
        return self.prefill.changed or self.decode.changed

    def role(self, role: str) -> RoleDecision:
        return self.prefill if role == "prefill" else self.decode

    def summary(self) -> str:
        parts = []
        for d in (self.prefill, self.decode):
            arrow = f"{d.current}->{d.desired}" if d.changed else f"{d.current}"
            parts.append(f"{d.role} {arrow} ({d.reason})")
        return "; ".join(parts)


def initial_state(prefill: int, decode: int) -> PlannerState:
    return PlannerState(RoleState(prefill), RoleState(decode))


def _down_asks(cfg: PlannerConfig, st: RoleState, now: float) -> tuple[list[int], float]:
    """The recommendations a scale-down must agree with, and for how long they must have
    been asked: the whole down window at first (or after a scale-up), then, while the
    pool keeps shrinking, the down cool-down since the last step down."""
    after_down = st.last_change is not None and st.last_change != st.last_up
    if after_down and st.last_change is not None:
        asks = [r for t, r in st.history if t > st.last_change]
        return asks, (now - st.last_change) - cfg.down_cooldown_s
    since = st.since if st.since is not None else now
    if st.last_change is not None:
        since = max(since, st.last_change)
        if now - st.last_change < cfg.down_cooldown_s:
            return [st.replicas], 0.0
    asks = [r for t, r in st.history if now - t <= cfg.down_window_s]
    return asks, (now - since) - cfg.down_window_s


def _stabilized(
    cfg: PlannerConfig, st: RoleState, now: float, rec: Recommendation
) -> tuple[int, str]:
    """The replicas the windows allow (before the step limit) and why."""
    n = st.replicas
    ups = [r for t, r in st.history if now - t <= cfg.up_window_s] or [rec.replicas]
    if min(ups) > n:
        if st.last_up is not None and now - st.last_up < cfg.up_cooldown_s:
            return n, f"{rec.reason}; scale-up cooling down"
        return min(ups), rec.reason
    if rec.replicas >= n:
        return n, rec.reason
    asks, spare = _down_asks(cfg, st, now)
    if not asks or max(asks) >= n or spare < 0:
        return n, f"{rec.reason}; waiting out the scale-down window"
    return max(asks), rec.reason


def _step(cfg: PlannerConfig, n: int, want: int) -> int:
    return max(min(want, n + cfg.max_step_up), n - cfg.max_step_down)


def plan_role(
    cfg: PlannerConfig, role: str, st: RoleState, now: float, sig: Signals
) -> tuple[RoleState, RoleDecision]:
    targets = cfg.targets()
    held = st.saturated_per_engine if st.saturated_targets == targets else None
    rec = recommend(role, st.replicas, sig, cfg, held)
    keep = max(cfg.up_window_s, cfg.down_window_s)
    history = (*(h for h in st.history if now - h[0] <= keep), (now, rec.replicas))
    since = st.since if st.since is not None else now
    st = replace(st, history=history, since=since)
    want, reason = _stabilized(cfg, st, now, rec)
    desired = _step(cfg, st.replicas, want)
    decision = RoleDecision(role, st.replicas, desired, rec.replicas, reason)
    if desired == st.replicas:
        return st, decision
    up = desired > st.replicas
    saturated = held
    if up and st.replicas > 0:
        load = demand(sig.prefill if role == "prefill" else sig.decode) / st.replicas
        saturated = load or saturated  # the latest saturation (none measured: keep the last)
    return (
        replace(
            st,
            replicas=desired,
            last_change=now,
            last_up=now if up else st.last_up,
            saturated_per_engine=saturated or None,
            saturated_targets=targets if saturated else None,
        ),
        decision,
    )


def _hold(role: str, st: RoleState) -> RoleDecision:
    return RoleDecision(role, st.replicas, st.replicas, st.replicas, "first scrape: no window yet")


def plan(
    cfg: PlannerConfig, state: PlannerState, snapshot: Snapshot
) -> tuple[PlannerState, Decision]:
    """One tick: the new snapshot against the last one -> the next state and the decision."""
    sig = signals(state.last_snapshot, snapshot)
    if state.last_snapshot is None:  # counters since each process started: no window yet
        return replace(state, last_snapshot=snapshot), Decision(
            snapshot.at,
            _hold("prefill", state.prefill),
            _hold("decode", state.decode),
            sig,
        )
    roles = {}
    for role in ROLES:
        roles[role] = plan_role(cfg, role, state.role(role), snapshot.at, sig)
    new_state = PlannerState(roles["prefill"][0], roles["decode"][0], snapshot)
    return new_state, Decision(snapshot.at, roles["prefill"][1], roles["decode"][1], sig)


def with_replicas(state: PlannerState, prefill: int, decode: int) -> PlannerState:
    """The state after the world disagreed (someone scaled by hand, an apply failed)."""
    return replace(
        state,
        prefill=replace(state.prefill, replicas=prefill),
        decode=replace(state.decode, replicas=decode),
    )
