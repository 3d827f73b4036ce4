"""Command lines of the containers in a pool: pure functions of the spec.

`pdpool` engines get our flags; `vllm` engines get stock vLLM flags with its NixlConnector,
so the same pool shape runs either. Settings that the router ConfigMap owns reach the
sidecar through environment variables (`$(VAR)` is expanded by the kubelet), so the
ConfigMap is the single place they live. One input besides the spec: the operator's
default OTLP endpoint (PDPOOL_OTLP_TRACES_ENDPOINT, from the chart), for pools without
spec.tracing.
"""

from __future__ import annotations

import json
import os

from pdpool.scheduling_policy import scheduling_args

from .names import (
    DECODE,
    ENGINE_METRICS_PORT,
    ENGINE_PORT,
    GATEWAY_METRICS_PORT,
    KV_SECRET_FILE,
    MODELS_MOUNT,
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
    if pool.engine.kind == "vllm":
        argv = _vllm_args(pool, spec.tensor_parallel_size)
    else:
        argv = _pdpool_args(pool, role, default_peers)
    return (
        argv
        + _kv_events_config(pool)
        + tracing_args(pool)
        # with tenants, the engines order by the band the gateway or the EPP writes
        + scheduling_args(pool.gateway.tenants_secret is not None)
        + list(pool.engine.extra_args)
        + list(spec.extra_args)
    )


def tracing_args(pool: PoolSpec) -> list[str]:
    """vLLM's --otlp-traces-endpoint, for every server of the pool (engines, stock vLLM
    too, sidecars, gateway): the pool's spec.tracing, else the operator's default (the
    chart's tracing.otlpTracesEndpoint, in PDPOOL_OTLP_TRACES_ENDPOINT)."""
    endpoint = pool.otlp_traces_endpoint or os.environ.get(TRACES_ENDPOINT_ENV)
    return ["--otlp-traces-endpoint", endpoint] if endpoint else []


def _kv_events_config(pool: PoolSpec) -> list[str]:
    """vLLM's --kv-events-config (pdpool serve takes it too). The sockets listen on the pod
    IP, where the gateway, the EPP and the sidecars reach them, and nowhere else; pdpool
    engines publish hashes without token ids (the router's index keys their blocks by the
    engines' own hashes), so the events do not spell out prompts. Stock vLLM binds its PUB
    socket only on a wildcard (it connects to any other address) and its index entries need
    the token ids: it keeps `tcp://*` and the tokens, behind the NetworkPolicy."""
    events = pool.router.kv_events
    if not events.enabled:
        return []
    pdpool = pool.engine.kind != "vllm"
    config: dict[str, object] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://{'$(POD_IP)' if pdpool else '*'}:{events.port}",
        "replay_endpoint": f"tcp://$(POD_IP):{events.replay_port}",  # vLLM binds it as given
    }
    if pdpool:
        config.update(bind=True, token_ids=False)
    return ["--kv-events-config", json.dumps(config, separators=(",", ":"))]


def engine_block_size(pool: PoolSpec, role: str) -> int:
    """The KV block size the role's engines run with: the last --block-size of their
    command line (extraArgs may override spec.engine.blockSize, which both kinds get)."""
    argv = engine_args(pool, role)
    size = pool.engine.block_size
    for i, arg in enumerate(argv):
        value = (
            arg.partition("=")[2]
            if arg.startswith("--block-size=")
            else (argv[i + 1] if arg == "--block-size" and i + 1 < len(argv) else "")
        )
        if value.isdigit():
            size = int(value)
    return size


def _serve_command(program: str, pool: PoolSpec) -> list[str]:
    """`PROGRAM serve MODEL` listening where the sidecar and the Services expect the engine,
    under the model's served name (both engine kinds take these flags alike)."""
    return [
        program,
        "serve",
        model_dir(pool.model),
        "--host",
        "0.0.0.0",
        "--port",
        str(ENGINE_PORT),
        "--served-model-name",
        pool.model.served_name,
    ]


def _pdpool_args(pool: PoolSpec, role: str, default_peers: tuple[str, ...] = ()) -> list[str]:
    engine = pool.engine
    # Decode engines reject cache-poor requests themselves in decode-first mode.
    threshold = (
        pool.router.cache_hit_threshold
        if (role == DECODE and pool.router.mode == "decode-first")
        else 0.0
    )
    return [
        *_serve_command("pdpool", pool),
        "--metrics-port",
        str(ENGINE_METRICS_PORT),
        "--kv-connector",
        "nixl",
        "--kv-role",
        "producer" if role == PREFILL else "consumer",
        # Peers must reach this pod at its own IP: never advertise 0.0.0.0.
        "--kv-host",
        "$(POD_IP)",
        "--kv-port",
        str(engine.kv_port),
        "--kv-peer-allowlist",
        ",".join(engine.peer_allowlist or default_peers),
        # The pool's shared key: kv_transfer_params are signed, and forged ones refused.
        "--kv-secret-file",
        KV_SECRET_FILE,
        "--global-cache-hit-threshold",
        _num(threshold),
        "--block-size",
        str(engine.block_size),
    ]


def _vllm_args(pool: PoolSpec, tensor_parallel_size: int) -> list[str]:
    kv_config = json.dumps(
        {"kv_connector": "NixlConnector", "kv_role": "kv_both"}, separators=(",", ":")
    )
    return [
        *_serve_command("vllm", pool),
        "--tensor-parallel-size",
        str(tensor_parallel_size),
        "--block-size",
        str(pool.engine.block_size),
        "--kv-transfer-config",
        kv_config,
    ]


def engine_env(pool: PoolSpec) -> list[dict[str, str]]:
    """Extra environment of the engine container (after POD_IP, which it may reference)."""
    if pool.engine.kind == "vllm":
        return [
            {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": "$(POD_IP)"},
            {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(pool.engine.kv_port)},
        ]
    return []


def sidecar_args() -> list[str]:
    env = {key: f"$({var})" for key, var in ROUTER_ENV.items()}
    return [
        "pdpool",
        "sidecar",
        "--host",
        "0.0.0.0",
        "--port",
        str(SIDECAR_PORT),
        "--metrics-port",
        str(SIDECAR_METRICS_PORT),
        "--decode-url",
        f"http://127.0.0.1:{ENGINE_PORT}",
        "--prefill-service",
        env["prefillService"],
        "--mode",
        env["mode"],
        "--cache-hit-threshold",
        env["cacheHitThreshold"],
        "--kv-pull-threshold",
        env["kvPullThreshold"],
        "--prefill-timeout",
        env["prefillTimeoutSeconds"],
        "--engine-rejects",
        env["engineRejects"],
    ]


def sidecar_kv_events_args(pool: PoolSpec) -> list[str]:
    """The sidecar subscribes to every prefill engine its --prefill-service lists."""
    events = pool.router.kv_events
    if not events.enabled:
        return []
    return [
        "--prefill-kv-events-port",
        str(events.port),
        "--prefill-kv-events-replay-port",
        str(events.replay_port),
        "--kv-block-size",
        str(engine_block_size(pool, PREFILL)),
    ]


def gateway_kv_events_args(pool: PoolSpec) -> list[str]:
    """The gateway subscribes to every decode engine its --decode-service lists (the
    engine shares the sidecar's pod IP) and routes by cost."""
    events = pool.router.kv_events
    if not events.enabled:
        return []
    return [
        "--kv-events-port",
        str(events.port),
        "--kv-events-replay-port",
        str(events.replay_port),
        "--kv-block-size",
        str(engine_block_size(pool, DECODE)),
        "--kv-threshold",
        _num(pool.router.cache_hit_threshold),
        "--kv-load-cost",
        _num(events.load_cost_tokens),
    ]


def gateway_args(
    decode_service: str,
    api_keys_file: str | None = None,
    tls_dir: str | None = None,
    tenants_file: str | None = None,
) -> list[str]:
    argv = [
        "pdpool",
        "gateway",
        "--host",
        "0.0.0.0",
        "--port",
        str(SIDECAR_PORT),
        "--metrics-port",
        str(GATEWAY_METRICS_PORT),
        "--decode-service",
        decode_service,
    ]
    if tls_dir:
        argv += ["--tls-cert-file", f"{tls_dir}/tls.crt", "--tls-key-file", f"{tls_dir}/tls.key"]
    argv += ["--tenants-file", tenants_file] if tenants_file else []
    return argv + (["--api-keys-file", api_keys_file] if api_keys_file else [])


def hf_download_args(model: ModelSpec) -> list[str]:
    """Init step: fetch a Hugging Face checkpoint into the model volume (idempotent)."""
    if not model.hugging_face_id:
        raise ValueError("only a Hugging Face model is downloaded")
    script = (
        "import sys; from huggingface_hub import snapshot_download; "
        "snapshot_download(repo_id=sys.argv[1], local_dir=sys.argv[2], "
        "revision=sys.argv[3] or None)"
    )
    return ["python3", "-c", script, model.hugging_face_id, model_dir(model), model.revision or ""]


def _num(x: float) -> str:
    return format(x, "g")


def epp_args(decode_service: str, grpc_port: int, health_port: int, metrics_port: int) -> list[str]:
    """`pdpool epp`: the ext_proc endpoint picker over the decode sidecars' Service."""
    return [
        "pdpool",
        "epp",
        "--host",
        "0.0.0.0",
        "--port",
        str(grpc_port),
        "--health-port",
        str(health_port),
        "--metrics-port",
        str(metrics_port),
        "--decode-service",
        decode_service,
    ]
