"""`spec.inferencePool`: the pool as a Gateway API Inference Extension InferencePool, with
`pdpool epp` as its endpoint picker, so an existing Gateway (Envoy Gateway, kgateway, Istio,
GKE, ...) routes to the pool's decode sidecars.

    inferencePool:
      enabled: true
      failureMode: FailClose          # FailOpen: the Gateway routes alone when the EPP is down
      parentRefs:                     # optional: an HTTPRoute from these Gateways to the pool
        - {name: inference-gateway, namespace: gateways, sectionName: http}
      gatewayFrom:                    # NetworkPolicy peers: the Gateway's data plane (Envoy)
        - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: envoy-gateway-system}}
          podSelector: {matchLabels: {gateway.envoyproxy.io/owning-gateway-name: inference}}
      epp: {replicas: 1, resources: {...}}

Pure: no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .spec import DEFAULT_GATEWAY_RESOURCES, SpecError

FAILURE_MODES = ("FailOpen", "FailClose")
WHERE = "spec.inferencePool"
# What a NetworkPolicyPeer may hold.
PEER_FIELDS = ("podSelector", "namespaceSelector", "ipBlock")
# What a parentRef may name (Gateway API's ParentReference).
PARENT_REF_FIELDS = ("group", "kind", "namespace", "name", "sectionName", "port")


@dataclass(frozen=True)
class InferencePoolSpec:
    failure_mode: str = "FailClose"
    parent_refs: tuple[dict[str, Any], ...] = ()
    epp_replicas: int = 1
    epp_resources: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_GATEWAY_RESOURCES))
    # The Gateway's data plane (NetworkPolicy peers): the only sources, besides the pool's
    # own gateway and EPP, that reach the decode sidecars and the EPP's ext_proc port.
    # None: nobody else (the sidecars check no API key: they are no door for anyone).
    gateway_from: tuple[dict[str, Any], ...] | None = None


def parse_inference_pool(spec: dict[str, Any]) -> InferencePoolSpec | None:
    """None unless `spec.inferencePool.enabled` is true; SpecError naming the bad field."""
    section = spec.get("inferencePool")
    if section is None:
        return None
    if not isinstance(section, dict):
        raise SpecError(f"{WHERE} must be an object")
    enabled = section.get("enabled", False)
    if not isinstance(enabled, bool):
        raise SpecError(f"{WHERE}.enabled must be true or false")
    if not enabled:
        return None
    failure_mode = section.get("failureMode", "FailClose")
    if failure_mode not in FAILURE_MODES:
        raise SpecError(f"{WHERE}.failureMode must be one of {', '.join(FAILURE_MODES)}")
    epp = section.get("epp") or {}
    if not isinstance(epp, dict):
        raise SpecError(f"{WHERE}.epp must be an object")
    replicas = epp.get("replicas", 1)
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise SpecError(f"{WHERE}.epp.replicas must be an integer >= 1")
    resources = epp.get("resources", DEFAULT_GATEWAY_RESOURCES)
    if not isinstance(resources, dict):
        raise SpecError(f"{WHERE}.epp.resources must be an object")
    return InferencePoolSpec(
        failure_mode=failure_mode,
        parent_refs=_parent_refs(section.get("parentRefs")),
        epp_replicas=replicas,
        epp_resources=dict(resources),
        gateway_from=_peers(section.get("gatewayFrom")),
    )


def _peers(peers: Any) -> tuple[dict[str, Any], ...] | None:
    if peers is None:
        return None
    where = f"{WHERE}.gatewayFrom"
    if not isinstance(peers, list) or not peers:
        raise SpecError(f"{where} must be a non-empty list of NetworkPolicy peers")
    for i, peer in enumerate(peers):
        if not isinstance(peer, dict) or not peer or set(peer) - set(PEER_FIELDS):
            raise SpecError(f"{where}[{i}] must be a NetworkPolicy peer ({', '.join(PEER_FIELDS)})")
    return tuple(dict(p) for p in peers)


def _parent_refs(refs: Any) -> tuple[dict[str, Any], ...]:
    if refs is None:
        return ()
    if not isinstance(refs, list):
        raise SpecError(f"{WHERE}.parentRefs must be a list")
    out = []
    for i, ref in enumerate(refs):
        where = f"{WHERE}.parentRefs[{i}]"
        if not isinstance(ref, dict) or not isinstance(ref.get("name"), str) or not ref["name"]:
            raise SpecError(f"{where} needs a name (the Gateway's)")
        unknown = sorted(set(ref) - set(PARENT_REF_FIELDS))
        if unknown:
            raise SpecError(f"{where} has unknown fields: {', '.join(unknown)}")
        out.append(dict(ref))
    return tuple(out)
