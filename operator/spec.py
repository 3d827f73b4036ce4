"""A PDInferencePool spec, read once into typed settings with the defaults filled in.

The API server already enforces the CRD schema (types, ranges, CEL rules). What is checked
here is what a schema cannot say, or what an older/looser CRD might let through: the
operator then reports a `Ready=False` condition instead of rendering broken pods.
Pure: no Kubernetes client, no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdpool.pool_defaults import (
    CACHE_HIT_THRESHOLD,
    GATEWAY_PORT,
    KV_BLOCK_SIZE,
    KV_LOAD_COST_TOKENS,
    KV_PULL_THRESHOLD,
    PREFILL_TIMEOUT_S,
    ROUTER_MODE,
    ROUTER_MODES,
)
from pdpool.settings_flags import default_of

from .names import (
    API_KEYS_KEY,
    ENGINE_METRICS_PORT,
    ENGINE_PORT,
    KV_SECRET_KEY,
    SIDECAR_METRICS_PORT,
    SIDECAR_PORT,
    TENANTS_KEY,
)

if TYPE_CHECKING:
    from .autoscaling_spec import AutoscalingSpec
    from .inference_pool_spec import InferencePoolSpec
    from .kv_offload import KVOffloadSpec
    from .loras import LoRASpec

GPU_RESOURCE = "nvidia.com/gpu"
ENGINE_KINDS = ("pdpool", "vllm")
DEFAULT_SIDECAR_IMAGE = "ghcr.io/pdpool/pdpool-slim:0.1.0"
# Requests/limits of the containers that are not engines, when the spec names none: the
# sidecar and the gateway are small async proxies; the model download streams to disk.
DEFAULT_SIDECAR_RESOURCES = {
    "requests": {"cpu": "250m", "memory": "256Mi"},
    "limits": {"memory": "1Gi"},
}
DEFAULT_GATEWAY_RESOURCES = {
    "requests": {"cpu": "250m", "memory": "256Mi"},
    "limits": {"memory": "1Gi"},
}
DEFAULT_DOWNLOAD_RESOURCES = {
    "requests": {"cpu": "500m", "memory": "512Mi"},
    "limits": {"memory": "2Gi"},
}
DEFAULT_SHM_SIZE = "2Gi"
# UCX's TCP transport (NIXL's bytes when there is no RDMA) listens on random ports unless
# told a range: the engines get UCX_TCP_PORT_RANGE so a NetworkPolicy can name it.
DEFAULT_UCX_PORT_COUNT = 64
# Who may scrape /metrics when the spec names nobody: pods in namespaces a cluster admin
# labelled so (the Prometheus namespace, typically).
DEFAULT_METRICS_FROM = (
    {"namespaceSelector": {"matchLabels": {"pdpool.io/metrics-scraper": "true"}}},
)
MAX_POOL_NAME = 52  # "<name>-gateway" must stay a valid DNS label (63)
# Kubernetes resource.Quantity syntax (the CRD carries the same pattern).
QUANTITY = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


class SpecError(ValueError):
    """The spec cannot be honoured; the message is shown in the pool's Ready condition."""


@dataclass(frozen=True)
class ModelSpec:
    path: str | None  # a directory inside the model volume (or an absolute path)
    hugging_face_id: str | None
    served_name: str
    pvc: str | None  # claim mounted at /models; None: an emptyDir
    hf_token_secret: str | None
    revision: str | None
    download_resources: dict[str, Any] = field(
        default_factory=lambda: dict(DEFAULT_DOWNLOAD_RESOURCES)
    )


@dataclass(frozen=True)
class RoleSpec:
    replicas: int
    tensor_parallel_size: int
    gpus: int
    resources: dict[str, Any]
    extra_args: tuple[str, ...]
    env: tuple[dict[str, Any], ...]
    node_selector: dict[str, str]
    tolerations: tuple[dict[str, Any], ...]
    # None: the operator's default spread (hosts, then zones, both best-effort).
    topology_spread: tuple[dict[str, Any], ...] | None = None


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class EngineSpec:
    kind: str
    image: str
    image_pull_policy: str
    block_size: int
    kv_port: int
    peer_allowlist: tuple[str, ...]
    extra_args: tuple[str, ...]
    env: tuple[dict[str, Any], ...]
    # A Secret the user manages, holding the key that signs kv_transfer_params; None: the
    # operator creates `<pool>-kv-secret` (pdpool engines only).
    kv_secret_ref: SecretKeyRef | None = None
    shm_size: str = DEFAULT_SHM_SIZE  # the memory-backed /dev/shm of engine pods
    ucx_port_count: int = DEFAULT_UCX_PORT_COUNT  # UCX TCP ports: kvPort+1 .. kvPort+count
    startup_timeout_s: int = 1800  # model load allowed before liveness applies
    cache_size_limit: str | None = None  # the writable cache emptyDir (None: unbounded)

    def ucx_port_range(self) -> tuple[int, int] | None:
        """The TCP ports UCX (under NIXL) listens on: right above the handshake port."""
        if self.ucx_port_count <= 0 or self.kv_port >= 65535:
            return None
        return self.kv_port + 1, min(self.kv_port + self.ucx_port_count, 65535)


@dataclass(frozen=True)
class KVEventsSpec:
    """Precise KV-aware routing: every engine publishes its KV cache events on these ports
    (vLLM's --kv-events-config); the gateway follows the decode engines', each sidecar the
    prefill engines'."""

    enabled: bool = False
    # vLLM's own example ports for --kv-events-config; the processes have no default (a
    # local topology picks free ports), a pod needs fixed ones its NetworkPolicy names.
    port: int = 5557
    replay_port: int = 5558
    load_cost_tokens: float = KV_LOAD_COST_TOKENS  # the gateway's cost of one in-flight request

    def ports(self) -> list[int]:
        """The ports engines publish KV events on (PUB, replay); none when not enabled."""
        return [self.port, self.replay_port] if self.enabled else []


@dataclass(frozen=True)
class RouterSpec:
    mode: str
    cache_hit_threshold: float
    kv_pull_threshold: int
    prefill_timeout_seconds: float
    image: str
    resources: dict[str, Any]
    kv_events: KVEventsSpec = field(default_factory=KVEventsSpec)


@dataclass(frozen=True)
class GatewaySpec:
    replicas: int
    port: int
    service_type: str
    resources: dict[str, Any]
    # A Secret holding the API keys clients must send (one per line); None: no keys.
    api_keys_secret: "SecretKeyRef | None" = None
    # A kubernetes.io/tls Secret (tls.crt, tls.key): the gateway serves HTTPS with it.
    tls_secret: str | None = None
    # A Secret holding the tenants file (flow control: keys, weights, priorities, limits;
    # docs/flow-control.md); None: no flow control. It lists the keys: not with api_keys.
    tenants_secret: "SecretKeyRef | None" = None


@dataclass(frozen=True)
class SecuritySpec:
    """Merged (key by key) over the restricted-profile defaults in builders.py."""

    pod_security_context: dict[str, Any] = field(default_factory=dict)
    container_security_context: dict[str, Any] = field(default_factory=dict)
    automount_service_account_token: bool = False
    service_account_name: str | None = None


@dataclass(frozen=True)
class NetworkPolicySpec:
    enabled: bool = True
    # NetworkPolicyPeers allowed to the gateway; None: any source (the gateway is the
    # pool's entry point).
    clients_from: tuple[dict[str, Any], ...] | None = None
    metrics_from: tuple[dict[str, Any], ...] = DEFAULT_METRICS_FROM


@dataclass(frozen=True)
class DisruptionBudgetSpec:
    enabled: bool = True
    max_unavailable: int | str = 1


@dataclass(frozen=True)
class RolloutSpec:
    """How a changed pool replaces its pods (every role's Deployment strategy) and how long
    a leaving pod may drain. The defaults never serve with fewer ready pods than asked for:
    a new pod is Ready before an old one goes (a GPU-tight cluster sets maxSurge 0 and
    maxUnavailable 1)."""

    max_surge: int | str = 1
    max_unavailable: int | str = 0
    drain_seconds: int = 300


@dataclass(frozen=True)
class PoolSpec:
    model: ModelSpec
    engine: EngineSpec
    prefill: RoleSpec
    decode: RoleSpec
    router: RouterSpec
    gateway: GatewaySpec
    image_pull_secrets: tuple[str, ...] = field(default=())
    security: SecuritySpec = field(default_factory=SecuritySpec)
    disruption_budget: DisruptionBudgetSpec = field(default_factory=DisruptionBudgetSpec)
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    network_policy: NetworkPolicySpec = field(default_factory=NetworkPolicySpec)
    # HTTPS inside the pool (gateway -> sidecars -> engines): a Secret with tls.crt,
    # tls.key and ca.crt (cert-manager's layout), the CA dedicated to this pool.
    tls_secret: str | None = None
    # spec.autoscaling (autoscaling_spec.py); None: replicas are the roles' own counts.
    autoscaling: "AutoscalingSpec | None" = None
    # spec.tracing.otlpTracesEndpoint: every server of the pool exports OpenTelemetry
    # traces there (None: the operator's default, PDPOOL_OTLP_TRACES_ENDPOINT).
    otlp_traces_endpoint: str | None = None
    # spec.inferencePool (inference_pool_spec.py); None: no InferencePool, no EPP.
    inference_pool: "InferencePoolSpec | None" = None
    # spec.kvOffload (kv_offload.py); None: no tier below the engines' pools.
    kv_offload: "KVOffloadSpec | None" = None
    # spec.loras (loras.py); None: the base model only.
    loras: "LoRASpec | None" = None


def parse_pool_spec(name: str, spec: dict[str, Any] | None) -> PoolSpec:
    """Spec (as stored by the API server) -> PoolSpec, or SpecError with one clear line."""
    if len(name) > MAX_POOL_NAME:
        raise SpecError(f"pool name {name!r} is longer than {MAX_POOL_NAME} characters")
    spec = spec or {}
    engine = _engine(_section(spec, "engine", required=True))
    pool = PoolSpec(
        model=_model(_section(spec, "model", required=True)),
        engine=engine,
        prefill=_role("prefill", _section(spec, "prefill")),
        decode=_role("decode", _section(spec, "decode")),
        router=_router(_section(spec, "router")),
        gateway=_gateway(_section(spec, "gateway")),
        image_pull_secrets=tuple(_str_list(spec, "imagePullSecrets")),
        security=_security(_section(spec, "security")),
        disruption_budget=_disruption_budget(_section(spec, "disruptionBudget")),
        rollout=_rollout(_section(spec, "rollout")),
        network_policy=_network_policy(_section(spec, "networkPolicy")),
        tls_secret=_section(spec, "tls").get("secretName") or None,
        autoscaling=parse_autoscaling(spec),
        otlp_traces_endpoint=_section(spec, "tracing").get("otlpTracesEndpoint") or None,
        inference_pool=parse_inference_pool(spec),
        kv_offload=parse_kv_offload(spec),
        loras=_parse_loras(spec),
    )
    if pool.router.mode == "prefill-first" and pool.prefill.replicas == 0 < pool.decode.replicas:
        # decode-first can serve cache hits alone; prefill-first sends every request to prefill.
        raise SpecError("spec.router.mode prefill-first needs prefill.replicas >= 1")
    if pool.router.kv_events.enabled:
        _check_kv_event_ports(pool.router.kv_events, pool.engine)
    scaling = pool.autoscaling
    if pool.router.mode == "prefill-first" and scaling and scaling.bounds("prefill").min < 1:
        raise SpecError("spec.router.mode prefill-first needs autoscaling.prefill.min >= 1")
    return pool


def parse_autoscaling(spec: dict[str, Any]) -> "AutoscalingSpec | None":
    # Imported here: autoscaling_spec.py reads this module's SpecError and QUANTITY.
    from .autoscaling_spec import parse_autoscaling as parse

    return parse(spec)


def _parse_loras(spec: dict[str, Any]) -> "LoRASpec | None":
    # Imported here: loras.py reads this module's SpecError.
    from .loras import parse_loras

    return parse_loras(spec)


def parse_kv_offload(spec: dict[str, Any]) -> "KVOffloadSpec | None":
    # Imported here: kv_offload.py reads this module's SpecError.
    from .kv_offload import parse_kv_offload as parse

    if spec.get("kvOffload") is not None and spec.get("engine", {}).get("kind") == "vllm":
        raise SpecError("spec.kvOffload runs pdpool's tiers: not with spec.engine.kind vllm")
    return parse(spec)


def parse_inference_pool(spec: dict[str, Any]) -> "InferencePoolSpec | None":
    # Imported here: inference_pool_spec.py reads this module's SpecError and defaults.
    from .inference_pool_spec import parse_inference_pool as parse

    return parse(spec)


def _section(spec: dict[str, Any], key: str, required: bool = False) -> dict[str, Any]:
    value = spec.get(key)
    if value is None:
        if required:
            raise SpecError(f"spec.{key} is required")
        return {}
    if not isinstance(value, dict):
        raise SpecError(f"spec.{key} must be an object")
    return value


def _model(m: dict[str, Any]) -> ModelSpec:
    path, hf_id = m.get("path"), m.get("huggingFaceId")
    if bool(path) == bool(hf_id):
        raise SpecError("spec.model needs exactly one of path or huggingFaceId")
    if path and not path.startswith("/") and not m.get("pvc"):
        raise SpecError(
            f"spec.model.path {path!r} is relative: set spec.model.pvc to the claim "
            "that holds it, or give an absolute path inside the image"
        )
    served = m.get("servedName") or hf_id or (path or "").rstrip("/").rsplit("/", 1)[-1]
    return ModelSpec(
        path=path,
        hugging_face_id=hf_id,
        served_name=served,
        pvc=m.get("pvc"),
        hf_token_secret=m.get("hfTokenSecret"),
        revision=m.get("revision"),
        download_resources=_resources(m, "spec.model", "downloadResources")
        or dict(DEFAULT_DOWNLOAD_RESOURCES),
    )


def _engine(e: dict[str, Any]) -> EngineSpec:
    kind = e.get("kind", "pdpool")
    if kind not in ENGINE_KINDS:
        raise SpecError(f"spec.engine.kind must be one of {', '.join(ENGINE_KINDS)}, got {kind!r}")
    image = e.get("image")
    if not image:
        raise SpecError("spec.engine.image is required")
    return EngineSpec(
        kind=kind,
        image=image,
        image_pull_policy=e.get("imagePullPolicy", "IfNotPresent"),
        block_size=_int(e, "blockSize", KV_BLOCK_SIZE, "spec.engine", minimum=1),
        # Fixed, unlike `pdpool serve`'s (0: any free port): the NetworkPolicy and UCX's
        # port range (ucx_port_range) name it.
        kv_port=_int(e, "kvPort", 5600, "spec.engine", minimum=1, maximum=65535),
        # Empty: the pool's own pods (its headless Services' names; see builders.py).
        peer_allowlist=tuple(_str_list(e, "kvPeerAllowlist")),
        extra_args=tuple(_str_list(e, "extraArgs")),
        env=tuple(_env(e, "spec.engine")),
        kv_secret_ref=_secret_ref(e, "kvSecretRef", "spec.engine", KV_SECRET_KEY),
        # Absent or null: the default (a null must not leave /dev/shm unbounded).
        shm_size=_quantity(e, "shmSize", None, "spec.engine") or DEFAULT_SHM_SIZE,
        ucx_port_count=_int(
            e, "ucxPortCount", DEFAULT_UCX_PORT_COUNT, "spec.engine", minimum=0, maximum=4096
        ),
        startup_timeout_s=_int(
            e,
            "startupTimeoutSeconds",
            default_of(EngineSpec, "startup_timeout_s"),
            "spec.engine",
            minimum=10,
            maximum=86400,
        ),
        cache_size_limit=_quantity(e, "cacheSizeLimit", None, "spec.engine"),
    )


def _secret_ref(d: dict[str, Any], key: str, where: str, default_key: str) -> SecretKeyRef | None:
    ref = d.get(key)
    if ref is None:
        return None
    if not isinstance(ref, dict) or not isinstance(ref.get("name"), str) or not ref["name"]:
        raise SpecError(f"{where}.{key}.name is required")
    secret_key = ref.get("key", default_key)
    if not isinstance(secret_key, str) or not secret_key:
        raise SpecError(f"{where}.{key}.key must be a non-empty string")
    return SecretKeyRef(name=ref["name"], key=secret_key)


def _role(role: str, r: dict[str, Any]) -> RoleSpec:
    where = f"spec.{role}"
    tp = _int(r, "tensorParallelSize", 1, where, minimum=1)
    gpus = _int(r, "gpus", 0, where, minimum=0)
    if gpus and gpus != tp:
        # One engine per pod spans exactly its GPUs; anything else idles or oversubscribes.
        raise SpecError(f"{where}: tensorParallelSize ({tp}) must equal gpus ({gpus})")
    if tp > 1 and not gpus:
        raise SpecError(f"{where}: tensorParallelSize {tp} needs gpus: {tp}")
    return RoleSpec(
        replicas=_int(r, "replicas", 1, where, minimum=0),
        tensor_parallel_size=tp,
        gpus=gpus,
        resources=_resources(r, where),
        extra_args=tuple(_str_list(r, "extraArgs")),
        env=tuple(_env(r, where)),
        node_selector=dict(r.get("nodeSelector") or {}),
        tolerations=tuple(r.get("tolerations") or ()),
        topology_spread=(
            None
            if r.get("topologySpreadConstraints") is None
            else tuple(r["topologySpreadConstraints"])
        ),
    )


def _router(r: dict[str, Any]) -> RouterSpec:
    mode = r.get("mode", ROUTER_MODE)
    if mode not in ROUTER_MODES:
        raise SpecError(f"spec.router.mode must be one of {', '.join(ROUTER_MODES)}, got {mode!r}")
    threshold = float(r.get("cacheHitThreshold", CACHE_HIT_THRESHOLD))
    if not 0.0 <= threshold <= 1.0:
        raise SpecError(f"spec.router.cacheHitThreshold must be in [0, 1], got {threshold}")
    timeout = float(r.get("prefillTimeoutSeconds", PREFILL_TIMEOUT_S))
    if timeout <= 0:
        raise SpecError("spec.router.prefillTimeoutSeconds must be > 0")
    return RouterSpec(
        mode=mode,
        cache_hit_threshold=threshold,
        kv_pull_threshold=_int(r, "kvPullThreshold", KV_PULL_THRESHOLD, "spec.router", minimum=0),
        prefill_timeout_seconds=timeout,
        image=r.get("image") or DEFAULT_SIDECAR_IMAGE,
        resources=_resources(r, "spec.router") or dict(DEFAULT_SIDECAR_RESOURCES),
        kv_events=_kv_events(r),
    )


def _kv_events(r: dict[str, Any]) -> KVEventsSpec:
    where = "spec.router.kvEvents"
    k = r.get("kvEvents") or {}
    if not isinstance(k, dict):
        raise SpecError(f"{where} must be an object")
    enabled = k.get("enabled", default_of(KVEventsSpec, "enabled"))
    if not isinstance(enabled, bool):
        raise SpecError(f"{where}.enabled must be a boolean")
    cost = k.get("loadCostTokens", KV_LOAD_COST_TOKENS)
    if isinstance(cost, bool) or not isinstance(cost, (int, float)) or cost < 0:
        raise SpecError(f"{where}.loadCostTokens must be a number >= 0, got {cost!r}")
    return KVEventsSpec(
        enabled=enabled,
        port=_int(k, "port", default_of(KVEventsSpec, "port"), where, minimum=1, maximum=65535),
        replay_port=_int(
            k,
            "replayPort",
            default_of(KVEventsSpec, "replay_port"),
            where,
            minimum=1,
            maximum=65535,
        ),
        load_cost_tokens=float(cost),
    )


def _check_kv_event_ports(events: KVEventsSpec, engine: EngineSpec) -> None:
    """The event ports share the engine pod with these: a clash would stop the engine."""
    taken = {
        ENGINE_PORT: "the engine's HTTP port",
        SIDECAR_PORT: "the sidecar's port",
        ENGINE_METRICS_PORT: "the engine's metrics port",
        SIDECAR_METRICS_PORT: "the sidecar's metrics port",
        engine.kv_port: "spec.engine.kvPort (NIXL)",
    }
    ucx = engine.ucx_port_range()
    for name, port in (("port", events.port), ("replayPort", events.replay_port)):
        where = f"spec.router.kvEvents.{name} {port}"
        if port in taken:
            raise SpecError(f"{where} is already {taken[port]}")
        if ucx is not None and ucx[0] <= port <= ucx[1]:
            raise SpecError(
                f"{where} is in UCX's port range {ucx[0]}-{ucx[1]} "
                "(spec.engine.kvPort+1 .. +ucxPortCount)"
            )
    if events.port == events.replay_port:
        raise SpecError(
            f"spec.router.kvEvents.port and replayPort must differ, both are {events.port}"
        )


def _gateway(g: dict[str, Any]) -> GatewaySpec:
    service_type = g.get("serviceType", "ClusterIP")
    if service_type not in ("ClusterIP", "NodePort", "LoadBalancer"):
        raise SpecError(f"spec.gateway.serviceType {service_type!r} is not supported")
    tenants = _secret_ref(g, "tenantsSecret", "spec.gateway", TENANTS_KEY)
    if tenants is not None and g.get("apiKeysSecret") is not None:
        raise SpecError(
            "spec.gateway: tenantsSecret lists the API keys; give it or apiKeysSecret, not both"
        )
    return GatewaySpec(
        replicas=_int(g, "replicas", 1, "spec.gateway", minimum=0),
        port=_int(g, "port", GATEWAY_PORT, "spec.gateway", minimum=1, maximum=65535),
        service_type=service_type,
        resources=_resources(g, "spec.gateway") or dict(DEFAULT_GATEWAY_RESOURCES),
        api_keys_secret=_secret_ref(g, "apiKeysSecret", "spec.gateway", API_KEYS_KEY),
        tls_secret=g.get("tlsSecret") or None,
        tenants_secret=tenants,
    )


def _security(s: dict[str, Any]) -> SecuritySpec:
    for key in ("podSecurityContext", "containerSecurityContext"):
        if not isinstance(s.get(key) or {}, dict):
            raise SpecError(f"spec.security.{key} must be an object")
    automount = s.get(
        "automountServiceAccountToken", default_of(SecuritySpec, "automount_service_account_token")
    )
    if not isinstance(automount, bool):
        raise SpecError("spec.security.automountServiceAccountToken must be a boolean")
    return SecuritySpec(
        pod_security_context=dict(s.get("podSecurityContext") or {}),
        container_security_context=dict(s.get("containerSecurityContext") or {}),
        automount_service_account_token=automount,
        service_account_name=s.get("serviceAccountName") or None,
    )


def _peers(d: dict[str, Any], key: str) -> tuple[dict[str, Any], ...] | None:
    value = d.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(p, dict) for p in value):
        raise SpecError(f"spec.networkPolicy.{key} must be a list of NetworkPolicy peers")
    return tuple(value)


def _network_policy(n: dict[str, Any]) -> NetworkPolicySpec:
    enabled = n.get("enabled", default_of(NetworkPolicySpec, "enabled"))
    if not isinstance(enabled, bool):
        raise SpecError("spec.networkPolicy.enabled must be a boolean")
    metrics = _peers(n, "metricsFrom")
    return NetworkPolicySpec(
        enabled=enabled,
        clients_from=_peers(n, "clientsFrom"),
        metrics_from=DEFAULT_METRICS_FROM if metrics is None else metrics,
    )


def _disruption_budget(d: dict[str, Any]) -> DisruptionBudgetSpec:
    enabled = d.get("enabled", default_of(DisruptionBudgetSpec, "enabled"))
    value = d.get("maxUnavailable", default_of(DisruptionBudgetSpec, "max_unavailable"))
    if not isinstance(enabled, bool):
        raise SpecError("spec.disruptionBudget.enabled must be a boolean")
    if isinstance(value, bool) or not (
        (isinstance(value, int) and value >= 0)
        or (isinstance(value, str) and re.fullmatch(r"[0-9]+%", value))
    ):
        raise SpecError(
            "spec.disruptionBudget.maxUnavailable must be a count >= 0 or a "
            f"percentage, got {value!r}"
        )
    return DisruptionBudgetSpec(enabled=enabled, max_unavailable=value)


def _count_or_percent(d: dict[str, Any], key: str, default: int | str, where: str) -> int | str:
    value = d.get(key, default)
    if isinstance(value, bool) or not (
        (isinstance(value, int) and 0 <= value <= 1_000_000)
        or (isinstance(value, str) and re.fullmatch(r"[0-9]{1,3}%", value))
    ):
        raise SpecError(f"{where}.{key} must be a count >= 0 or a percentage, got {value!r}")
    return value


def _rollout(d: dict[str, Any]) -> RolloutSpec:
    where = "spec.rollout"
    surge = _count_or_percent(d, "maxSurge", default_of(RolloutSpec, "max_surge"), where)
    unavailable = _count_or_percent(
        d, "maxUnavailable", default_of(RolloutSpec, "max_unavailable"), where
    )
    if str(surge).rstrip("%") == "0" and str(unavailable).rstrip("%") == "0":
        # The deployment controller refuses it too: nothing could ever be replaced.
        raise SpecError(f"{where}: maxSurge and maxUnavailable cannot both be 0")
    drain = _int(
        d,
        "drainSeconds",
        default_of(RolloutSpec, "drain_seconds"),
        where,
        minimum=10,
        maximum=86_400,
    )
    return RolloutSpec(max_surge=surge, max_unavailable=unavailable, drain_seconds=drain)


def _quantity(d: dict[str, Any], key: str, default: str | None, where: str) -> str | None:
    value = d.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not QUANTITY.match(str(value)):
        raise SpecError(f"{where}.{key}: {value!r} is not a quantity")
    return str(value)


def _resources(d: dict[str, Any], where: str, key: str = "resources") -> dict[str, Any]:
    resources = d.get(key) or {}
    for section in ("limits", "requests"):
        for name, value in (resources.get(section) or {}).items():
            if isinstance(value, bool) or not QUANTITY.match(str(value)):
                raise SpecError(f"{where}.{key}.{section}.{name}: {value!r} is not a quantity")
    return dict(resources)


def _int(
    d: dict[str, Any],
    key: str,
    default: int,
    where: str,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where}.{key} must be an integer")
    if minimum is not None and value < minimum:
        raise SpecError(f"{where}.{key} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise SpecError(f"{where}.{key} must be <= {maximum}, got {value}")
    return value


def _str_list(d: dict[str, Any], key: str) -> list[str]:
    value = d.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SpecError(f"{key} must be a list of strings")
    return value


def _env(d: dict[str, Any], where: str) -> list[dict[str, Any]]:
    env = d.get("env") or []
    for item in env:
        if not isinstance(item, dict) or not item.get("name"):
            raise SpecError(f"{where}.env entries need a name")
    return env
