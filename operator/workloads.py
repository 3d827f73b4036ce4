"""The pool's Deployments: the prefill and decode engine pods (a decode pod also runs the
sidecar that routes to its engine) and the gateway pod.

Each container gets its command from commands.py, its security and writable places from
pod_security.py and its secrets' mounts from pool_secrets.py; pods.py wraps them into a
probed, spread Deployment.
"""

from __future__ import annotations

import json
from typing import Any

from . import commands
from .drain import drain_seconds, engine_drain, sidecar_drain
from .children import Manifest, PoolRef
from .names import (
    ANNOTATION_ROUTER_HASH,
    API_KEYS_DIR,
    API_KEYS_FILE,
    API_KEYS_KEY,
    DECODE,
    ENGINE_PORT,
    GATEWAY,
    GATEWAY_METRICS_PORT,
    KV_SECRET_DIR,
    MODELS_MOUNT,
    PREFILL,
    SIDECAR_METRICS_PORT,
    SIDECAR_PORT,
    TENANTS_FILE,
    TLS_DIR,
    metrics_port_name,
    router_config_name,
    service_host,
)
from .pod_security import (
    CACHE_MOUNT,
    TMP_MOUNT,
    cache_env,
    container_security_context,
    empty_dir,
)
from .pods import (
    deployment,
    downward_env,
    http_probes,
    pod_scheduling_fields,
    pod_security_fields,
    probe,
    tcp_probe,
    topology_spread,
)
from .pool_secrets import (
    KV_SECRET_MODE,
    http_name,
    kv_secret_ref,
    kv_secret_volume,
    pool_tls_mounts,
    pool_tls_volumes,
    probe_scheme,
    tenants_mounts,
    tenants_volumes,
)
from .gie_adapters import rewrites_mounts, rewrites_volumes
from .loras import HUB_MOUNT, HUB_VOLUME
from .spec import GPU_RESOURCE, PoolSpec, RoleSpec, SecretKeyRef


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


def _hub_fetch_container(
    pool: PoolSpec, name: str, command: list[str], target: dict[str, Any]
) -> dict[str, Any]:
    """An init step that fetches a Hugging Face repo into the `target` volume mount (the
    base checkpoint, an adapter): the engine's image, the pool's token, the download
    resources."""
    env: list[dict[str, Any]] = [{"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}]
    if pool.model.hf_token_secret:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": pool.model.hf_token_secret, "key": "token"}},
            }
        )
    return {
        "name": name,
        "image": pool.engine.image,
        "imagePullPolicy": pool.engine.image_pull_policy,
        "command": command,
        "env": cache_env() + env,
        "resources": dict(pool.model.download_resources),
        "securityContext": container_security_context(pool),
        "volumeMounts": [
            target,
            {"name": "tmp", "mountPath": TMP_MOUNT},
            {"name": "cache", "mountPath": CACHE_MOUNT},
        ],
    }


def _init_containers(pool: PoolSpec) -> list[dict[str, Any]]:
    """The base model's fetch (a hub model), then one per hub adapter (spec.loras)."""
    out = []
    if pool.model.hugging_face_id:
        out.append(
            _hub_fetch_container(
                pool,
                "fetch-model",
                commands.hf_download_args(pool.model),
                {"name": "models", "mountPath": MODELS_MOUNT},
            )
        )
    if pool.loras is not None:
        target = {"name": HUB_VOLUME, "mountPath": HUB_MOUNT}
        for i, adapter in enumerate(pool.loras.hub_adapters):
            command = commands.hf_snapshot_args(adapter.hub or "", adapter.folder, adapter.revision)
            out.append(_hub_fetch_container(pool, f"fetch-lora-{i}", command, target))
    return out


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


def _tcp_port(name: str, port: int) -> dict[str, Any]:
    return {"name": name, "containerPort": port, "protocol": "TCP"}


def _engine_serving_ports(pool: PoolSpec) -> tuple[str, list[dict[str, Any]]]:
    """The engine's HTTP port name (its probes use it) and its HTTP ports. Named https /
    metrics-tls under pool TLS, so a PodMonitor scrapes with the right scheme. Stock
    vLLM's one HTTP port is also its metrics port, and named so."""
    metrics = _tcp_port(
        metrics_port_name(bool(pool.tls_secret)), commands.engine_metrics_port(pool)
    )
    if metrics["containerPort"] == ENGINE_PORT:
        return metrics["name"], [metrics]
    return http_name(pool), [_tcp_port(http_name(pool), ENGINE_PORT), metrics]


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
    if pool.kv_offload is not None and pool.kv_offload.on_disk:
        mounts.append(pool.kv_offload.mount())
    if pool.loras is not None:
        mounts += pool.loras.mounts()
    http, http_ports = _engine_serving_ports(pool)
    return {
        "name": "engine",
        "image": pool.engine.image,
        "imagePullPolicy": pool.engine.image_pull_policy,
        "command": commands.engine_args(pool, role_name, pool_peers(ref)),
        "env": downward_env()
        + commands.engine_env(pool)
        + cache_env()
        + _ucx_env(pool)
        + list(pool.engine.env)
        + list(role.env),
        "ports": [
            *http_ports,
            {"name": "nixl", "containerPort": pool.engine.kv_port, "protocol": "TCP"},
            *_kv_events_ports(pool),
        ],
        "resources": engine_resources(role),
        "securityContext": container_security_context(pool),
        "volumeMounts": mounts + pool_tls_mounts(pool),
        # Stock vLLM has no /ready.
        **http_probes(
            http,
            "/health" if pool.engine.kind == "vllm" else "/ready",
            pool.engine.startup_timeout_s,
            probe_scheme(pool),
        ),
    }


def _kv_events_ports(pool: PoolSpec) -> list[dict[str, Any]]:
    ports = pool.router.kv_events.ports()
    if not ports:  # KV events off
        return []
    return [
        {"name": name, "containerPort": port, "protocol": "TCP"}
        for name, port in zip(("kv-events", "kv-replay"), ports, strict=True)
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
        "command": commands.sidecar_args(pool),
        "env": _router_env(ref),
        "ports": [
            _tcp_port(port, SIDECAR_PORT),
            _tcp_port(metrics_port_name(bool(pool.tls_secret), sidecar=True), SIDECAR_METRICS_PORT),
        ],
        "resources": dict(pool.router.resources),
        "securityContext": container_security_context(pool),
        # The engine's /tmp is not shared: the sidecar gets its own.
        "volumeMounts": [{"name": "sidecar-tmp", "mountPath": TMP_MOUNT}, *pool_tls_mounts(pool)],
        "readinessProbe": probe(
            "/ready",
            port,
            5,
            3,  # its engine's readiness
            scheme=probe_scheme(pool),
        ),
        "livenessProbe": tcp_probe(port, 10, 6),  # the process alone
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
        **pod_security_fields(pool),
        **pod_scheduling_fields(pool, role),
        "topologySpreadConstraints": topology_spread(ref, role_name, role),
    }
    if _needs_model_volume(pool):
        volumes.append(_model_volume(pool))
    if secret_ref is not None:
        volumes.append(kv_secret_volume(secret_ref))
    if pool.kv_offload is not None and pool.kv_offload.on_disk:  # emptyDir, or shared claim
        volumes.append(pool.kv_offload.volume())
    if pool.loras is not None:
        volumes += pool.loras.volumes()
    volumes += pool_tls_volumes(pool)
    init_containers = _init_containers(pool)
    if init_containers:
        pod_spec["initContainers"] = init_containers
    annotations = {ANNOTATION_ROUTER_HASH: router_hash} if router_hash else {}
    # A leaving pod (scale-down, rolling update, deletion) drains first.
    containers[0]["lifecycle"] = engine_drain(pool, role_name)
    if role_name == DECODE:
        containers[1]["lifecycle"] = sidecar_drain(pool)
    pod_spec["terminationGracePeriodSeconds"] = drain_seconds(pool)
    # Autoscaled: the replicas are the planner's (or an HPA's).
    replicas = role.replicas if pool.autoscaling is None else None
    return deployment(ref, role_name, replicas, pod_spec, annotations, pool.rollout)


def gateway_deployment(ref: PoolRef, pool: PoolSpec, router_hash: str) -> Manifest:
    decode = f"{service_host(ref.name, DECODE, ref.namespace)}:{SIDECAR_PORT}"
    keys, tls = pool.gateway.api_keys_secret, pool.gateway.tls_secret
    container: dict[str, Any] = {
        "name": "gateway",
        "image": pool.router.image,
        "imagePullPolicy": pool.engine.image_pull_policy,
        "command": commands.gateway_args(
            pool,
            decode,
            API_KEYS_FILE if keys else None,
            TLS_DIR if tls else None,
            TENANTS_FILE if pool.gateway.tenants_secret else None,
        ),
        # Named https when serving TLS, so a PodMonitor scrapes it with the right scheme.
        "ports": [
            _tcp_port("https" if tls else "http", SIDECAR_PORT),
            _tcp_port(metrics_port_name(bool(tls)), GATEWAY_METRICS_PORT),
        ],
        "resources": dict(pool.gateway.resources),
        "securityContext": container_security_context(pool),
        "volumeMounts": [{"name": "tmp", "mountPath": TMP_MOUNT}],
        "readinessProbe": probe(
            "/ready", "https" if tls else "http", 5, 3, scheme="HTTPS" if tls else None
        ),  # any sidecar ready
        "livenessProbe": tcp_probe("https" if tls else "http", 10, 6),  # the process
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
    container["volumeMounts"] += tenants_mounts(pool)
    volumes += tenants_volumes(pool)
    container["volumeMounts"] += rewrites_mounts(pool.loras)  # GIE's rollouts (gie_adapters.py)
    volumes += rewrites_volumes(ref, pool.loras)
    container["volumeMounts"] += pool_tls_mounts(pool)
    volumes += pool_tls_volumes(pool)
    if tls is not None:
        container["volumeMounts"].append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
        volumes.append(
            {"name": "tls", "secret": {"secretName": tls, "defaultMode": KV_SECRET_MODE}}
        )
    pod_spec = {
        "containers": [container],
        "volumes": volumes,
        **pod_security_fields(pool),
        **pod_scheduling_fields(pool, None),
        "topologySpreadConstraints": topology_spread(ref, GATEWAY, None),
    }
    return deployment(
        ref,
        GATEWAY,
        pool.gateway.replicas,
        pod_spec,
        {ANNOTATION_ROUTER_HASH: router_hash},
        pool.rollout,
    )
