"""The command lines of a pool's processes: engines (ours or stock vLLM), sidecars, the gateway
and the endpoint picker. Pure functions of small launch records.

The operator (operator/commands.py: a PDInferencePool into containers) and `pdpool up`
(pdpool/up/topology.py: local processes) each fill these records from their own world (pod
IPs and Services there, loopback ports and files here) and nothing else writes a flag, so a
pool runs with the same flags both ways. Values are strings where the operator passes
`$(VAR)` references that the kubelet expands.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional, Sequence


def num(x: float) -> str:
    """A number as a flag value: 0.5, 30, 1e-05 (no trailing zeros)."""
    return format(x, "g")


@dataclass(frozen=True)
class KVEventsPublisher:
    """vLLM's --kv-events-config for one engine: PUB and replay sockets."""

    host: str  # where the engine binds (pdpool) or, for the replay socket, listens
    port: int
    replay_port: int
    stock_vllm: bool = False

    def config(self) -> str:
        """pdpool engines bind the given address and publish hashes without token ids (the
        router's index keys their blocks by the engines' own hashes), so the events do not
        spell out prompts; stock vLLM binds its PUB only on a wildcard (it connects to any
        other address) and its index entries need the token ids."""
        config: dict[str, object] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://{'*' if self.stock_vllm else self.host}:{self.port}",
            "replay_endpoint": f"tcp://{self.host}:{self.replay_port}",  # bound as given
        }
        if not self.stock_vllm:
            config.update(bind=True, token_ids=False)
        return json.dumps(config, separators=(",", ":"))


@dataclass(frozen=True)
class KVLink:
    """A pdpool engine's NIXL connector."""

    role: str  # producer, consumer or both
    host: str  # the address peers reach (never 0.0.0.0)
    port: int
    peer_allowlist: str
    secret_file: str  # the pool's key: kv_transfer_params are signed, forged ones refused


@dataclass(frozen=True)
class KVOffload:
    """A KV offload tier below an engine's block pool (vLLM's --kv-offloading-size and
    --kv-offloading-backend; the directory and fsync are pdpool's)."""

    size_gib: float
    backend: str  # native (host memory), disk (this engine's directory), shared (the pool's)
    path: Optional[str] = None  # the tier's directory (disk, shared)
    fsync: bool = False
    # shared without a KV link: the pool's key, so that the tier's records are signed
    secret_file: Optional[str] = None


def _offload(t: Optional[KVOffload]) -> list[str]:
    if t is None:
        return []
    argv = [f"--kv-offloading-size={num(t.size_gib)}", f"--kv-offloading-backend={t.backend}"]
    argv += [f"--kv-offloading-path={t.path}"] if t.path else []
    argv += ["--kv-offloading-fsync"] if t.fsync else []
    return argv + ([f"--kv-secret-file={t.secret_file}"] if t.secret_file else [])


@dataclass(frozen=True)
class Adapters:
    """LoRA adapters served by every engine (vLLM's --enable-lora flags)."""

    max_loras: int
    max_rank: int
    modules: Sequence[tuple[str, str]] = ()  # (name, folder) served from the start
    # folders runtime loads may read (pdpool's --lora-allowed-dir; stock vLLM has none)
    allowed_dirs: Sequence[str] = ()


def _adapters(a: Optional[Adapters], pdpool: bool) -> list[str]:
    if a is None:
        return []
    argv = ["--enable-lora", f"--max-loras={a.max_loras}", f"--max-lora-rank={a.max_rank}"]
    argv += [f"--lora-allowed-dir={d}" for d in a.allowed_dirs] if pdpool else []
    return argv + [f"--lora-modules={name}={folder}" for name, folder in a.modules]


@dataclass(frozen=True)
class Serving:
    """Flags every server shares: where it listens, TLS, tracing."""

    program: tuple[str, ...]  # ("pdpool",) in an image; the running interpreter locally
    host: str
    port: int
    metrics_port: Optional[int] = None
    tls: Optional[tuple[str, str]] = None  # (certificate, key) files
    otlp_traces_endpoint: Optional[str] = None


@dataclass(frozen=True)
class EngineLaunch:
    serving: Serving
    model_dir: str
    served_name: Optional[str] = None
    device: Optional[str] = None
    kv: Optional[KVLink] = None  # None: --kv-connector none
    cache_hit_threshold: Optional[str] = None  # --global-cache-hit-threshold
    block_size: Optional[int] = None
    cpu_prefill_threads: Optional[int] = None
    priority_scheduling: bool = False
    kv_events: Optional[KVEventsPublisher] = None
    offload: Optional[KVOffload] = None  # before extra_args, which may override it
    adapters: Optional[Adapters] = None  # the same
    extra_args: Sequence[str] = ()  # last: later flags win


def pdpool_engine_argv(e: EngineLaunch) -> list[str]:
    s = e.serving
    argv = [*s.program, "serve", e.model_dir, "--host", s.host, "--port", str(s.port)]
    argv += ["--served-model-name", e.served_name] if e.served_name else []
    argv += ["--device", e.device] if e.device else []
    argv += ["--metrics-port", str(s.metrics_port)] if s.metrics_port is not None else []
    if e.kv is None:
        argv += ["--kv-connector", "none"]
    else:
        argv += [
            "--kv-connector",
            "nixl",
            "--kv-role",
            e.kv.role,
            "--kv-host",
            e.kv.host,
            "--kv-port",
            str(e.kv.port),
            "--kv-peer-allowlist",
            e.kv.peer_allowlist,
            "--kv-secret-file",
            e.kv.secret_file,
        ]
    if e.cache_hit_threshold is not None:
        argv += ["--global-cache-hit-threshold", e.cache_hit_threshold]
    argv += ["--block-size", str(e.block_size)] if e.block_size is not None else []
    if e.cpu_prefill_threads is not None:
        argv += ["--cpu-prefill-threads", str(e.cpu_prefill_threads)]
    return argv + _engine_common(e, ("--tls-cert-file", "--tls-key-file"), pdpool=True)


@dataclass(frozen=True)
class VllmLaunch:
    engine: EngineLaunch  # served_name, block_size, kv_events, extra_args apply; not kv
    kv_role: Optional[str] = None  # NixlConnector's kv_role; None: no connector
    kv_buffer_device: Optional[str] = None
    tensor_parallel_size: Optional[int] = None
    vllm_args: Sequence[str] = ()  # before the common flags (dtype, eager, model length)


def vllm_engine_argv(v: VllmLaunch) -> list[str]:
    e, s = v.engine, v.engine.serving
    argv = [*s.program, "serve", e.model_dir, "--host", s.host, "--port", str(s.port)]
    argv += ["--served-model-name", e.served_name] if e.served_name else []
    argv += list(v.vllm_args)
    if v.tensor_parallel_size is not None:
        argv += ["--tensor-parallel-size", str(v.tensor_parallel_size)]
    argv += ["--block-size", str(e.block_size)] if e.block_size is not None else []
    if v.kv_role is not None:
        config = {"kv_connector": "NixlConnector", "kv_role": v.kv_role}
        if v.kv_buffer_device:
            config["kv_buffer_device"] = v.kv_buffer_device
        argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
    return argv + _engine_common(e, ("--ssl-certfile", "--ssl-keyfile"), pdpool=False)


def _engine_common(e: EngineLaunch, tls_flags: tuple[str, str], pdpool: bool) -> list[str]:
    """Flags both engine kinds take alike (vLLM's names), then the user's extra ones."""
    argv = _tls(e.serving, tls_flags)
    argv += ["--kv-events-config", e.kv_events.config()] if e.kv_events else []
    argv += _tracing(e.serving)
    # with tenants, the engines order by the band the gateway or the EPP writes
    argv += ["--scheduling-policy", "priority"] if e.priority_scheduling else []
    return argv + _offload(e.offload) + _adapters(e.adapters, pdpool) + list(e.extra_args)


@dataclass(frozen=True)
class SidecarLaunch:
    serving: Serving
    decode_url: str
    prefill_service: Optional[str] = None  # a Service host:port or file:PATH
    prefill_urls: Sequence[str] = ()
    mode: Optional[str] = None
    cache_hit_threshold: Optional[str] = None
    kv_pull_threshold: Optional[str] = None
    prefill_timeout: Optional[str] = None
    decode_retry_s: Optional[str] = None
    engine_rejects: Optional[str] = None
    pull_from_decode: bool = True
    prefill_min_prompt_tokens: Optional[int] = None
    # prefill engines' KV events (HOST:PORT=ENDPOINT|REPLAY each), or a port pair that every
    # prefill engine of --prefill-service publishes on
    prefill_kv_events: Sequence[str] = ()
    prefill_kv_events_ports: Optional[tuple[int, int]] = None
    kv_block_size: Optional[int] = None
    kv_tokenizer: Optional[str] = None
    ca_file: Optional[str] = None
    any_name: bool = False  # --tls-any-name: pod IPs are not in the pool's certificate
    # Folders the sidecar may load a decode engine's adapter from onto a prefill engine
    # (the pool allows runtime LoRA updates); none: never loads, decode-only instead.
    lora_allowed_dirs: Sequence[str] = ()
    workers: Optional[int] = None  # None: the sidecar's own default (its usable cores)
    extra_args: Sequence[str] = ()


def sidecar_argv(c: SidecarLaunch) -> list[str]:
    s = c.serving
    argv = [*s.program, "sidecar", "--host", s.host, "--port", str(s.port)]
    argv += ["--metrics-port", str(s.metrics_port)] if s.metrics_port is not None else []
    argv += ["--decode-url", c.decode_url]
    argv += ["--prefill-service", c.prefill_service] if c.prefill_service else []
    for url in c.prefill_urls:
        argv += ["--prefill-url", url]
    argv += _opt("--mode", c.mode) + _opt("--cache-hit-threshold", c.cache_hit_threshold)
    argv += _opt("--kv-pull-threshold", c.kv_pull_threshold)
    argv += _opt("--prefill-timeout", c.prefill_timeout)
    argv += _opt("--decode-retry-s", c.decode_retry_s)
    argv += _opt("--engine-rejects", c.engine_rejects)
    argv += [] if c.pull_from_decode else ["--no-pull-from-decode"]
    if c.prefill_min_prompt_tokens is not None:
        argv += ["--prefill-min-prompt-tokens", str(c.prefill_min_prompt_tokens)]
    for source in c.prefill_kv_events:
        argv += ["--prefill-kv-events", source]
    if c.prefill_kv_events_ports is not None:
        pub, replay = c.prefill_kv_events_ports
        argv += ["--prefill-kv-events-port", str(pub), "--prefill-kv-events-replay-port"]
        argv += [str(replay)]
    argv += _kv_index(c.kv_block_size, c.kv_tokenizer)
    for folder in c.lora_allowed_dirs:
        argv += ["--lora-allowed-dir", folder]
    argv += _opt("--workers", str(c.workers) if c.workers is not None else None)
    argv += _tls(s, ("--tls-cert-file", "--tls-key-file")) + _client_tls(c.ca_file, c.any_name)
    return argv + _tracing(s) + list(c.extra_args)


@dataclass(frozen=True)
class RouterLaunch:
    """The routing flags our gateway and the endpoint picker share."""

    serving: Serving
    decode_service: Optional[str] = None  # a Service host:port or file:PATH
    decode_urls: Sequence[str] = ()
    health_interval_s: Optional[str] = None
    kv_events: Sequence[str] = ()  # decode engines' KV events (HOST:PORT=ENDPOINT|REPLAY)
    kv_events_ports: Optional[tuple[int, int]] = None  # every decode engine's, by Service
    kv_block_size: Optional[int] = None
    kv_tokenizer: Optional[str] = None
    kv_threshold: Optional[str] = None
    kv_load_cost: Optional[str] = None
    tenants_file: Optional[str] = None
    api_keys_file: Optional[str] = None
    model_rewrites_file: Optional[str] = None  # GIE's InferenceModelRewrite rules
    ca_file: Optional[str] = None
    any_name: bool = False
    extra_args: Sequence[str] = field(default_factory=tuple)


def gateway_argv(r: RouterLaunch) -> list[str]:
    s = r.serving
    argv = [*s.program, "gateway", "--host", s.host, "--port", str(s.port)]
    argv += ["--metrics-port", str(s.metrics_port)] if s.metrics_port is not None else []
    return argv + _routing(r) + _tls(s, ("--tls-cert-file", "--tls-key-file")) + _router_tail(r)


def epp_argv(r: RouterLaunch, health_port: int) -> list[str]:
    """`pdpool epp`: the gateway's routing behind Envoy's ext_proc (gRPC on serving.port)."""
    s = r.serving
    argv = [*s.program, "epp", "--host", s.host, "--port", str(s.port)]
    argv += ["--health-port", str(health_port)]
    argv += ["--metrics-port", str(s.metrics_port)] if s.metrics_port is not None else []
    return argv + _routing(r) + _router_tail(r)


def _routing(r: RouterLaunch) -> list[str]:
    argv = ["--decode-service", r.decode_service] if r.decode_service else []
    for url in r.decode_urls:
        argv += ["--decode-url", url]
    argv += _opt("--health-interval-s", r.health_interval_s)
    for source in r.kv_events:
        argv += ["--kv-events", source]
    if r.kv_events_ports is not None:
        pub, replay = r.kv_events_ports
        argv += ["--kv-events-port", str(pub), "--kv-events-replay-port", str(replay)]
    argv += _kv_index(r.kv_block_size, r.kv_tokenizer)
    argv += _opt("--kv-threshold", r.kv_threshold) + _opt("--kv-load-cost", r.kv_load_cost)
    argv += _opt("--tenants-file", r.tenants_file) + _opt("--api-keys-file", r.api_keys_file)
    return argv + _opt("--model-rewrites", r.model_rewrites_file)


def _router_tail(r: RouterLaunch) -> list[str]:
    return _client_tls(r.ca_file, r.any_name) + _tracing(r.serving) + list(r.extra_args)


def _kv_index(block_size: Optional[int], tokenizer: Optional[str]) -> list[str]:
    argv = ["--kv-block-size", str(block_size)] if block_size is not None else []
    return argv + _opt("--kv-tokenizer", tokenizer)


def last_flag_value(argv: Sequence[str], flag: str) -> Optional[str]:
    """The value the last `flag` of a command line gives (`--flag V` or `--flag=V`): what a
    parser that lets later flags win reads (None: not given)."""
    value = None
    for i, arg in enumerate(argv):
        if arg.startswith(flag + "="):
            value = arg.partition("=")[2]
        elif arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def _opt(flag: str, value: Optional[str]) -> list[str]:
    return [flag, value] if value is not None else []


def _tls(s: Serving, flags: tuple[str, str]) -> list[str]:
    return [flags[0], s.tls[0], flags[1], s.tls[1]] if s.tls else []


def _client_tls(ca_file: Optional[str], any_name: bool) -> list[str]:
    if not ca_file:
        return []
    return ["--tls-ca-file", ca_file] + (["--tls-any-name"] if any_name else [])


def _tracing(s: Serving) -> list[str]:
    # vLLM's flag: stock vLLM engines take it as ours
    endpoint = s.otlp_traces_endpoint
    return ["--otlp-traces-endpoint", endpoint] if endpoint else []
