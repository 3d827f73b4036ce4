"""The planner's settings and its raw recommendation per role, before stabilization.

Each role gets a pressure: how far its worst signal is from its target (1.0 = on target).
  prefill: TTFT p90 of the prefill engines (and of the sidecars' prefill legs) / ttft target;
           queued prompts per engine / waiting target.
  decode:  ITL p90 / itl target; KV usage / kv target; queued requests per engine / waiting
           target; TTFT p90 / ttft target (its queue delays every first token, also after
           a prefill leg), from the engines and from the sidecars (which count the queue).
Latency grows with load, so the replicas that bring a pressure back to 1 are estimated as
proportional (HPA's rule): ceil(n * pressure); with a queue, at least the engines that would
run the queued requests too at the concurrency the engines run now (queue_fit). A scale-up
remembers the load per engine (running + queued requests) that needed it; a later
scale-down must leave the load at most down_headroom of that per engine (without it, the
latency headroom a scale-up just bought would remove the engine again at the same load).
Scale-down is asked only when every signal is well under target (pressure <=
down_headroom), one engine at a time unless the proportional estimate asks for fewer, and an
idle role (nothing served, queued or running in the window) asks for its floor."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from .signals import RoleSignals, Signals

ROLES = ("prefill", "decode")


class PlannerConfigError(ValueError):
    """Settings the planner cannot honour (the message says which and why)."""


@dataclass(frozen=True)
class RoleBounds:
    min: int
    max: int


@dataclass(frozen=True)
class PlannerConfig:
    prefill: RoleBounds
    decode: RoleBounds
    ttft_seconds: float = 1.0
    itl_seconds: float = 0.05
    # A pressure within 1 +- tolerance is on target (no change): HPA's 10 % band.
    tolerance: float = 0.1
    down_headroom: float = 0.7  # scale down only while every signal is <= 70 % of target
    kv_usage_target: float = 0.85
    waiting_per_engine: float = 4.0  # queued requests per engine that count as on target
    # Stabilization windows (HPA's behaviour): a scale-up must be asked for over the whole
    # up window (its lowest ask is taken), a scale-down over the whole down window (its
    # highest ask): down is slower, so a dip between bursts does not drop engines.
    up_window_s: float = 0.0
    down_window_s: float = 120.0
    max_step_up: int = 2  # replicas added per decision
    max_step_down: int = 1  # replicas removed per decision
    up_cooldown_s: float = 30.0  # after a scale-up, the next one waits (new engines warm up)
    down_cooldown_s: float = 60.0  # after any change, a scale-down waits this long
    scale_to_zero: bool = False  # prefill only: the sidecars prefill on decode meanwhile

    def targets(self) -> tuple[float, float, float, float]:
        """What a pressure is measured against: a saturation seen under other targets
        says nothing about these."""
        return (self.ttft_seconds, self.itl_seconds, self.kv_usage_target, self.waiting_per_engine)

    def validate(self) -> "PlannerConfig":
        for role in ROLES:
            b = self.bounds(role)
            if b.min < 0 or b.max < b.min:
                raise PlannerConfigError(
                    f"{role}: need 0 <= min <= max, got min {b.min} max {b.max}"
                )
        if self.decode.min < 1:
            raise PlannerConfigError(
                "decode min must be >= 1: a pool without decode engines serves nothing "
                "(scale-to-zero applies to prefill only)"
            )
        if self.prefill.min == 0 and self.prefill.max > 0 and not self.scale_to_zero:
            raise PlannerConfigError(
                "prefill min 0 with max > 0 is scale-to-zero: turn scaleToZero on, or set min >= 1"
            )
        if self.ttft_seconds <= 0 or self.itl_seconds <= 0:
            raise PlannerConfigError("targets ttftSeconds and itlSeconds must be > 0")
        if self.max_step_up < 1 or self.max_step_down < 1:
            raise PlannerConfigError("maximum steps must be >= 1")
        if min(self.up_window_s, self.down_window_s, self.up_cooldown_s, self.down_cooldown_s) < 0:
            raise PlannerConfigError("windows and cool-downs must be >= 0 seconds")
        if not 0 < self.down_headroom < 1 or self.tolerance < 0:
            raise PlannerConfigError("downHeadroom must be in (0, 1) and tolerance >= 0")
        return self

    def bounds(self, role: str) -> RoleBounds:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True)
class Recommendation:
    replicas: int
    reason: str
    pressure: Optional[float] = None
    drivers: dict[str, float] = field(default_factory=dict)  # signal -> its pressure


def _ratio(value: Optional[float], target: float) -> Optional[float]:
    return None if value is None else value / target


def role_pressures(role: str, s: RoleSignals, cfg: PlannerConfig) -> dict[str, float]:
    """Each signal's distance from target, 1.0 = on target; signals without data left out."""
    engines = max(s.engines, 1)
    found: dict[str, Optional[float]] = {
        "waiting": s.waiting / (engines * cfg.waiting_per_engine),
    }
    # A decode engine's first token waits for its queue (and, after a prefill leg, for the
    # KV pull): the client's TTFT includes it, whichever role computed the prompt.
    found["ttft"] = _ratio(s.ttft_p90, cfg.ttft_seconds)
    if role == "decode":
        found["itl"] = _ratio(s.itl_p90, cfg.itl_seconds)
        found["kv_usage"] = s.kv_usage / cfg.kv_usage_target
    return {k: v for k, v in found.items() if v is not None}


def _floor(role: str, cfg: PlannerConfig) -> int:
    b = cfg.bounds(role)
    return b.min if cfg.scale_to_zero else min(max(b.min, 1), b.max)


def demand(s: RoleSignals) -> float:
    """The role's load in requests: those running and those queued."""
    return s.running + s.waiting


def stalled(s: RoleSignals) -> bool:
    """Requests run or wait, yet no token came out in the window: a step longer than the
    window (an engine starved of CPU, a huge prompt), which is no evidence of headroom."""
    return demand(s) > 0 and s.ttft_p90 is None and s.itl_p90 is None


def queue_fit(s: RoleSignals) -> int:
    """Engines that would also run the queued requests, at the concurrency the role's engines
    run now (0 without a queue: a queue forms only once the engines are full)."""
    if s.waiting <= 0 or s.running <= 0 or s.engines == 0:
        return 0
    return math.ceil(demand(s) / (s.running / s.engines))


def _fitting(
    want: int, load: float, saturated_per_engine: Optional[float], cfg: PlannerConfig
) -> int:
    """Engines that carry `load` within the headroom, given the load per engine that last
    needed a scale-up (None: never saturated, nothing to hold on to)."""
    if not saturated_per_engine:
        return want
    return max(want, math.ceil(load / (cfg.down_headroom * saturated_per_engine)))


def recommend(
    role: str,
    replicas: int,
    sig: Signals,
    cfg: PlannerConfig,
    saturated_per_engine: Optional[float] = None,
) -> Recommendation:
    """Replicas this role needs for the window's signals (not yet stabilized or clamped to a
    step; clamped to the role's bounds). `saturated_per_engine`: the load per engine when
    the role last had to scale up; a scale-down must leave the load well under it."""
    bounds = cfg.bounds(role)
    s = sig.prefill if role == "prefill" else sig.decode
    if role == "prefill" and replicas == 0:
        if sig.pool.prefill_unserved > 0 or sig.pool.threshold_rejections > 0:
            return Recommendation(min(1, bounds.max), "prompts wait for a prefill engine")
        return Recommendation(_floor(role, cfg), "no prefill demand")
    if s.idle:
        return Recommendation(_floor(role, cfg), "idle: nothing served, queued or running")
    drivers = role_pressures(role, s, cfg)
    if role == "prefill" and sig.pool.prefill_leg_p90 is not None:
        drivers["prefill_leg"] = sig.pool.prefill_leg_p90 / cfg.ttft_seconds
    if role == "decode" and sig.pool.decode_ttft_p90 is not None:
        drivers["decode_ttft"] = sig.pool.decode_ttft_p90 / cfg.ttft_seconds
    worst = max(drivers, key=lambda k: drivers[k])
    pressure = drivers[worst]
    n = max(replicas, 1)
    if pressure > 1 + cfg.tolerance:
        # Engines still starting served nothing in the window: the proportional estimate
        # scales those that did (HPA's rule for unready pods), and never asks for fewer.
        measured = s.engines or n
        want = max(n, math.ceil(measured * pressure), queue_fit(s))
        reason = f"{worst} at {pressure:.2f}x target"
    elif n > 1 and pressure <= cfg.down_headroom and stalled(s):
        want = replicas
        reason = (
            f"{worst} at {pressure:.2f}x target, but no token came out while "
            f"{demand(s):g} requests ran or waited"
        )
    elif n > 1 and pressure <= cfg.down_headroom:
        # Latency is not proportional to load when light (it nears the bare compute time),
        # so one engine fewer, or fewer still when even a proportional estimate agrees.
        want = max(min(n - 1, math.ceil(n * pressure / cfg.down_headroom)), 1)
        want = min(_fitting(want, demand(s), saturated_per_engine, cfg), n)
        reason = f"{worst} at {pressure:.2f}x target: {want} engines suffice"
        if want == n:
            reason = f"{worst} at {pressure:.2f}x target, but the load would not fit {n - 1}"
    else:
        want = replicas
        reason = f"on target ({worst} at {pressure:.2f}x)"
    clamped = min(max(want, _floor(role, cfg)), bounds.max)
    return Recommendation(clamped, reason, pressure, drivers)
