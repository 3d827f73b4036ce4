"""The pool's NetworkPolicies: which pods may reach which ports of the pool's pods."""

from __future__ import annotations

from typing import Any

from .children import Manifest, PoolRef, child_metadata
from .names import (
    DECODE,
    ENGINE_PORT,
    GATEWAY,
    LABEL_POOL,
    LABEL_ROLE,
    PREFILL,
    SIDECAR_PORT,
    selector_labels,
)
from .spec import PoolSpec


def _np_port(port: int, end: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"protocol": "TCP", "port": port}
    if end is not None and end > port:
        out["endPort"] = end
    return out


def _network_policy(
    ref: PoolRef, name: str, role: str, selector: dict[str, Any], rules: list[dict[str, Any]]
) -> Manifest:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(ref, f"{ref.name}-{name}", role),
        "spec": {"podSelector": selector, "policyTypes": ["Ingress"], "ingress": rules},
    }


def network_policies(ref: PoolRef, pool: PoolSpec) -> list[Manifest]:
    """Ingress of the pool's pods (NetworkPolicies add up: a pod gets the union):

    - engines (prefill and decode): HTTP 8000, the NIXL handshake port and UCX's TCP port
      range, from the pool's own engine pods only (decode pods hold the sidecar that calls
      prefill; the gateway never needs an engine); 8000 also from the metrics scrapers
      (`networkPolicy.metricsFrom`), as engines serve /metrics there;
    - decode sidecars (8080): from the pool's gateway pods and the metrics scrapers, and
      with `inferencePool` from whoever may reach the gateway (the Gateway's data plane);
    - the gateway (8080): from `networkPolicy.clientsFrom`, default anyone;
    - with `router.kvEvents`: the event ports of decode pods from the gateway, of prefill
      pods from decode pods (their sidecars subscribe).
    Egress is not restricted (engines may need to fetch models, DNS, ...).
    """
    metrics = [dict(p) for p in pool.network_policy.metrics_from]
    kv_ports = [_np_port(pool.engine.kv_port)]
    ucx = pool.engine.ucx_port_range()
    if ucx is not None:
        kv_ports.append(_np_port(*ucx))
    engines = {
        "matchLabels": {LABEL_POOL: ref.name},
        "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": [PREFILL, DECODE]}],
    }
    engine_rules = [
        {"from": [{"podSelector": engines}], "ports": [_np_port(ENGINE_PORT), *kv_ports]}
    ]
    if metrics:
        engine_rules.append({"from": metrics, "ports": [_np_port(ENGINE_PORT)]})
    gateway_pods = {"podSelector": {"matchLabels": selector_labels(ref.name, GATEWAY)}}
    clients = pool.network_policy.clients_from
    gateway_rule: dict[str, Any] = {"ports": [_np_port(SIDECAR_PORT)]}
    if clients is not None:
        gateway_rule["from"] = [dict(p) for p in clients] + metrics
    decode_rules = [{"from": [gateway_pods, *metrics], "ports": [_np_port(SIDECAR_PORT)]}]
    if pool.inference_pool is not None:
        # An InferencePool's Gateway (Envoy in its own namespace) connects to the sidecars
        # directly: they are the pool's entry points then, open as the gateway is.
        decode_rules.append(dict(gateway_rule))
    events = [_np_port(p) for p in pool.router.kv_events.ports()]
    if events:
        decode_rules.append({"from": [gateway_pods], "ports": events})
    return [
        _network_policy(ref, "engines", "engine", engines, engine_rules),
        _network_policy(
            ref,
            "decode-sidecar",
            DECODE,
            {"matchLabels": selector_labels(ref.name, DECODE)},
            decode_rules,
        ),
        _network_policy(
            ref,
            "gateway",
            GATEWAY,
            {"matchLabels": selector_labels(ref.name, GATEWAY)},
            [gateway_rule],
        ),
        *([_prefill_events_policy(ref, events)] if events else []),
    ]


def _prefill_events_policy(ref: PoolRef, ports: list[dict[str, Any]]) -> Manifest:
    """Prefill engines' KV events, to the sidecars (in the decode pods) that subscribe."""
    decode_pods = {"podSelector": {"matchLabels": selector_labels(ref.name, DECODE)}}
    return _network_policy(
        ref,
        "prefill-kv-events",
        PREFILL,
        {"matchLabels": selector_labels(ref.name, PREFILL)},
        [{"from": [decode_pods], "ports": ports}],
    )
