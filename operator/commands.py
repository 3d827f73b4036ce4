"""Command lines of the containers in a pool: pure functions of the spec, rendered by
pdpool/command_lines.py (which `pdpool up` shares).

`pdpool` engines get our flags; `vllm` engines get stock vLLM flags with its NixlConnector,
so the same pool shape runs either. Settings that the router ConfigMap owns reach the
sidecar through environment variables (`$(VAR)` is expanded by the kubelet), so the
ConfigMap is the single place they live. One input besides the spec: the operator's
default OTLP endpoint (PDPOOL_OTLP_TRACES_ENDPOINT, from the chart), for pools without
spec.tracing.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from pdpool.command_lines import (
    EngineLaunch,
    KVEventsPublisher,
    KVLink,
    RouterLaunch,
    Serving,
    SidecarLaunch,
    VllmLaunch,
    epp_argv,
    gateway_argv,
    last_flag_value,
    num,
    pdpool_engine_argv,
    sidecar_argv,
    vllm_engine_argv,
)

from .gie_adapters import rewrites_file
from .names import (
    DECODE,
    ENGINE_METRICS_PORT,
    ENGINE_PORT,
    GATEWAY_METRICS_PORT,
    KV_SECRET_FILE,
    MODELS_MOUNT,
    POOL_TLS_DIR,
    PREFILL,
    SIDECAR_METRICS_PORT,
    SIDECAR_PORT,
)
from .spec import ModelSpec, PoolSpec

TRACES_ENDPOINT_ENV = "PDPOOL_OTLP_TRACES_ENDPOINT"

# ConfigMap key -> environment variable the sidecar's flags read.
ROUTER_ENV = {
    "mode": "PDPOOL_ROUTER_MODE",
    "cacheHitThreshold": "PDPOOL_CACHE_HIT_THRESHOLD",
    "kvPullThreshold": "PDPOOL_KV_PULL_THRESHOLD",
    "prefillTimeoutSeconds": "PDPOOL_PREFILL_TIMEOUT",
    "prefillService": "PDPOOL_PREFILL_SERVICE",
    "engineRejects": "PDPOOL_ENGINE_REJECTS",
}


def engine_rejects(pool: PoolSpec) -> str:
    """Whether the decode engine honours cache_hit_threshold (the sidecar's
    --engine-rejects): stock vLLM has no such field, so for `engine.kind: vllm` decode-first
    is decided by the sidecar on prompt length (long prompts prefill-first), never silently
    decode-only."""
    return "no" if pool.engine.kind == "vllm" else "yes"


def engine_metrics_port(pool: PoolSpec) -> int:
    """Where the engine serves /metrics to scrapers: its --metrics-port, except stock vLLM,
    which has no such flag and serves them on its API port only."""
    return ENGINE_PORT if pool.engine.kind == "vllm" else ENGINE_METRICS_PORT


def model_dir(model: ModelSpec) -> str:
    """Where the engine finds the checkpoint inside its pod."""
    if model.hugging_face_id:
        return f"{MODELS_MOUNT}/{model.hugging_face_id}"
    if model.path is None:  # parse_pool_spec sets exactly one of the two
        raise ValueError("the model has neither a path nor a Hugging Face id")
    if model.path.startswith("/"):
        return model.path
    return f"{MODELS_MOUNT}/{model.path.strip('/')}"


def engine_args(pool: PoolSpec, role: str, default_peers: tuple[str, ...] = ()) -> list[str]:
    """Full command line (argv) of the engine container of `role`."""
    spec = pool.prefill if role == PREFILL else pool.decode
    launch = EngineLaunch(
        serving=Serving(
            ("pdpool",) if pool.engine.kind == "pdpool" else ("vllm",),
            "0.0.0.0",
            ENGINE_PORT,
            ENGINE_METRICS_PORT if pool.engine.kind == "pdpool" else None,
            tls=_pool_tls(pool),
            otlp_traces_endpoint=traces_endpoint(pool),
        ),
        model_dir=model_dir(pool.model),
        served_name=pool.model.served_name,
        block_size=pool.engine.block_size,
        priority_scheduling=pool.gateway.tenants_secret is not None,
        kv_events=_kv_events_publisher(pool),
        offload=pool.kv_offload.launch() if pool.kv_offload else None,
        adapters=pool.loras.launch() if pool.loras else None,
        extra_args=(
            *pool.engine.extra_args,
            *spec.extra_args,
        ),
    )
    if pool.engine.kind == "vllm":
        return vllm_engine_argv(
            VllmLaunch(launch, "kv_both", tensor_parallel_size=spec.tensor_parallel_size)
        )
    # Decode engines reject cache-poor requests themselves in decode-first mode.
    decode_first = role == DECODE and pool.router.mode == "decode-first"
    return pdpool_engine_argv(
        replace(
            launch,
            kv=KVLink(
                "producer" if role == PREFILL else "consumer",
                "$(POD_IP)",  # peers reach this pod at its own IP: never 0.0.0.0
                pool.engine.kv_port,
                ",".join(pool.engine.peer_allowlist or default_peers),
                KV_SECRET_FILE,
            ),
            cache_hit_threshold=num(pool.router.cache_hit_threshold if decode_first else 0.0),
        )
    )


def traces_endpoint(pool: PoolSpec) -> str | None:
    """Where every server of the pool (engines, stock vLLM too, sidecars, gateway) exports
    its spans: the pool's spec.tracing, else the operator's default (the chart's
    tracing.otlpTracesEndpoint, in PDPOOL_OTLP_TRACES_ENDPOINT)."""
    return pool.otlp_traces_endpoint or os.environ.get(TRACES_ENDPOINT_ENV) or None


def _pool_tls(pool: PoolSpec) -> tuple[str, str] | None:
    """The pool's own certificate, which engines and sidecars serve under spec.tls."""
    return (f"{POOL_TLS_DIR}/tls.crt", f"{POOL_TLS_DIR}/tls.key") if pool.tls_secret else None


def _pool_ca(pool: PoolSpec) -> str | None:
    """The pool's CA, which its clients verify against (pod IPs are not in the certificate:
    they pass --tls-any-name)."""
    return f"{POOL_TLS_DIR}/ca.crt" if pool.tls_secret else None


def _kv_events_publisher(pool: PoolSpec) -> KVEventsPublisher | None:
    """vLLM's --kv-events-config. The sockets listen on the pod IP, where the gateway, the
    EPP and the sidecars reach them, and nowhere else; stock vLLM binds its PUB socket only
    on a wildcard (it connects to any other address) and its index entries need the token
    ids: it keeps `tcp://*` and the tokens, behind the NetworkPolicy."""
    events = pool.router.kv_events
    if not events.enabled:
        return None
    return KVEventsPublisher(
        "$(POD_IP)", events.port, events.replay_port, stock_vllm=pool.engine.kind == "vllm"
    )


def engine_block_size(pool: PoolSpec, role: str) -> int:
    """The KV block size the role's engines run with: the last --block-size of their
    command line (extraArgs may override spec.engine.blockSize, which both kinds get)."""
    given = last_flag_value(engine_args(pool, role), "--block-size")
    return int(given) if given is not None and given.isdigit() else pool.engine.block_size


def engine_env(pool: PoolSpec) -> list[dict[str, str]]:
    """Extra environment of the engine container (after POD_IP, which it may reference)."""
    lora = pool.loras.engine_env() if pool.loras else []
    if pool.engine.kind == "vllm":
        return [
            {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": "$(POD_IP)"},
            {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(pool.engine.kv_port)},
            *lora,
        ]
    return lora


def sidecar_args(pool: PoolSpec) -> list[str]:
    """The decode pod's sidecar. The settings the router ConfigMap owns arrive as
    `$(VAR)` references (ROUTER_ENV), expanded by the kubelet."""
    env = {key: f"$({var})" for key, var in ROUTER_ENV.items()}
    events = pool.router.kv_events
    scheme = "https" if pool.tls_secret else "http"
    return sidecar_argv(
        SidecarLaunch(
            Serving(
                ("pdpool",),
                "0.0.0.0",
                SIDECAR_PORT,
                SIDECAR_METRICS_PORT,
                tls=_pool_tls(pool),
                otlp_traces_endpoint=traces_endpoint(pool),
            ),
            decode_url=f"{scheme}://127.0.0.1:{ENGINE_PORT}",
            prefill_service=env["prefillService"],
            mode=env["mode"],
            cache_hit_threshold=env["cacheHitThreshold"],
            kv_pull_threshold=env["kvPullThreshold"],
            prefill_timeout=env["prefillTimeoutSeconds"],
            engine_rejects=env["engineRejects"],
            # the sidecar subscribes to every prefill engine its --prefill-service lists
            prefill_kv_events_ports=(events.port, events.replay_port) if events.enabled else None,
            kv_block_size=engine_block_size(pool, PREFILL) if events.enabled else None,
            ca_file=_pool_ca(pool),
            any_name=True,
            lora_allowed_dirs=pool.loras.sidecar_allowed_dirs if pool.loras else (),
        )
    )


def _router(pool: PoolSpec, serving: Serving, decode_service: str, **kw: Any) -> RouterLaunch:
    """The routing flags the gateway and the EPP share: the decode sidecars' Service, and
    with KV events every decode engine's (the engine shares its sidecar's pod IP)."""
    events = pool.router.kv_events
    kv: dict[str, Any] = {}
    if events.enabled:
        kv = dict(
            kv_events_ports=(events.port, events.replay_port),
            kv_block_size=engine_block_size(pool, DECODE),
            kv_threshold=num(pool.router.cache_hit_threshold),
            kv_load_cost=num(events.load_cost_tokens),
        )
    return RouterLaunch(
        serving,
        decode_service,
        model_rewrites_file=rewrites_file(pool.loras),
        ca_file=_pool_ca(pool),
        any_name=True,
        **kv,
        **kw,
    )


def gateway_args(
    pool: PoolSpec,
    decode_service: str,
    api_keys_file: str | None = None,
    tls_dir: str | None = None,
    tenants_file: str | None = None,
) -> list[str]:
    serving = Serving(
        ("pdpool",),
        "0.0.0.0",
        SIDECAR_PORT,
        GATEWAY_METRICS_PORT,
        tls=(f"{tls_dir}/tls.crt", f"{tls_dir}/tls.key") if tls_dir else None,
        otlp_traces_endpoint=traces_endpoint(pool),
    )
    launch = _router(
        pool, serving, decode_service, tenants_file=tenants_file, api_keys_file=api_keys_file
    )
    return gateway_argv(launch)


def hf_snapshot_args(repo_id: str, local_dir: str, revision: str | None) -> list[str]:
    """Init step: fetch a Hugging Face repo (a checkpoint, an adapter) into a folder
    (idempotent)."""
    script = (
        "import sys; from huggingface_hub import snapshot_download; "
        "snapshot_download(repo_id=sys.argv[1], local_dir=sys.argv[2], "
        "revision=sys.argv[3] or None)"
    )
    return ["python3", "-c", script, repo_id, local_dir, revision or ""]


def hf_download_args(model: ModelSpec) -> list[str]:
    """Init step: fetch the base checkpoint into the model volume."""
    if not model.hugging_face_id:
        raise ValueError("only a Hugging Face model is downloaded")
    return hf_snapshot_args(model.hugging_face_id, model_dir(model), model.revision)


def epp_args(
    pool: PoolSpec,
    decode_service: str,
    ports: tuple[int, int, int],
    tenants_file: str | None = None,
) -> list[str]:
    """`pdpool epp`: the ext_proc endpoint picker over the decode sidecars' Service, on its
    (gRPC, gRPC health, metrics) ports."""
    grpc, health, metrics = ports
    serving = Serving(
        ("pdpool",), "0.0.0.0", grpc, metrics, otlp_traces_endpoint=traces_endpoint(pool)
    )
    return epp_argv(_router(pool, serving, decode_service, tenants_file=tenants_file), health)
