"""Kubernetes NetworkPolicy ingress semantics, evaluated in Python (no CNI runs in the tests):
may this source pod open a TCP connection to this port of that pod, given these policies?

What it follows (networking.k8s.io/v1):
- a policy selects the pods of its own namespace that its podSelector matches (`{}`: all);
- it restricts their ingress when its policyTypes name Ingress (policyTypes unset: Ingress,
  plus Egress if it has egress rules); a pod that no such policy selects accepts anything;
- a selected pod accepts a connection when some ingress rule of some selecting policy admits
  it: its ports (absent or empty: every port; `endPort`: a range; a name: the target's
  container port of that name; protocol TCP unless said) and its peers (absent or empty:
  every source; a peer with podSelector only: pods of the policy's namespace; with
  namespaceSelector only: every pod of those namespaces; with both: those pods of those
  namespaces; ipBlock: addresses, for sources outside the cluster here).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str | None  # None: outside the cluster (an address, no labels)
    labels: dict = field(default_factory=dict, hash=False)
    ip: str = "203.0.113.7"
    ports: dict = field(default_factory=dict, hash=False)  # container port name -> number


def selector_matches(selector: dict | None, labels: dict) -> bool:
    """A LabelSelector; `{}` matches everything, None nothing."""
    if selector is None:
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def peer_matches(peer: dict, source: Pod, policy_ns: str, namespaces: dict) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        ip = ipaddress.ip_address(source.ip)
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(c) for c in block.get("except", [])
        )
    if source.namespace is None:
        return False  # pod and namespace selectors only ever match pods
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], namespaces[source.namespace]):
            return False
    elif source.namespace != policy_ns:
        return False
    return "podSelector" not in peer or selector_matches(peer["podSelector"], source.labels)


def port_matches(rule_port: dict, target: Pod, port: int) -> bool:
    if rule_port.get("protocol", "TCP") != "TCP":
        return False
    start = rule_port.get("port")
    if start is None:
        return True
    if isinstance(start, str):
        return target.ports.get(start) == port
    return start <= port <= rule_port.get("endPort", start)


def _restricts_ingress(policy: dict) -> bool:
    spec = policy["spec"]
    types = spec.get("policyTypes")
    return "Ingress" in types if types else True


def allowed(policies: list[dict], source: Pod, target: Pod, port: int, namespaces: dict) -> bool:
    """Whether `source` may connect to `target`:`port` (TCP)."""
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == target.namespace
        and _restricts_ingress(p)
        and selector_matches(p["spec"]["podSelector"], target.labels)
    ]
    if not selecting:
        return True
    for policy in selecting:
        ns = policy["metadata"]["namespace"]
        for rule in policy["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports and not any(port_matches(p, target, port) for p in ports):
                continue
            peers = rule.get("from")
            if not peers or any(peer_matches(p, source, ns, namespaces) for p in peers):
                return True
    return False
