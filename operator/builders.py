"""Pure builders: (pool identity, PoolSpec) -> the manifests of every child object.

Nothing here talks to Kubernetes; the handlers server-side apply what these return.
Every child carries a controller owner reference to the pool (children.py). This module
orders the children and builds the small ones (the router ConfigMap, the Services, the
disruption budgets); the Deployments are in workloads.py, the NetworkPolicies in
network_policies.py.

The pool's KV-signing Secret is not among `build_children`: its value is random, so it is
created once when absent (`kv_secret` in pool_secrets.py, value passed in) and never
re-applied.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from . import commands
from .autoscaling import hpa, scaled_object
from .children import Manifest, PoolRef, child_metadata
from .gie_adapters import (
    adapter_children,
    retired_rewrite,
    retired_rewrites_config,
    rewrites_config_map,
)
from .inference_pool import inference_pool_children
from .names import (
    DECODE,
    ENGINE_PORT,
    GATEWAY,
    LABEL_METRICS,
    PREFILL,
    SIDECAR_PORT,
    child_name,
    router_config_name,
    selector_labels,
    service_host,
)
from .network_policies import network_policies
from .spec import PoolSpec
from .workloads import engine_deployment, gateway_deployment


def build_children(ref: PoolRef, pool: PoolSpec) -> list[Manifest]:
    """Every child of the pool, in an order that is safe to apply one by one: the
    NetworkPolicies and disruption budgets before the Deployments, so no pod of the pool
    ever runs unprotected."""
    config = router_config_map(ref, pool)
    config_hash = data_hash(config["data"])
    rewrites = rewrites_config_map(ref, pool.loras)  # before the routers that mount it
    return [
        config,
        *([rewrites] if rewrites is not None else []),
        prefill_service(ref, pool),
        decode_service(ref, pool),
        gateway_service(ref, pool),
        *(network_policies(ref, pool) if pool.network_policy.enabled else []),
        *(disruption_budget(ref, pool, role) for role in (PREFILL, DECODE, GATEWAY)),
        engine_deployment(ref, pool, PREFILL),
        engine_deployment(ref, pool, DECODE, router_hash=config_hash),
        gateway_deployment(ref, pool, router_hash=config_hash),
        *autoscalers(ref, pool),
        *inference_pool_children(ref, pool),
    ]


def autoscalers(ref: PoolRef, pool: PoolSpec) -> list[Manifest]:
    """`autoscaling.mode: hpa` / `keda`: one HorizontalPodAutoscaler / ScaledObject per
    engine role (after the Deployments they scale). The planner mode adds no object: the
    operator scales."""
    mode = pool.autoscaling.mode if pool.autoscaling else None
    if mode == "hpa":
        return [hpa(ref, pool, PREFILL), hpa(ref, pool, DECODE)]
    if mode == "keda":
        return [scaled_object(ref, pool, PREFILL), scaled_object(ref, pool, DECODE)]
    return []


AUTOSCALER_KINDS = {
    "hpa": ("autoscaling/v2", "HorizontalPodAutoscaler"),
    "keda": ("keda.sh/v1alpha1", "ScaledObject"),
}


def retired_autoscalers(ref: PoolRef, pool: PoolSpec) -> list[Manifest]:
    """The per-role autoscaler objects the pool's mode does not render (another mode's,
    or any once autoscaling is off): deleted, so two autoscalers never fight over a role's
    replicas after the mode changes. Names only: enough to find and delete them."""
    mode = pool.autoscaling.mode if pool.autoscaling else None
    return [
        {
            "apiVersion": api_version,
            "kind": kind,
            "metadata": {"name": child_name(ref.name, role), "namespace": ref.namespace},
        }
        for other, (api_version, kind) in AUTOSCALER_KINDS.items()
        if other != mode
        for role in (PREFILL, DECODE)
    ]


def retired_children(ref: PoolRef, pool: PoolSpec) -> list[Manifest]:
    """Children an earlier spec may have rendered and this one does not: another mode's
    autoscalers, the adapters' InferenceModelRewrite once no adapter has a rollout."""
    rendered = {
        (m["kind"], m["metadata"]["name"])
        for m in [
            *adapter_children(ref, pool.inference_pool, pool.loras),
            rewrites_config_map(ref, pool.loras) or {},
        ]
        if m
    }
    stale = [
        m
        for m in (retired_rewrite(ref), retired_rewrites_config(ref))
        if (m["kind"], m["metadata"]["name"]) not in rendered
    ]
    return retired_autoscalers(ref, pool) + stale


def data_hash(data: dict[str, str]) -> str:
    """Changes whenever the router settings change, so the pods that read them roll."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


# --- ConfigMap ---------------------------------------------------------------------------


def router_config_map(ref: PoolRef, pool: PoolSpec) -> Manifest:
    router = pool.router
    data = {
        "mode": router.mode,
        "cacheHitThreshold": format(router.cache_hit_threshold, "g"),
        "kvPullThreshold": str(router.kv_pull_threshold),
        "prefillTimeoutSeconds": format(router.prefill_timeout_seconds, "g"),
        "prefillService": f"{service_host(ref.name, PREFILL, ref.namespace)}:{ENGINE_PORT}",
        "decodeService": f"{service_host(ref.name, DECODE, ref.namespace)}:{SIDECAR_PORT}",
        "engineRejects": commands.engine_rejects(pool),
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(ref, router_config_name(ref.name), "router"),
        "data": data,
    }


# --- Services ----------------------------------------------------------------------------


def _port(name: str, port: int, target: int | None = None) -> dict[str, Any]:
    return {"name": name, "port": port, "targetPort": target or port, "protocol": "TCP"}


def _service(
    ref: PoolRef,
    role: str,
    ports: list[dict[str, Any]],
    headless: bool,
    service_type: str = "ClusterIP",
) -> Manifest:
    spec: dict[str, Any] = {"selector": selector_labels(ref.name, role), "ports": ports}
    if headless:
        # Headless: DNS returns every ready pod, so routers can pick pods themselves.
        spec["clusterIP"] = "None"
    else:
        spec["type"] = service_type
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(
            ref, child_name(ref.name, role), role, **{LABEL_METRICS: "true"}
        ),
        "spec": spec,
    }


def prefill_service(ref: PoolRef, pool: PoolSpec) -> Manifest:
    return _service(
        ref,
        PREFILL,
        [_port("http", ENGINE_PORT), _port("nixl", pool.engine.kv_port)],
        headless=True,
    )


def decode_service(ref: PoolRef, pool: PoolSpec) -> Manifest:
    # The sidecar only: it strips clients' kv_transfer_params, which the engine port would
    # let them send straight to the engine. Peers reach decode engines at their pod IPs.
    return _service(ref, DECODE, [_port("http", SIDECAR_PORT)], headless=True)


def gateway_service(ref: PoolRef, pool: PoolSpec) -> Manifest:
    return _service(
        ref,
        GATEWAY,
        [_port("http", pool.gateway.port, SIDECAR_PORT)],
        headless=False,
        service_type=pool.gateway.service_type,
    )


# --- PodDisruptionBudgets ----------------------------------------------------------------


def disruption_budget(ref: PoolRef, pool: PoolSpec, role_name: str) -> Manifest:
    """One per role: voluntary evictions (node drains) take at most `maxUnavailable` pods
    of a role at a time. A count, not minAvailable, so a one-replica role can still be
    drained. Disabled: the budget stays but allows everything ("100%"), since the operator
    applies children and never deletes them. Pods that are not ready may always be evicted
    (a wedged pod must not block a drain)."""
    budget = pool.disruption_budget
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(ref, child_name(ref.name, role_name), role_name),
        "spec": {
            "maxUnavailable": budget.max_unavailable if budget.enabled else "100%",
            "selector": {"matchLabels": selector_labels(ref.name, role_name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
