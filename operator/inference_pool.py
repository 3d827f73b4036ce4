"""Pure builders for `spec.inferencePool`: the Gateway API Inference Extension objects.

- an InferencePool (inference.networking.k8s.io/v1) named after the pool: its endpoints
  are the decode pods' sidecars, its endpoint picker the pool's EPP Service;
- `pdpool epp` (an Envoy ext_proc server running the same routing as the pool's gateway):
  a Deployment, a Service and a ServiceAccount that mounts no API token (it finds the
  decode sidecars through the decode Service's DNS, like the gateway: no RBAC at all);
- its NetworkPolicy: ext_proc from the Gateway's data plane that `gatewayFrom` names (the
  decode sidecars open to the same peers in network_policies.py: the data plane connects
  to them directly);
- with `parentRefs`, an HTTPRoute from those Gateways to the InferencePool.
"""

from __future__ import annotations

from typing import Any

from . import commands
from .children import Manifest, PoolRef, child_metadata
from .gie_adapters import adapter_children, rewrites_mounts, rewrites_volumes
from .inference_pool_spec import InferencePoolSpec
from .names import (
    TENANTS_FILE,
    DECODE,
    EPP,
    SIDECAR_PORT,
    child_name,
    selector_labels,
    service_host,
)
from .pod_security import TMP_MOUNT, container_security_context, empty_dir
from .pods import deployment, pod_scheduling_fields, pod_security_fields, topology_spread
from .pool_secrets import (
    pool_tls_mounts,
    pool_tls_volumes,
    tenants_mounts,
    tenants_volumes,
)
from .spec import PoolSpec

GIE_GROUP = "inference.networking.k8s.io"
GIE_VERSION = "v1"
# GIE's conventional EPP ports: ext_proc gRPC, gRPC health, Prometheus metrics.
EPP_GRPC_PORT = 9002
EPP_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090


def inference_pool_children(ref: PoolRef, pool: PoolSpec) -> list[Manifest]:
    """The objects of `spec.inferencePool` (none when it is off)."""
    gie = pool.inference_pool
    if gie is None:
        return []
    children = [
        epp_service_account(ref),
        epp_service(ref),
        *([epp_network_policy(ref, pool, gie)] if pool.network_policy.enabled else []),
        epp_deployment(ref, pool, gie),
        inference_pool(ref, gie),
    ]
    if gie.parent_refs:
        children.append(http_route(ref, gie))
    return children + adapter_children(ref, gie, pool.loras)


def epp_name(pool: str) -> str:
    return child_name(pool, EPP)


def inference_pool(ref: PoolRef, gie: InferencePoolSpec) -> Manifest:
    return {
        "apiVersion": f"{GIE_GROUP}/{GIE_VERSION}",
        "kind": "InferencePool",
        "metadata": child_metadata(ref, ref.name, "inference-pool"),
        "spec": {
            "selector": {"matchLabels": selector_labels(ref.name, DECODE)},
            "targetPorts": [{"number": SIDECAR_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": epp_name(ref.name),
                "port": {"number": EPP_GRPC_PORT},
                "failureMode": gie.failure_mode,
            },
        },
    }


def http_route(ref: PoolRef, gie: InferencePoolSpec) -> Manifest:
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": child_metadata(ref, ref.name, "inference-pool"),
        "spec": {
            "parentRefs": [dict(p) for p in gie.parent_refs],
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                    "backendRefs": [
                        {"group": GIE_GROUP, "kind": "InferencePool", "name": ref.name}
                    ],
                    # Generations stream for minutes: no gateway-imposed request timeout.
                    "timeouts": {"request": "0s"},
                }
            ],
        },
    }


def epp_service_account(ref: PoolRef) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": child_metadata(ref, epp_name(ref.name), EPP),
        "automountServiceAccountToken": False,
    }


def epp_service(ref: PoolRef) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(ref, epp_name(ref.name), EPP),
        "spec": {
            "selector": selector_labels(ref.name, EPP),
            "ports": [
                {
                    "name": "grpc-ext-proc",
                    "port": EPP_GRPC_PORT,
                    "targetPort": "grpc",
                    "protocol": "TCP",
                    "appProtocol": "http2",
                },
                {
                    "name": "http-metrics",
                    "port": EPP_METRICS_PORT,
                    "targetPort": "metrics",
                    "protocol": "TCP",
                },
            ],
        },
    }


def epp_deployment(ref: PoolRef, pool: PoolSpec, gie: InferencePoolSpec) -> Manifest:
    decode = f"{service_host(ref.name, DECODE, ref.namespace)}:{SIDECAR_PORT}"
    container: dict[str, Any] = {
        "name": EPP,
        "image": pool.router.image,
        "imagePullPolicy": pool.engine.image_pull_policy,
        "command": commands.epp_args(
            pool,
            decode,
            (EPP_GRPC_PORT, EPP_HEALTH_PORT, EPP_METRICS_PORT),
            TENANTS_FILE if pool.gateway.tenants_secret else None,
        ),
        "ports": [
            {"name": "grpc", "containerPort": EPP_GRPC_PORT, "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"},
        ],
        "resources": dict(gie.epp_resources),
        "securityContext": container_security_context(pool),
        "volumeMounts": [
            {"name": "tmp", "mountPath": TMP_MOUNT},
            *pool_tls_mounts(pool),
            *tenants_mounts(pool),
            *rewrites_mounts(pool.loras),
        ],
        # gRPC health: SERVING once a decode sidecar is ready (the gateway's /ready rule).
        "readinessProbe": {
            "grpc": {"port": EPP_HEALTH_PORT},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "grpc": {"port": EPP_HEALTH_PORT},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
    }
    pod_spec = {
        "serviceAccountName": epp_name(ref.name),
        "automountServiceAccountToken": False,
        "containers": [container],
        "volumes": [
            empty_dir("tmp"),
            *pool_tls_volumes(pool),
            *tenants_volumes(pool),
            *rewrites_volumes(ref, pool.loras),
        ],
        **pod_security_fields(pool),
        **pod_scheduling_fields(pool, None),
        "topologySpreadConstraints": topology_spread(ref, EPP, None),
    }
    return deployment(ref, EPP, gie.epp_replicas, pod_spec, {}, pool.rollout)


def epp_network_policy(ref: PoolRef, pool: PoolSpec, gie: InferencePoolSpec) -> Manifest:
    """ext_proc from the Gateway's data plane (`gatewayFrom`: the operator cannot know
    where it runs, envoy-gateway-system, istio-system, ...) and from nobody when none is
    named; metrics from the pool's metrics scrapers."""
    rules: list[dict[str, Any]] = []
    if gie.gateway_from:
        rules.append(
            {
                "from": [dict(p) for p in gie.gateway_from],
                "ports": [{"protocol": "TCP", "port": EPP_GRPC_PORT}],
            }
        )
    metrics = [dict(p) for p in pool.network_policy.metrics_from]
    if metrics:
        rules.append({"from": metrics, "ports": [{"protocol": "TCP", "port": EPP_METRICS_PORT}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(ref, epp_name(ref.name), EPP),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(ref.name, EPP)},
            "policyTypes": ["Ingress"],
            "ingress": rules,
        },
    }


def inference_pool_parents(pool_object: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The InferencePool's status.parents, as the pool's status shows them: each Gateway
    that accepted (or refused) it, with its conditions' type, status, reason and message."""
    parents = ((pool_object or {}).get("status") or {}).get("parents") or []
    shown = []
    for parent in parents:
        if not isinstance(parent, dict):
            continue
        conditions = [
            {k: c[k] for k in ("type", "status", "reason", "message") if k in c}
            for c in parent.get("conditions") or []
            if isinstance(c, dict)
        ]
        shown.append({"parentRef": parent.get("parentRef") or {}, "conditions": conditions})
    return shown
