"""Pure status computation: children's observed state -> the pool's `.status`.

Conditions follow the Kubernetes convention (type, status, reason, message,
lastTransitionTime, observedGeneration); `lastTransitionTime` only moves when a
condition's status flips, so watchers see real transitions, not every refresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from .names import DECODE, GATEWAY, PREFILL, child_name, gateway_endpoint

ROLE_CONDITIONS = {PREFILL: "PrefillReady", DECODE: "DecodeReady", GATEWAY: "GatewayReady"}
CONDITION_TYPES = (*ROLE_CONDITIONS.values(), "RolledOut", "Ready")
# Ready=False reasons that come from the spec itself: they stay until the spec changes.
SPEC_FAILURE_REASONS = ("InvalidSpec", "ApplyFailed")


@dataclass(frozen=True)
class RoleState:
    """What one child Deployment reports."""

    desired: int
    ready: int
    updated: int
    rolled_out: bool  # the deployment controller has seen its latest spec
    total: int = 0  # pods of every revision (status.replicas): old ones still terminating
    available: int = 0

    @classmethod
    def from_deployment(cls, deployment: dict[str, Any]) -> "RoleState":
        spec, status = deployment.get("spec") or {}, deployment.get("status") or {}
        generation = (deployment.get("metadata") or {}).get("generation", 0)
        return cls(
            desired=int(spec.get("replicas", 1)),
            ready=int(status.get("readyReplicas") or 0),
            updated=int(status.get("updatedReplicas") or 0),
            rolled_out=int(status.get("observedGeneration") or 0) >= generation,
            total=int(status.get("replicas") or 0),
            available=int(status.get("availableReplicas") or 0),
        )


def now_iso() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def role_condition(pool: str, role: str, state: RoleState | None) -> tuple[bool, str, str]:
    """(ready, reason, message) for one role."""
    deployment = child_name(pool, role)
    if state is None:
        return False, "NotCreated", f"Deployment {deployment} does not exist yet"
    if state.desired == 0:
        return True, "ScaledToZero", f"Deployment {deployment} has 0 replicas"
    progress = f"{state.ready}/{state.desired} replicas ready"
    if not state.rolled_out:
        return False, "RolloutPending", f"Deployment {deployment}: new spec not yet observed"
    if state.ready >= state.desired and state.updated >= state.desired:
        return True, "ReplicasReady", f"Deployment {deployment}: {progress}"
    return False, "ReplicasNotReady", f"Deployment {deployment}: {progress}"


def rollout_progress(deployment: str, state: RoleState | None) -> tuple[bool, str]:
    """(done, message) for one role, in `kubectl rollout status`'s words and order."""
    if state is None:
        return False, f"Deployment {deployment} does not exist yet"
    wait = f'Waiting for deployment "{deployment}" rollout to finish: '
    if not state.rolled_out:
        return False, f'Waiting for deployment "{deployment}" spec update to be observed'
    if state.updated < state.desired:
        return False, f"{wait}{state.updated} out of {state.desired} new replicas have been updated"
    if state.total > state.updated:
        return False, f"{wait}{state.total - state.updated} old replicas are pending termination"
    if state.available < state.updated:
        return False, f"{wait}{state.available} of {state.updated} updated replicas are available"
    return True, f'deployment "{deployment}" successfully rolled out'


def rollout_condition(
    pool: str, roles: dict[str, RoleState | None], generation: int
) -> dict[str, Any]:
    """RolledOut: every role runs the pool's latest spec and nothing older is left; while
    not, the message is the first unfinished role's progress."""
    for role in ROLE_CONDITIONS:
        done, message = rollout_progress(child_name(pool, role), roles.get(role))
        if not done:
            return _condition("RolledOut", False, "RollingUpdate", message, generation)
    return _condition("RolledOut", True, "RolloutComplete", "every role is rolled out", generation)


def compute_status(
    *,
    pool: str,
    namespace: str,
    generation: int,
    gateway_port: int,
    roles: dict[str, RoleState | None],
    spec_error: tuple[str, str] | None,
    old_conditions: list[dict[str, Any]] | None,
    now: str,
) -> dict[str, Any]:
    """The full `.status` (without observedGeneration, which only the reconciler sets).

    `spec_error` is (reason, message) when the spec cannot be honoured.
    """
    fresh: list[dict[str, Any]] = []
    ready_roles: list[str] = []
    for role, condition_type in ROLE_CONDITIONS.items():
        ok, reason, message = role_condition(pool, role, roles.get(role))
        fresh.append(_condition(condition_type, ok, reason, message, generation))
        if ok:
            ready_roles.append(role)
    not_ready = [r for r in ROLE_CONDITIONS if r not in ready_roles]
    if spec_error is not None:
        ready = _condition("Ready", False, spec_error[0], spec_error[1], generation)
        phase = "Failed"
    elif not not_ready:
        ready = _condition("Ready", True, "PoolReady", "all roles are ready", generation)
        phase = "Ready"
    else:
        ready = _condition(
            "Ready", False, "RolesNotReady", "waiting for " + ", ".join(not_ready), generation
        )
        phase = "Progressing" if any(roles.get(r) for r in ROLE_CONDITIONS) else "Pending"
    fresh.append(rollout_condition(pool, roles, generation))
    fresh.append(ready)

    status: dict[str, Any] = {
        "phase": phase,
        "conditions": merge_conditions(old_conditions or [], fresh, now),
    }
    for role in (PREFILL, DECODE, GATEWAY):
        state = roles.get(role)
        desired, ready_n = (state.desired, state.ready) if state else (0, 0)
        status[role] = {
            "replicas": desired,
            "readyReplicas": ready_n,
            "updatedReplicas": state.updated if state else 0,
        }
        status[f"{role}Ready"] = f"{ready_n}/{desired}"
    status[GATEWAY]["endpoint"] = gateway_endpoint(pool, namespace, gateway_port)
    return status


def _condition(kind: str, ok: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
    return {
        "type": kind,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def merge_conditions(
    old: list[dict[str, Any]], fresh: list[dict[str, Any]], now: str
) -> list[dict[str, Any]]:
    """Fresh conditions, keeping the old transition time where the status did not flip."""
    previous = {c.get("type"): c for c in old}
    merged = []
    for condition in fresh:
        before = previous.get(condition["type"])
        since = now
        if before is not None and before.get("status") == condition["status"]:
            since = before.get("lastTransitionTime", now)
        merged.append({**condition, "lastTransitionTime": since})
    return merged


def carried_spec_error(status: dict[str, Any] | None, generation: int) -> tuple[str, str] | None:
    """A spec failure reported for the current generation still holds (spec unchanged)."""
    for condition in (status or {}).get("conditions") or []:
        if (
            condition.get("type") == "Ready"
            and condition.get("status") == "False"
            and condition.get("reason") in SPEC_FAILURE_REASONS
            and condition.get("observedGeneration") == generation
        ):
            return condition["reason"], condition.get("message", "")
    return None


def status_changed(current: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Whether patching `new` would change anything (ignores fields `new` does not set)."""
    current = current or {}
    return any(current.get(key) != value for key, value in new.items())
