"""Names, labels and API coordinates shared by the builders, the handlers and the chart.

Children are named after the pool and their role, so re-applying them (after an operator
restart, or twice in a row) always lands on the same objects: no duplicates.
"""

from __future__ import annotations

GROUP = "pdpool.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "PDInferencePool"
PLURAL = "pdinferencepools"

FIELD_MANAGER = "pdpool-operator"
LABEL_POOL = "pdpool.io/pool"
LABEL_ROLE = "pdpool.io/role"
LABEL_METRICS = "pdpool.io/metrics"
ANNOTATION_ROUTER_HASH = "pdpool.io/router-config-hash"

PREFILL, DECODE, GATEWAY = "prefill", "decode", "gateway"
ROLES = (PREFILL, DECODE, GATEWAY)
EPP = "epp"  # spec.inferencePool's endpoint picker (not a role of the pool's own spec)

ENGINE_PORT = 8000
SIDECAR_PORT = 8080
# Metrics on ports of their own (--metrics-port: GET /metrics alone), so the NetworkPolicies
# admit scrapers there and never to a serving port. A decode pod's engine and sidecar share
# one network namespace: distinct ports. Stock vLLM serves /metrics on 8000 only.
ENGINE_METRICS_PORT = 9090
SIDECAR_METRICS_PORT = 9091
GATEWAY_METRICS_PORT = 9090


def metrics_port_name(tls: bool, sidecar: bool = False) -> str:
    """Container port names the chart's PodMonitor scrapes (the scheme follows the name;
    at most 15 characters, unique within a pod)."""
    return ("sc-" if sidecar else "") + ("metrics-tls" if tls else "metrics")


MODELS_MOUNT = "/models"
# The pool's KV-signing secret, mounted read-only in every pdpool engine container.
KV_SECRET_KEY = "kv-secret"
KV_SECRET_DIR = "/etc/pdpool/kv-secret"
KV_SECRET_FILE = f"{KV_SECRET_DIR}/{KV_SECRET_KEY}"
# The gateway's API keys (spec.gateway.apiKeysSecret), mounted read-only in the gateway.
API_KEYS_KEY = "api-keys"
API_KEYS_DIR = "/etc/pdpool/api-keys"
API_KEYS_FILE = f"{API_KEYS_DIR}/{API_KEYS_KEY}"
# The gateway's tenants file (spec.gateway.tenantsSecret: flow control), mounted read-only.
TENANTS_KEY = "tenants.yaml"
TENANTS_DIR = "/etc/pdpool/tenants"
TENANTS_FILE = f"{TENANTS_DIR}/{TENANTS_KEY}"
# The gateway's serving certificate (spec.gateway.tlsSecret, a kubernetes.io/tls Secret).
TLS_DIR = "/etc/pdpool/tls"
# The pool's internal certificate (spec.tls.secretName: tls.crt, tls.key, ca.crt).
POOL_TLS_DIR = "/etc/pdpool/pool-tls"


def child_name(pool: str, role: str) -> str:
    """Deployment and Service name of one role (`prefill`, `decode`, `gateway`)."""
    return f"{pool}-{role}"


def router_config_name(pool: str) -> str:
    return f"{pool}-router"


def kv_secret_name(pool: str) -> str:
    """The Secret the operator creates when the spec names none (never rotated by it)."""
    return f"{pool}-kv-secret"


def service_host(pool: str, role: str, namespace: str) -> str:
    # `<svc>.<ns>.svc` resolves through the pod's DNS search path on any cluster domain.
    return f"{child_name(pool, role)}.{namespace}.svc"


def gateway_endpoint(pool: str, namespace: str, port: int) -> str:
    return f"http://{service_host(pool, GATEWAY, namespace)}:{port}"


def selector_labels(pool: str, role: str) -> dict[str, str]:
    """The immutable Deployment selector: keep it to these two labels."""
    return {LABEL_POOL: pool, LABEL_ROLE: role}


def labels(pool: str, role: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "pdpool",
        "app.kubernetes.io/instance": pool,
        "app.kubernetes.io/component": role,
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
        **selector_labels(pool, role),
    }
