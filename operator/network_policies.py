"""The pool's NetworkPolicies: which pods may reach which ports of the pool's pods."""

from __future__ import annotations

from typing import Any

from .children import Manifest, PoolRef, child_metadata
from .commands import engine_metrics_port
from .names import (
    DECODE,
    ENGINE_PORT,
    EPP,
    GATEWAY,
    GATEWAY_METRICS_PORT,
    LABEL_POOL,
    LABEL_ROLE,
    PREFILL,
    SIDECAR_METRICS_PORT,
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
      prefill; the gateway never needs an engine);
    - decode sidecars (8080): from the pool's gateway pods; with `inferencePool`, also from
      the pool's EPP (it tokenizes and checks readiness through them) and the Gateway's data
      plane named in `inferencePool.gatewayFrom` (nobody else: a sidecar checks no API key,
      tenant or limit, so it must not be a door);
    - the gateway (8080): from `networkPolicy.clientsFrom`, default anyone;
    - the metrics ports (engines 9090, decode sidecars 9091, the gateway 9090: GET /metrics
      and nothing else is served there) from the scrapers (`networkPolicy.metricsFrom`),
      never a serving port, so a scraper cannot generate; stock vLLM engines serve /metrics
      on 8000 only, which is then their metrics port;
    - with `router.kvEvents`: the event ports of decode pods from the gateway (and the EPP),
      of prefill pods from decode pods (their sidecars subscribe).
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
        engine_rules.append({"from": metrics, "ports": [_np_port(engine_metrics_port(pool))]})
    events = [_np_port(p) for p in pool.router.kv_events.ports()]
    return [
        _network_policy(ref, "engines", "engine", engines, engine_rules),
        _network_policy(
            ref,
            "decode-sidecar",
            DECODE,
            {"matchLabels": selector_labels(ref.name, DECODE)},
            _decode_rules(ref, pool, metrics, events),
        ),
        _network_policy(
            ref,
            "gateway",
            GATEWAY,
            {"matchLabels": selector_labels(ref.name, GATEWAY)},
            _gateway_rules(pool, metrics),
        ),
        *([_prefill_events_policy(ref, events)] if events else []),
    ]


def _gateway_rules(pool: PoolSpec, metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    clients = pool.network_policy.clients_from
    serving = {"ports": [_np_port(SIDECAR_PORT)]}
    rules: list[dict[str, Any]] = []
    if clients is None:  # anyone
        rules.append(serving)
    elif clients:  # an empty `from` would mean anyone too: [] is nobody
        rules.append({"from": [dict(p) for p in clients], **serving})
    if metrics:
        rules.append({"from": metrics, "ports": [_np_port(GATEWAY_METRICS_PORT)]})
    return rules


def _decode_rules(
    ref: PoolRef, pool: PoolSpec, metrics: list[dict[str, Any]], events: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Who reaches a decode pod's sidecar and its engine's event ports: the pool's routers
    (its gateway; its EPP with `inferencePool`), the Gateway's data plane that the
    InferencePool names; the scrapers, on the sidecar's metrics port only."""
    routers = [{"podSelector": {"matchLabels": selector_labels(ref.name, GATEWAY)}}]
    data_plane: list[dict[str, Any]] = []
    if pool.inference_pool is not None:
        routers.append({"podSelector": {"matchLabels": selector_labels(ref.name, EPP)}})
        data_plane = [dict(p) for p in pool.inference_pool.gateway_from or ()]
    rules = [{"from": [*routers, *data_plane], "ports": [_np_port(SIDECAR_PORT)]}]
    if metrics:
        rules.append({"from": metrics, "ports": [_np_port(SIDECAR_METRICS_PORT)]})
    if events:
        rules.append({"from": routers, "ports": events})
    return rules


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
