"""Pure builders of what autoscaling adds to a pool: the replicas the planner applies, the
HorizontalPodAutoscalers of `mode: hpa` and the KEDA ScaledObjects of `mode: keda`, the
metrics targets of a pool's pods and the status of the last decision. (A leaving pod's
drain, on scale-down as on a rolling update, is drain.py's.)"""

from __future__ import annotations

import math
from typing import Any

from pdpool.planner.scrape import Target
from pdpool.planner.stabilize import Decision

from .autoscaling_spec import AutoscalingSpec
from .children import Manifest, PoolRef, child_metadata
from .names import DECODE, ENGINE_PORT, PREFILL, SIDECAR_PORT, child_name
from .spec import PoolSpec

AUTOSCALER_FIELD_MANAGER = "pdpool-autoscaler"


def replicas_manifest(ref: PoolRef, role_name: str, replicas: int) -> Manifest:
    """What the planner server-side applies (field manager pdpool-autoscaler): the
    Deployment's replicas alone. The pool's own apply leaves replicas out, so the two
    never fight over the field."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": child_name(ref.name, role_name), "namespace": ref.namespace},
        "spec": {"replicas": replicas},
    }


def bounded(scaling: AutoscalingSpec, role_name: str, current: int | None) -> int:
    """A Deployment's replicas brought within the role's bounds (its min when new)."""
    b = scaling.bounds(role_name)
    return b.min if current is None else min(max(current, b.min), b.max)


def _hpa_behavior(scaling: AutoscalingSpec) -> dict[str, Any]:
    cfg = scaling.planner
    return {
        "scaleUp": {
            "stabilizationWindowSeconds": math.ceil(cfg.up_window_s),
            "policies": [
                {
                    "type": "Pods",
                    "value": cfg.max_step_up,
                    "periodSeconds": max(math.ceil(cfg.up_cooldown_s), 1),
                }
            ],
        },
        "scaleDown": {
            "stabilizationWindowSeconds": math.ceil(cfg.down_window_s),
            "policies": [
                {
                    "type": "Pods",
                    "value": cfg.max_step_down,
                    "periodSeconds": max(math.ceil(cfg.down_cooldown_s), 1),
                }
            ],
        },
    }


def _scale_target(ref: PoolRef, role_name: str) -> dict[str, str]:
    """The role's Deployment, as HPAs and ScaledObjects name what they scale."""
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": child_name(ref.name, role_name)}


def hpa(ref: PoolRef, pool: PoolSpec, role_name: str) -> Manifest:
    """`mode: hpa`: an autoscaling/v2 HorizontalPodAutoscaler per role, on a per-pod
    metric of the engines (Pods type, served by a metrics adapter), with the pool's
    bounds and behavior. The planner stays off for the pool."""
    assert pool.autoscaling is not None
    scaling = pool.autoscaling
    metric = scaling.metric(role_name)
    b = scaling.bounds(role_name)
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": child_metadata(ref, child_name(ref.name, role_name), role_name),
        "spec": {
            "scaleTargetRef": _scale_target(ref, role_name),
            "minReplicas": max(b.min, 1),
            "maxReplicas": max(b.max, 1),
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": metric.name},
                        "target": {"type": "AverageValue", "averageValue": metric.average_value},
                    },
                }
            ],
            "behavior": _hpa_behavior(scaling),
        },
    }


QUANTITY_SUFFIX = {
    "n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
    "E": 1e18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip


def quantity_value(quantity: str) -> float:
    """A Kubernetes quantity ("850m", "4", "1e3", "2Ki") as a number: KEDA's thresholds are
    plain decimals."""
    for suffix in sorted(QUANTITY_SUFFIX, key=len, reverse=True):
        if quantity.endswith(suffix):
            return float(quantity[: -len(suffix)]) * QUANTITY_SUFFIX[suffix]
    return float(quantity)


def keda_query(ref: PoolRef, role_name: str, metric: str) -> str:
    """The role metric summed over the role's pods, as Prometheus labels pods scraped
    through a PodMonitor/ServiceMonitor (namespace, pod): KEDA's AverageValue divides it by
    the replicas."""
    pods = child_name(ref.name, role_name) + "-[a-z0-9]+-[a-z0-9]+"
    return f'sum({metric}{{namespace="{ref.namespace}",pod=~"{pods}"}})'


def scaled_object(ref: PoolRef, pool: PoolSpec, role_name: str) -> Manifest:
    """`mode: keda`: a KEDA ScaledObject per role, a Prometheus trigger on the role's
    metric (threshold its averageValue per pod), the pool's bounds (prefill may reach 0
    with scaleToZero: KEDA activates it again) and the HPA behavior of mode hpa."""
    assert pool.autoscaling is not None and pool.autoscaling.keda is not None
    scaling, keda = pool.autoscaling, pool.autoscaling.keda
    metric = scaling.metric(role_name)
    query = keda.prefill_query if role_name == PREFILL else keda.decode_query
    b = scaling.bounds(role_name)
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": child_metadata(ref, child_name(ref.name, role_name), role_name),
        "spec": {
            "scaleTargetRef": _scale_target(ref, role_name),
            "pollingInterval": max(math.ceil(scaling.interval_s), 1),
            "minReplicaCount": b.min if scaling.planner.scale_to_zero else max(b.min, 1),
            "maxReplicaCount": max(b.max, 1),
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _hpa_behavior(scaling)}},
            "triggers": [
                {
                    "type": "prometheus",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": keda.prometheus_address,
                        "query": query or keda_query(ref, role_name, metric.name),
                        "threshold": f"{quantity_value(metric.average_value):g}",
                    },
                }
            ],
        },
    }


def scrape_targets(
    pods: list[dict[str, Any]], url_template: str, tls: bool = False
) -> list[Target]:
    """The metrics endpoints of a pool's running pods: every engine, and every decode
    pod's sidecar. `url_template` has {scheme}, {ip}, {port}, {pod}, {namespace}."""
    scheme = "https" if tls else "http"
    targets = []
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        role = (meta.get("labels") or {}).get("pdpool.io/role")
        ip, name = status.get("podIP"), meta.get("name", "")
        if role not in (PREFILL, DECODE) or status.get("phase") != "Running" or not ip:
            continue
        if meta.get("deletionTimestamp"):
            continue  # draining: its load is leaving with it
        ports = [(role, _metrics_port(pod, "engine", ENGINE_PORT))]
        if role == DECODE:
            ports.append(("sidecar", _metrics_port(pod, "sidecar", SIDECAR_PORT)))
        for kind, port in ports:
            url = url_template.format(
                scheme=scheme, ip=ip, port=port, pod=name, namespace=meta.get("namespace", "")
            )
            targets.append(Target(kind, f"{name}:{port}", url))
    return targets


def _metrics_port(pod: dict[str, Any], container: str, serving: int) -> int:
    """The container's metrics port (named metrics*, sc-metrics*: where the NetworkPolicy
    admits scrapers); pods rendered before it had one serve /metrics on `serving`."""
    for c in (pod.get("spec") or {}).get("containers") or ():
        if c.get("name") == container:
            for port in c.get("ports") or ():
                if "metrics" in port.get("name", ""):
                    return int(port["containerPort"])
    return serving


def decision_status(decision: Decision, when: str, last_scale: str | None) -> dict[str, Any]:
    """`status.autoscaling`: the last decision, its inputs and its reasons."""
    out: dict[str, Any] = {
        "mode": "planner",
        "lastDecisionTime": when,
        "prefill": decision.prefill.as_dict(),
        "decode": decision.decode.as_dict(),
        "reason": decision.summary(),
        "inputs": decision.inputs.as_dict(),
    }
    if last_scale:
        out["lastScaleTime"] = last_scale
    return out
