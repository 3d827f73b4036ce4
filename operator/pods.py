"""What every pool pod has whatever its role: probes, the Deployment around it, its
security and scheduling fields and how its replicas spread.

The engine and gateway pods (workloads.py) are built from these, so that a change to how
the pool's pods are probed, secured or placed is made once.
"""

from __future__ import annotations

from typing import Any

from .children import Manifest, PoolRef, child_metadata
from .names import child_name, labels, selector_labels
from .pod_security import pod_security_context
from .spec import PoolSpec, RoleSpec, RolloutSpec

# Probe design (docs/kubernetes.md, "Probes and readiness"):
# - readiness decides traffic: engines' /ready (fails while the loop is wedged with work),
#   the sidecar's /ready (its engine's), the gateway's /ready (any decode sidecar ready);
# - liveness decides restarts and looks at the process alone: the engine's /health (its
#   loop thread is alive), a TCP connect for the sidecar and the gateway, whose /health
#   follows their upstreams (a decode engine loading a model must not get its sidecar
#   restarted, nor all-decode-down get the gateway restarted);
# - timeouts are generous (the default 1 s fails under load: a busy event loop answers
#   late, not never), and liveness needs a minute of failures before a restart.
PROBE_TIMEOUT_S = 5
LIVENESS_TIMEOUT_S = 10
STARTUP_PERIOD_S = 10


def probe(
    path: str,
    port: str,
    period: int,
    failures: int,
    timeout: int = PROBE_TIMEOUT_S,
    scheme: str | None = None,
) -> dict[str, Any]:
    get: dict[str, Any] = {"path": path, "port": port}
    if scheme:
        get["scheme"] = scheme  # the kubelet does not verify the certificate
    return {
        "httpGet": get,
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def tcp_probe(port: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "tcpSocket": {"port": port},
        "periodSeconds": period,
        "timeoutSeconds": PROBE_TIMEOUT_S,
        "failureThreshold": failures,
    }


def http_probes(
    port: str, ready_path: str = "/ready", startup_timeout_s: int = 1800, scheme: str | None = None
) -> dict[str, Any]:
    return {
        # Loading a model can take many minutes: the startup probe holds liveness back
        # (engine.startupTimeoutSeconds), then readiness and liveness take over.
        "startupProbe": probe(
            "/health",
            port,
            STARTUP_PERIOD_S,
            max(1, -(-startup_timeout_s // STARTUP_PERIOD_S)),
            scheme=scheme,
        ),
        # /ready also fails while the engine loop is wedged with work (/health: liveness).
        "readinessProbe": probe(ready_path, port, 5, 3, scheme=scheme),
        "livenessProbe": probe("/health", port, 10, 6, LIVENESS_TIMEOUT_S, scheme=scheme),
    }


def downward_env() -> list[dict[str, Any]]:
    return [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]


def topology_spread(ref: PoolRef, role_name: str, role: RoleSpec | None) -> list[dict[str, Any]]:
    """Spread a role's pods over hosts, then zones (best effort: never blocks scheduling).
    The spec's own list replaces these; its entries without a labelSelector get the role's."""
    selector = {"matchLabels": selector_labels(ref.name, role_name)}
    if role is not None and role.topology_spread is not None:
        return [{"labelSelector": selector, **c} for c in role.topology_spread]
    return [
        {
            "maxSkew": 1,
            "topologyKey": key,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": selector,
        }
        for key in ("kubernetes.io/hostname", "topology.kubernetes.io/zone")
    ]


def pod_security_fields(pool: PoolSpec) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "securityContext": pod_security_context(pool),
        # No pool process talks to the Kubernetes API: no token in the pods.
        "automountServiceAccountToken": pool.security.automount_service_account_token,
    }
    if pool.security.service_account_name:
        spec["serviceAccountName"] = pool.security.service_account_name
    return spec


def pod_scheduling_fields(pool: PoolSpec, role: RoleSpec | None) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if role is not None and role.node_selector:
        spec["nodeSelector"] = dict(role.node_selector)
    if role is not None and role.tolerations:
        spec["tolerations"] = list(role.tolerations)
    if pool.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in pool.image_pull_secrets]
    return spec


def deployment(
    ref: PoolRef,
    role_name: str,
    replicas: int | None,
    pod_spec: dict[str, Any],
    annotations: dict[str, str],
    rollout: RolloutSpec,
) -> Manifest:
    """replicas None: left out, for an autoscaled role (the planner or an HPA owns it)."""
    template_meta: dict[str, Any] = {"labels": labels(ref.name, role_name)}
    if annotations:
        template_meta["annotations"] = annotations
    spec: dict[str, Any] = {} if replicas is None else {"replicas": replicas}
    spec["selector"] = {"matchLabels": selector_labels(ref.name, role_name)}
    spec["strategy"] = {
        "type": "RollingUpdate",
        "rollingUpdate": {
            "maxSurge": rollout.max_surge,
            "maxUnavailable": rollout.max_unavailable,
        },
    }
    spec["template"] = {"metadata": template_meta, "spec": pod_spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(ref, child_name(ref.name, role_name), role_name),
        "spec": spec,
    }
