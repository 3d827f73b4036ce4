"""Pure builders: (pool identity, PoolSpec) -> the manifests of every child object.

Nothing here talks to Kubernetes; the handlers server-side apply what these return.
Every child carries a controller owner reference to the pool (children.py). The pods'
security defaults are in pod_security.py, the NetworkPolicies in network_policies.py.

The pool's KV-signing Secret is not among `build_children`: its value is random, so it is
created once when absent (`kv_secret`, value passed in) and never re-applied.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from . import commands
from .children import Manifest, PoolRef, child_metadata
from .network_policies import network_policies
from .pod_security import (
    CACHE_MOUNT,
    TMP_MOUNT,
    cache_env,
    container_security_context,
    empty_dir,
    pod_security_context,
)
from .names import (
    API_KEYS_DIR,
    API_KEYS_FILE,
    API_KEYS_KEY,
    ANNOTATION_ROUTER_HASH,
    TLS_DIR,
    POOL_TLS_DIR,
    DECODE,
    ENGINE_PORT,
    GATEWAY,
    KV_SECRET_DIR,
    KV_SECRET_KEY,
    LABEL_METRICS,
    MODELS_MOUNT,
    PREFILL,
    SIDECAR_PORT,
    child_name,
    kv_secret_name,
    labels,
    router_config_name,
    selector_labels,
    service_host,
)
from .spec import GPU_RESOURCE, PoolSpec, RoleSpec, SecretKeyRef


def build_children(ref: PoolRef, pool: PoolSpec) -> list[Manifest]:
    """Every child of the pool, in an order that is safe to apply one by one: the
    NetworkPolicies and disruption budgets before the Deployments, so no pod of the pool
    ever runs unprotected."""
    config = router_config_map(ref, pool)
    config_hash = data_hash(config["data"])
    return [
        config,
        prefill_service(ref, pool),
        decode_service(ref, pool),
        gateway_service(ref, pool),
        *(network_policies(ref, pool) if pool.network_policy.enabled else []),
        *(disruption_budget(ref, pool, role) for role in (PREFILL, DECODE, GATEWAY)),
        engine_deployment(ref, pool, PREFILL),
        engine_deployment(ref, pool, DECODE, router_hash=config_hash),
        gateway_deployment(ref, pool, router_hash=config_hash),
    ]


def data_hash(data: dict[str, str]) -> str:
    """Changes whenever the router settings change, so the pods that read them roll."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


# --- KV-signing Secret ---------------------------------------------------------------------

# Secret files are owned by root (group fsGroup when set) and the images run as uid 65532:
# 0400 would be unreadable by the engine. The volume is mounted into the engine container
# alone, whose processes all run as one uid, so read-only for all is the tightest mode
# that works without imposing an fsGroup (which would chown the model PVC).
KV_SECRET_MODE = 0o444


def kv_secret_ref(ref: PoolRef, pool: PoolSpec) -> SecretKeyRef | None:
    """The Secret and key pdpool engines read their KV-signing key from (the user's, or the
    one the operator creates); None for vLLM engines, which do not sign."""
    if pool.engine.kind != "pdpool":
        return None
    return pool.engine.kv_secret_ref or SecretKeyRef(kv_secret_name(ref.name), KV_SECRET_KEY)


def kv_secret(ref: PoolRef, pool: PoolSpec, value: str) -> Manifest | None:
    """The Secret to create when absent (`value`: fresh random bytes, from the caller), or
    None when the engines need none or the spec names the user's own."""
    if pool.engine.kind != "pdpool" or pool.engine.kv_secret_ref is not None:
        return None
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": child_metadata(ref, kv_secret_name(ref.name), "engine"),
        "stringData": {KV_SECRET_KEY: value},
    }


def _kv_secret_volume(secret: SecretKeyRef) -> dict[str, Any]:
    return {
        "name": "kv-secret",
        "secret": {
            "secretName": secret.name,
            "defaultMode": KV_SECRET_MODE,
            "items": [{"key": secret.key, "path": KV_SECRET_KEY}],
        },
    }


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


# --- Deployments -------------------------------------------------------------------------

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


def _probe(
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


def _tcp_probe(port: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "tcpSocket": {"port": port},
        "periodSeconds": period,
        "timeoutSeconds": PROBE_TIMEOUT_S,
        "failureThreshold": failures,
    }


def _http_probes(
    port: str, ready_path: str = "/ready", startup_timeout_s: int = 1800, scheme: str | None = None
) -> dict[str, Any]:
    return {
        # Loading a model can take many minutes: the startup probe holds liveness back
        # (engine.startupTimeoutSeconds), then readiness and liveness take over.
        "startupProbe": _probe(
            "/health",
            port,
            STARTUP_PERIOD_S,
            max(1, -(-startup_timeout_s // STARTUP_PERIOD_S)),
            scheme=scheme,
        ),
        # /ready also fails while the engine loop is wedged with work (/health: liveness).
        "readinessProbe": _probe(ready_path, port, 5, 3, scheme=scheme),
        "livenessProbe": _probe("/health", port, 10, 6, LIVENESS_TIMEOUT_S, scheme=scheme),
    }


def _downward_env() -> list[dict[str, Any]]:
    return [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]


def engine_resources(role: RoleSpec) -> dict[str, Any]:
    """The role's resources with `gpus` turned into an nvidia.com/gpu limit (and request)."""
    resources: dict[str, Any] = json.loads(json.dumps(role.resources))  # deep copy (JSON)
    if role.gpus:
        for section in ("limits", "requests"):
            resources.setdefault(section, {})[GPU_RESOURCE] = role.gpus
    return resources


def _model_volume(pool: PoolSpec) -> dict[str, Any]:
    if pool.model.pvc:
        return {"name": "models", "persistentVolumeClaim": {"claimName": pool.model.pvc}}
    return {"name": "models", "emptyDir": {}}


def _needs_model_volume(pool: PoolSpec) -> bool:
    return bool(pool.model.pvc or pool.model.hugging_face_id)


def _download_init_container(pool: PoolSpec) -> dict[str, Any]:
    env: list[dict[str, Any]] = [{"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}]
    if pool.model.hf_token_secret:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": pool.model.hf_token_secret, "key": "token"}},
            }
        )
    return {
        "name": "fetch-model",
        "image": pool.engine.image,
        "imagePullPolicy": pool.engine.image_pull_policy,
        "command": commands.hf_download_args(pool.model),
        "env": cache_env() + env,
        "resources": dict(pool.model.download_resources),
        "securityContext": container_security_context(pool),
        "volumeMounts": [
            {"name": "models", "mountPath": MODELS_MOUNT},
            {"name": "tmp", "mountPath": TMP_MOUNT},
            {"name": "cache", "mountPath": CACHE_MOUNT},
        ],
    }


def pool_peers(ref: PoolRef) -> tuple[str, ...]:
    """The default KV peer allowlist: the pool's headless Services, whose names resolve to
    the pool's own ready engine pods (and to nothing else)."""
    return (
        service_host(ref.name, PREFILL, ref.namespace),
        service_host(ref.name, DECODE, ref.namespace),
    )


def _ucx_env(pool: PoolSpec) -> list[dict[str, Any]]:
    ports = pool.engine.ucx_port_range()
    return (
        [] if ports is None else [{"name": "UCX_TCP_PORT_RANGE", "value": f"{ports[0]}-{ports[1]}"}]
    )


def _engine_container(
    ref: PoolRef, pool: PoolSpec, role_name: str, role: RoleSpec, secret_ref: SecretKeyRef | None
) -> dict[str, Any]:
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": TMP_MOUNT},
        {"name": "cache", "mountPath": CACHE_MOUNT},
    ]
    if _needs_model_volume(pool):
        mounts.append({"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True})
    if secret_ref is not None:
        mounts.append({"name": "kv-secret", "mountPath": KV_SECRET_DIR, "readOnly": True})
    return {
        "name": "engine",
        "image": pool.engine.image,
        "imagePullPolicy": pool.engine.image_pull_policy,
        "command": commands.engine_args(pool, role_name, pool_peers(ref)) + _engine_tls_args(pool),
        "env": _downward_env()
        + commands.engine_env(pool)
        + cache_env()
        + _ucx_env(pool)
        + list(pool.engine.env)
        + list(role.env),
        # Named https under pool TLS, so a PodMonitor scrapes it with the right scheme.
        "ports": [
            {"name": _http_name(pool), "containerPort": ENGINE_PORT, "protocol": "TCP"},
            {"name": "nixl", "containerPort": pool.engine.kv_port, "protocol": "TCP"},
        ]
        + _kv_events_ports(pool),
        "resources": engine_resources(role),
        "securityContext": container_security_context(pool),
        "volumeMounts": mounts + _pool_tls_mounts(pool),
        # Stock vLLM has no /ready.
        **_http_probes(
            _http_name(pool),
            "/health" if pool.engine.kind == "vllm" else "/ready",
            pool.engine.startup_timeout_s,
            _probe_scheme(pool),
        ),
    }


def _kv_events_ports(pool: PoolSpec) -> list[dict[str, Any]]:
    return [
        {"name": name, "containerPort": port, "protocol": "TCP"}
        for name, port in zip(("kv-events", "kv-replay"), pool.router.kv_events.ports())
    ]


# --- TLS inside the pool (spec.tls) -----------------------------------------------------------
# Engines and sidecars serve HTTPS with the pool's certificate; sidecars and the gateway
# verify their upstreams against the pool's CA. Peers are reached at pod IPs, which no
# certificate names in advance, so the chain is what is checked (--tls-any-name): the CA
# must be dedicated to the pool (a cert-manager Issuer of its own).


def _http_name(pool: PoolSpec) -> str:
    return "https" if pool.tls_secret else "http"


def _probe_scheme(pool: PoolSpec) -> str | None:
    return "HTTPS" if pool.tls_secret else None


def _pool_tls_mounts(pool: PoolSpec) -> list[dict[str, Any]]:
    if not pool.tls_secret:
        return []
    return [{"name": "pool-tls", "mountPath": POOL_TLS_DIR, "readOnly": True}]


def _pool_tls_volumes(pool: PoolSpec) -> list[dict[str, Any]]:
    if not pool.tls_secret:
        return []
    return [
        {
            "name": "pool-tls",
            "secret": {"secretName": pool.tls_secret, "defaultMode": KV_SECRET_MODE},
        }
    ]


def _engine_tls_args(pool: PoolSpec) -> list[str]:
    if not pool.tls_secret:
        return []
    cert, key = (
        ("--ssl-certfile", "--ssl-keyfile")
        if pool.engine.kind == "vllm"
        else ("--tls-cert-file", "--tls-key-file")
    )
    return [cert, f"{POOL_TLS_DIR}/tls.crt", key, f"{POOL_TLS_DIR}/tls.key"]


def _pool_tls_client_args(pool: PoolSpec) -> list[str]:
    if not pool.tls_secret:
        return []
    return ["--tls-ca-file", f"{POOL_TLS_DIR}/ca.crt", "--tls-any-name"]


def _sidecar_args(pool: PoolSpec) -> list[str]:
    argv = commands.sidecar_args() + commands.sidecar_kv_events_args(pool)
    if not pool.tls_secret:
        return argv
    local = f"http://127.0.0.1:{ENGINE_PORT}"
    argv = [f"https://127.0.0.1:{ENGINE_PORT}" if a == local else a for a in argv]
    return argv + [
        "--tls-cert-file",
        f"{POOL_TLS_DIR}/tls.crt",
        "--tls-key-file",
        f"{POOL_TLS_DIR}/tls.key",
        *_pool_tls_client_args(pool),
    ]


def _router_env(ref: PoolRef) -> list[dict[str, Any]]:
    name = router_config_name(ref.name)
    return [
        {"name": var, "valueFrom": {"configMapKeyRef": {"name": name, "key": key}}}
        for key, var in commands.ROUTER_ENV.items()
    ]


def _sidecar_container(ref: PoolRef, pool: PoolSpec) -> dict[str, Any]:
    port = "router-tls" if pool.tls_secret else "router"
    return {
        "name": "sidecar",
        "image": pool.router.image,
        "imagePullPolicy": pool.engine.image_pull_policy,
        "command": _sidecar_args(pool),
        "env": _router_env(ref),
        "ports": [{"name": port, "containerPort": SIDECAR_PORT, "protocol": "TCP"}],
        "resources": dict(pool.router.resources),
        "securityContext": container_security_context(pool),
        # The engine's /tmp is not shared: the sidecar gets its own.
        "volumeMounts": [{"name": "sidecar-tmp", "mountPath": TMP_MOUNT}] + _pool_tls_mounts(pool),
        "readinessProbe": _probe(
            "/ready",
            port,
            5,
            3,  # its engine's readiness
            scheme=_probe_scheme(pool),
        ),
        "livenessProbe": _tcp_probe(port, 10, 6),  # the process alone
    }


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


def _pod_security(pool: PoolSpec) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "securityContext": pod_security_context(pool),
        # No pool process talks to the Kubernetes API: no token in the pods.
        "automountServiceAccountToken": pool.security.automount_service_account_token,
    }
    if pool.security.service_account_name:
        spec["serviceAccountName"] = pool.security.service_account_name
    return spec


def _pod_scheduling(pool: PoolSpec, role: RoleSpec | None) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if role is not None and role.node_selector:
        spec["nodeSelector"] = dict(role.node_selector)
    if role is not None and role.tolerations:
        spec["tolerations"] = list(role.tolerations)
    if pool.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in pool.image_pull_secrets]
    return spec


def _deployment(
    ref: PoolRef,
    role_name: str,
    replicas: int,
    pod_spec: dict[str, Any],
    annotations: dict[str, str],
) -> Manifest:
    template_meta: dict[str, Any] = {"labels": labels(ref.name, role_name)}
    if annotations:
        template_meta["annotations"] = annotations
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(ref, child_name(ref.name, role_name), role_name),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(ref.name, role_name)},
            "template": {"metadata": template_meta, "spec": pod_spec},
        },
    }


def engine_deployment(
    ref: PoolRef, pool: PoolSpec, role_name: str, router_hash: str | None = None
) -> Manifest:
    role = pool.prefill if role_name == PREFILL else pool.decode
    secret_ref = kv_secret_ref(ref, pool)
    containers = [_engine_container(ref, pool, role_name, role, secret_ref)]
    if role_name == DECODE:
        containers.append(_sidecar_container(ref, pool))
    # /dev/shm: memory-backed and sized (NCCL, UCX and torch workers use it); it counts
    # against the pod's memory.
    volumes = [
        empty_dir("dshm", pool.engine.shm_size, memory=True),
        empty_dir("tmp"),
        empty_dir("cache", pool.engine.cache_size_limit),
    ]
    if role_name == DECODE:
        volumes.append(empty_dir("sidecar-tmp"))
    pod_spec: dict[str, Any] = {
        "containers": containers,
        "volumes": volumes,
        "terminationGracePeriodSeconds": 60,
        **_pod_security(pool),
        **_pod_scheduling(pool, role),
        "topologySpreadConstraints": topology_spread(ref, role_name, role),
    }
    if _needs_model_volume(pool):
        volumes.append(_model_volume(pool))
    if secret_ref is not None:
        volumes.append(_kv_secret_volume(secret_ref))
    volumes += _pool_tls_volumes(pool)
    if pool.model.hugging_face_id:
        pod_spec["initContainers"] = [_download_init_container(pool)]
    annotations = {ANNOTATION_ROUTER_HASH: router_hash} if router_hash else {}
    return _deployment(ref, role_name, role.replicas, pod_spec, annotations)


def gateway_deployment(ref: PoolRef, pool: PoolSpec, router_hash: str) -> Manifest:
    decode = f"{service_host(ref.name, DECODE, ref.namespace)}:{SIDECAR_PORT}"
    keys, tls = pool.gateway.api_keys_secret, pool.gateway.tls_secret
    container: dict[str, Any] = {
        "name": "gateway",
        "image": pool.router.image,
        "imagePullPolicy": pool.engine.image_pull_policy,
        "command": commands.gateway_args(
            decode, API_KEYS_FILE if keys else None, TLS_DIR if tls else None
        )
        + _pool_tls_client_args(pool)
        + commands.gateway_kv_events_args(pool),
        # Named https when serving TLS, so a PodMonitor scrapes it with the right scheme.
        "ports": [
            {"name": "https" if tls else "http", "containerPort": SIDECAR_PORT, "protocol": "TCP"}
        ],
        "resources": dict(pool.gateway.resources),
        "securityContext": container_security_context(pool),
        "volumeMounts": [{"name": "tmp", "mountPath": TMP_MOUNT}],
        "readinessProbe": _probe(
            "/ready", "https" if tls else "http", 5, 3, scheme="HTTPS" if tls else None
        ),  # any sidecar ready
        "livenessProbe": _tcp_probe("https" if tls else "http", 10, 6),  # the process
    }
    volumes = [empty_dir("tmp")]
    if keys is not None:
        # Mounted whole (no subPath), so a rotated Secret reaches the file and the gateway
        # re-reads it without a restart.
        container["volumeMounts"].append(
            {"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True}
        )
        volumes.append(
            {
                "name": "api-keys",
                "secret": {
                    "secretName": keys.name,
                    "defaultMode": KV_SECRET_MODE,
                    "items": [{"key": keys.key, "path": API_KEYS_KEY}],
                },
            }
        )
    container["volumeMounts"] += _pool_tls_mounts(pool)
    volumes += _pool_tls_volumes(pool)
    if tls is not None:
        container["volumeMounts"].append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
        volumes.append(
            {"name": "tls", "secret": {"secretName": tls, "defaultMode": KV_SECRET_MODE}}
        )
    pod_spec = {
        "containers": [container],
        "volumes": volumes,
        **_pod_security(pool),
        **_pod_scheduling(pool, None),
        "topologySpreadConstraints": topology_spread(ref, GATEWAY, None),
    }
    return _deployment(
        ref, GATEWAY, pool.gateway.replicas, pod_spec, {ANNOTATION_ROUTER_HASH: router_hash}
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
