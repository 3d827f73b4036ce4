"""The planner applied to one cluster: for each autoscaled pool (`mode: planner`), every
`behavior.intervalSeconds` it lists the pool's pods, scrapes their metrics, asks the
planner (pdpool/planner) and applies the replicas it decides to each role's Deployment;
the pool's status shows the last decision, its inputs and its reason, and each change is
an Event on the pool.

I/O goes through the Cluster (kube.py) and a `scrape` function, both given at
construction: the tests pass a scrape URL template that points at metrics they control.
The planner's state (windows, cool-downs) lives in memory; an operator restart starts it
afresh, and its first scrape decides nothing."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from pdpool.planner.metrics import Snapshot
from pdpool.planner.scrape import Target, scrape
from pdpool.planner.stabilize import Decision, PlannerState, initial_state, plan, with_replicas

from .autoscaling import (
    AUTOSCALER_FIELD_MANAGER,
    bounded,
    decision_status,
    replicas_manifest,
    scrape_targets,
)
from .children import PoolRef
from .names import API_VERSION, DECODE, KIND, LABEL_POOL, PREFILL
from .spec import PoolSpec
from .status import now_iso

log = logging.getLogger("pdpool.operator.autoscaler")
DEFAULT_METRICS_URL = "{scheme}://{ip}:{port}/metrics"
Scrape = Callable[[Sequence[Target]], Snapshot]


class ClusterCalls(Protocol):
    def list_deployments(self, namespace: str, label_selector: str) -> list[dict[str, Any]]: ...
    def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]: ...
    def apply_as(self, manifest: dict[str, Any], field_manager: str) -> dict[str, Any]: ...
    def patch_pool_status(self, namespace: str, name: str, status: dict[str, Any]) -> None: ...
    def create_event(self, namespace: str, event: dict[str, Any]) -> None: ...


def scrape_over_http(targets: Sequence[Target]) -> Snapshot:
    snapshot, failed = scrape(targets, timeout_s=2.0, insecure=True)
    if failed:
        log.info("metrics not scraped (starting or leaving): %s", ", ".join(failed))
    return snapshot


@dataclass
class _PoolLoop:
    uid: str
    state: PlannerState
    due: float = 0.0
    last_scale: str | None = None


@dataclass
class Autoscaler:
    cluster: ClusterCalls
    url_template: str = DEFAULT_METRICS_URL
    scrape: Scrape = scrape_over_http
    clock: Callable[[], float] = time.monotonic
    _loops: dict[tuple[str, str], _PoolLoop] = field(default_factory=dict)

    def forget(self, namespace: str, name: str) -> None:
        self._loops.pop((namespace, name), None)

    def replicas(self, ref: PoolRef) -> dict[str, int | None]:
        """Each engine role's Deployment replicas (None: no Deployment yet)."""
        found: dict[str, int | None] = {PREFILL: None, DECODE: None}
        for d in self.cluster.list_deployments(ref.namespace, f"{LABEL_POOL}={ref.name}"):
            role = (d["metadata"].get("labels") or {}).get("pdpool.io/role")
            if role in found:
                found[role] = int((d.get("spec") or {}).get("replicas", 1))
        return found

    def hold_bounds(self, ref: PoolRef, pool: PoolSpec, only_existing: bool) -> None:
        """Puts each role's replicas within its bounds under the autoscaler's field manager
        (before the pool's own apply drops the field, so it never resets to 1)."""
        scaling = pool.autoscaling
        if scaling is None:
            return
        for role, current in self.replicas(ref).items():
            if current is None and only_existing:
                continue
            want = bounded(scaling, role, current)
            if want != current or only_existing:
                self.cluster.apply_as(replicas_manifest(ref, role, want), AUTOSCALER_FIELD_MANAGER)

    def tick(self, ref: PoolRef, pool: PoolSpec) -> Decision | None:
        """One look at the pool if its interval has passed; the decision, else None."""
        scaling = pool.autoscaling
        key = (ref.namespace, ref.name)
        if scaling is None or scaling.mode != "planner":
            self.forget(*key)
            return None
        now = self.clock()
        loop = self._loops.get(key)
        if loop is not None and (loop.uid != ref.uid or now < loop.due):
            if loop.uid == ref.uid:
                return None
            loop = None  # a new pool of the same name
        current = self.replicas(ref)
        if current[PREFILL] is None or current[DECODE] is None:
            return None  # the pool's own apply has not made them yet
        prefill, decode = int(current[PREFILL] or 0), int(current[DECODE] or 0)
        if loop is None:
            loop = self._loops[key] = _PoolLoop(ref.uid, initial_state(prefill, decode))
        loop.due = now + scaling.interval_s
        state = with_replicas(loop.state, prefill, decode)  # the world wins
        pods = self.cluster.list_pods(ref.namespace, f"{LABEL_POOL}={ref.name}")
        snapshot = self.scrape(scrape_targets(pods, self.url_template, bool(pool.tls_secret)))
        snapshot = Snapshot(now, snapshot.endpoints)
        loop.state, decision = plan(scaling.planner, state, snapshot)
        when = now_iso()
        if decision.changed:
            self._apply(ref, decision)
            loop.last_scale = when
        status = decision_status(decision, when, loop.last_scale)
        self.cluster.patch_pool_status(ref.namespace, ref.name, {"autoscaling": status})
        return decision

    def _apply(self, ref: PoolRef, decision: Decision) -> None:
        for role in (PREFILL, DECODE):
            d = decision.role(role)
            if not d.changed:
                continue
            self.cluster.apply_as(replicas_manifest(ref, role, d.desired), AUTOSCALER_FIELD_MANAGER)
            message = f"{role} {d.current} -> {d.desired}: {d.reason}"
            log.info("pool %s/%s: %s", ref.namespace, ref.name, message)
            self.cluster.create_event(ref.namespace, scale_event(ref, message))


def scale_event(ref: PoolRef, message: str) -> dict[str, Any]:
    when = now_iso()
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{ref.name}-scaled-", "namespace": ref.namespace},
        "involvedObject": {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": ref.name,
            "namespace": ref.namespace,
            "uid": ref.uid,
        },
        "reason": "Scaled",
        "message": message[:1024],
        "type": "Normal",
        "source": {"component": "pdpool-operator"},
        "firstTimestamp": when,
        "lastTimestamp": when,
        "count": 1,
    }
