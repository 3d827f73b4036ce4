"""`pdpool up --autoscale`: the planner (pdpool/planner) adds and removes local engines.

Every interval it scrapes the serving engines' and sidecars' /metrics, asks the planner,
and applies the decision:
- up: start the engines (a decode engine with its sidecar) at once; each is listed in the
  discovery files the gateway and the sidecars follow (file: discovery) when it is ready.
  A starting engine counts as a replica, so the next decisions do not ask for it again;
- down: unlist the newest engine (the routers stop choosing it within half a second),
  hold a moment for requests already on their way, wait until it has nothing in flight
  (sidecar requests, engine running and queued requests, KV leases a peer has yet to
  read), then SIGTERM it: no request fails. Drains run in threads; the supervisor loop
  reaps them.
Launches and drains run in threads (a decision never waits for a process); the supervisor
loop reaps them. The --state-file is rewritten on each change: the engines running now, the
scale events, and the last decision with its inputs."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pdpool.planner.metrics import parse_text, total
from pdpool.planner.policy import PlannerConfig
from pdpool.planner.scrape import Target, fetch_metrics, scrape
from pdpool.planner.stabilize import Decision, initial_state, plan, with_replicas
from pdpool.planner.trace import TraceWriter

from .topology import Child, Topology

ENGINE_ROLES = ("prefill", "decode")
DRAIN_HOLD_S = 1.5  # > the discovery files' refresh (0.5 s) + a request in transit


def _say(message: str) -> None:
    print(f"pdpool up: {message}", file=sys.stderr, flush=True)


def busy(url: str, ca_file: Optional[str]) -> float:
    """Requests in flight, queued or holding KV leases at one /metrics (0 when it does
    not answer: a process that is gone has nothing left to finish)."""
    try:
        samples = parse_text(fetch_metrics(url + "/metrics", 2.0, ca_file))
    except (urllib.error.URLError, OSError, ValueError):
        return 0.0
    return (
        total(samples, "vllm:num_requests_running")
        + total(samples, "vllm:num_requests_waiting")
        + total(samples, "pdpool_sidecar_in_flight")
        + total(samples, "pdpool_kv_connector", stat="leases_active")
    )


def ready(url: str, ca_file: Optional[str]) -> bool:
    import ssl

    context = ssl.create_default_context(cafile=ca_file) if ca_file else None
    for path in ("/ready", "/health"):
        try:
            with urllib.request.urlopen(url + path, timeout=2, context=context) as r:
                return bool(r.status == 200)
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                return False
        except (urllib.error.URLError, OSError):
            return False
    return False


@dataclass
class Pending:
    """Engine processes waiting in a thread: to be ready (a launch) or idle (a drain)."""

    role: str
    children: list[Child]
    reason: str
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = True
    cancelled: bool = False  # a launch a later scale-down no longer wants
    # When it began (monotonic): for a drain, when its engine was unlisted.
    started_at: float = field(default_factory=time.monotonic)


@dataclass
class LocalAutoscaler:
    topology: Topology
    config: PlannerConfig
    interval_s: float = 2.0
    state_file: Optional[str] = None
    ready_timeout_s: float = 300.0
    drain_timeout_s: float = 600.0
    say: Callable[[str], None] = _say
    clock: Callable[[], float] = time.monotonic
    events: list[dict[str, Any]] = field(default_factory=list)
    last: Optional[Decision] = None
    trace: Optional[TraceWriter] = None  # records every scrape and the replicas counted

    def __post_init__(self) -> None:
        self.state = initial_state(len(self._serving("prefill")), len(self._serving("decode")))
        self.due = 0.0
        self.launches: list[Pending] = []
        self.drains: list[Pending] = []

    def _serving(self, role: str) -> list[Child]:
        return [c for c in self.topology.by_role(role) if c.state == "serving"]

    def _replicas(self, role: str) -> int:
        """Serving engines and those starting: a launch already answers the load it was for."""
        starting = [p for p in self.launches if p.role == role and not p.cancelled]
        return len(self._serving(role)) + len(starting)

    def targets(self) -> list[Target]:
        return [
            Target(c.role, c.name, c.url + "/metrics")
            for role in (*ENGINE_ROLES, "sidecar")
            for c in self._serving(role)
        ]

    def tick(self) -> Optional[Decision]:
        """Reaps finished launches and drains; every interval, one decision applied."""
        self.reap()
        now = self.clock()
        if now < self.due:
            return None
        self.due = now + self.interval_s
        snapshot, _ = scrape(self.targets(), ca_file=self.topology.ca_file, at=now)
        counts = [self._replicas(r) for r in ENGINE_ROLES]
        if self.trace is not None:
            self.trace.write(snapshot, dict(zip(ENGINE_ROLES, counts, strict=True)))
        self.state, decision = plan(self.config, with_replicas(self.state, *counts), snapshot)
        self.last = decision
        for role in ENGINE_ROLES:
            d = decision.role(role)
            if d.desired > d.current:
                self._scale_up(role, d.desired - d.current, d.reason)
            elif d.desired < d.current:
                self._scale_down(role, d.current - d.desired, d.reason)
        return decision

    # ------------------------------------------------------------------ up
    def _scale_up(self, role: str, count: int, reason: str) -> None:
        for _ in range(count):
            launch = Pending(role, self.topology.add_engine(role), reason)
            threading.Thread(target=self._wait_ready, args=(launch,), daemon=True).start()
            self.launches.append(launch)
        self.write_state()

    def _wait_ready(self, launch: Pending) -> None:
        deadline = self.clock() + self.ready_timeout_s
        pending = list(launch.children)
        while pending and self.clock() < deadline and launch.ok and not launch.cancelled:
            for child in list(pending):
                if child.proc is not None and child.proc.poll() is not None:
                    launch.ok = False
                elif ready(child.url, self.topology.ca_file):
                    pending.remove(child)
            time.sleep(0.2)
        launch.ok = launch.ok and not pending
        launch.done.set()

    # ------------------------------------------------------------------ down
    def _scale_down(self, role: str, count: int, reason: str) -> None:
        for launch in reversed([p for p in self.launches if p.role == role and not p.cancelled]):
            if count == 0:
                return
            launch.cancelled, count = True, count - 1  # a start not finished goes first
            self._record("cancelled", role, launch.children[0].name, reason)
        if count == 0:
            return
        serving = sorted(self._serving(role), key=lambda c: c.index)
        for engine in serving[len(serving) - count :]:
            leaving = [engine, *self._sidecars_of(engine)]
            self.topology.retire(leaving)  # unlisted: routers stop choosing it
            drain = Pending(role, leaving, reason)
            threading.Thread(target=self._drain, args=(drain,), daemon=True).start()
            self.drains.append(drain)
            self._record("down", role, engine.name, reason)

    def _sidecars_of(self, engine: Child) -> list[Child]:
        return [c for c in self.topology.by_role("sidecar") if engine.url in c.argv]

    def _drain(self, drain: Pending) -> None:
        """Waits until nothing is in flight on the leaving processes (twice in a row)."""
        time.sleep(DRAIN_HOLD_S)
        deadline = self.clock() + self.drain_timeout_s
        quiet = 0
        while quiet < 2 and self.clock() < deadline:
            load = sum(busy(c.url, self.topology.ca_file) for c in drain.children)
            quiet = quiet + 1 if load == 0 else 0
            time.sleep(0.5)
        drain.done.set()

    def reap(self) -> None:
        """Lists the engines that became ready; stops those drained (SIGTERM: their servers
        end with nothing left) and those that failed to start."""
        for launch in [p for p in self.launches if p.done.is_set()]:
            self.launches.remove(launch)
            if launch.ok and not launch.cancelled:
                self.topology.mark_serving(launch.children)
                self._record("up", launch.role, launch.children[0].name, launch.reason)
                continue
            if not launch.cancelled:
                self.say(f"a new {launch.role} engine did not become ready; stopped it")
            self.topology.retire(launch.children)
            self.topology.remove(launch.children, grace_s=5.0)
            self.write_state()
        for drain in [d for d in self.drains if d.done.is_set()]:
            self.topology.remove(drain.children)
            self.drains.remove(drain)
            self.write_state()

    # ------------------------------------------------------------------ state
    def _record(self, direction: str, role: str, name: str, reason: str) -> None:
        event = {"time": time.time(), "direction": direction, "role": role, "engine": name}
        event["reason"] = reason
        self.events.append(event)
        self.say(f"scaled {direction} {role} ({name}): {reason}")
        self.write_state()

    def describe(self) -> dict[str, Any]:
        out = self.topology.describe()
        out["autoscaling"] = {
            "prefill": {
                "min": self.config.prefill.min,
                "max": self.config.prefill.max,
                "serving": len(self._serving("prefill")),
            },
            "decode": {
                "min": self.config.decode.min,
                "max": self.config.decode.max,
                "serving": len(self._serving("decode")),
            },
            "starting": [c.name for p in self.launches for c in p.children],
            "last_decision": self.last.summary() if self.last else None,
            "last_inputs": self.last.inputs.as_dict() if self.last else None,
            "events": self.events,
        }
        return out

    def write_state(self) -> None:
        if not self.state_file:
            return
        tmp = self.state_file + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(self.describe(), fh, indent=2)
        os.replace(tmp, self.state_file)
