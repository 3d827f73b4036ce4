"""`pdpool serve MODEL_DIR`: one engine with its OpenAI-compatible server."""

from __future__ import annotations

import argparse
import logging
from typing import Any, Optional

from pdpool import metrics_listener, tracing
from pdpool.cli import CliError, add_switch
from pdpool.engine.structured import flags as structured_flags


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL_DIR", help="a Hugging Face checkpoint folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    metrics_listener.add_argument(p)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory", default=None, help="e.g. 512MiB, 4GiB")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="vLLM's: fcfs (arrival order; a request's priority is ignored) or priority "
        "(waiting requests by their `priority`, lower first, then arrival; when blocks run "
        "out the lowest-priority running request is preempted)",
    )
    add_switch(p, "--enable-chunked-prefill", True, "split long prompts over steps (default)")
    add_switch(p, "--enable-prefix-caching", True, "reuse cached prompt blocks (default)")
    add_switch(
        p,
        "--prefix-aware-admission",
        True,
        "count cached blocks when admitting (default); --no-prefix-aware-admission admits as "
        "if nothing were cached (only to measure what awareness brings)",
    )
    p.add_argument("--global-cache-hit-threshold", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch threads on CPU (default: $OMP_NUM_THREADS if set, else every usable "
        "core but one, which the HTTP server keeps; a cgroup CPU limit counts)",
    )
    p.add_argument(
        "--cpu-prefill-threads",
        type=int,
        default=None,
        help="torch threads on CPU for steps that compute 256 or more prompt tokens "
        "(default: --cpu-threads if given, else $OMP_NUM_THREADS if set, else every usable "
        "core with the engine in its own process, one fewer without)",
    )
    p.add_argument("--kv-connector", default="none", choices=["none", "nixl"])
    p.add_argument("--kv-role", default="both", choices=["producer", "consumer", "both"])
    p.add_argument(
        "--kv-host",
        default="127.0.0.1",
        help="address advertised to peers for KV transfer (the pod IP)",
    )
    p.add_argument("--kv-port", type=int, default=0, help="KV handshake port (0: pick one)")
    p.add_argument(
        "--kv-peer-allowlist",
        default="",
        help="comma-separated hosts or CIDRs this engine may pull KV from",
    )
    p.add_argument(
        "--kv-pull-threshold",
        type=int,
        default=0,
        help="pull a remote prefix only when it saves at least this many tokens",
    )
    p.add_argument("--kv-load-failure-policy", default="recompute", choices=["recompute", "fail"])
    p.add_argument(
        "--kv-producer-timeout",
        type=float,
        default=10.0,
        help="seconds a lease holds KV for a peer unless the peer renews it "
        "(its request is queued) or releases it (read done, or no pull)",
    )
    p.add_argument(
        "--kv-secret-file",
        default=None,
        help="the pool's secret for signing and checking kv_transfer_params and the "
        "shared offload tier's records (else $PDPOOL_KV_SECRET_FILE or $PDPOOL_KV_SECRET; "
        "without one, loads are checked by content alone; the shared tier refuses to start)",
    )
    p.add_argument(
        "--kv-load-timeout",
        type=float,
        default=30.0,
        help="seconds a consumer waits for a READ before computing locally",
    )
    p.add_argument(
        "--max-body-bytes",
        default="32MiB",
        help="request bodies above this size get 413, checked while they arrive "
        "(default 32MiB: a 10 MB prompt fits)",
    )
    p.add_argument(
        "--ready-max-stall-s",
        type=float,
        default=30.0,
        help="/ready answers 503 when the engine loop has work and has not "
        "ticked for this long (/health is liveness only)",
    )
    structured_flags.add_arguments(p)
    p.add_argument("--tls-cert-file", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key-file", help="the certificate's private key (PEM)")
    p.add_argument(
        "--kv-events-config",
        default=None,
        help="vLLM's KV cache events config (JSON), e.g. '{\"enable_kv_cache_events\":"
        ' true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}\'',
    )
    p.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        help="vLLM's: GiB of KV offload tier below the block pool (off unless given); "
        "blocks are written through to it and a prefix it holds is loaded, not recomputed",
    )
    p.add_argument(
        "--kv-offloading-backend",
        default="native",
        choices=["native", "disk", "shared"],
        help="native (vLLM's default): host memory; disk: a directory of this engine's (an "
        "emptyDir); shared: a directory every engine of the pool mounts (a PVC), so one "
        "engine's prefix is a hit for all",
    )
    p.add_argument("--kv-offloading-path", default=None, help="the offload tier's directory")
    add_switch(
        p,
        "--kv-offloading-fsync",
        False,
        "fsync each record (durable across power loss; off by default: every read checks "
        "the record's digest, so a torn one is a miss)",
    )
    add_lora_arguments(p)
    add_switch(
        p,
        "--engine-process",
        True,
        "run the engine loop in a process of its own, as vLLM runs its EngineCore, so "
        "that HTTP and streaming never wait for the model's GIL (default); "
        "--no-engine-process keeps it on a thread of the server's process",
    )
    p.add_argument("--log-level", default="info")
    tracing.add_argument(p)


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    """vLLM's LoRA flags, and where runtime loads may read adapters from."""
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    p.add_argument(
        "--lora-modules",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="adapters to serve, as name=path or vLLM's JSON "
        '\'{"name": "a", "path": "/adapters/a"}\' (repeatable); requests pick one by `model`',
    )
    p.add_argument("--max-loras", type=int, default=1, help="distinct adapters in one step's batch")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank")
    p.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept in memory (default: --max-loras)",
    )
    p.add_argument(
        "--lora-allowed-dir",
        action="append",
        default=[],
        help="a folder /v1/load_lora_adapter may load adapters from (repeatable; runtime "
        "loads need VLLM_ALLOW_RUNTIME_LORA_UPDATING=true and at least one)",
    )


def prefill_threads(args: argparse.Namespace) -> Optional[int]:
    """--cpu-prefill-threads; else --cpu-threads (one count for every step); else the
    policy's."""
    from pdpool.engine.cpu_threads import serving_prefill_threads

    if args.cpu_prefill_threads is not None:
        return args.cpu_prefill_threads
    if args.cpu_threads is not None:
        return args.cpu_threads
    return serving_prefill_threads(engine_process=args.engine_process)


def config_from_args(args: argparse.Namespace):
    from pdpool.engine.config import EngineConfig, parse_size
    from pdpool.engine.cpu_threads import serving_cpu_threads

    try:
        memory = parse_size(args.kv_cache_memory) if args.kv_cache_memory else None
        max_body = parse_size(args.max_body_bytes)
        structured = structured_flags.config_kwargs(args)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=memory,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        scheduling_policy=args.scheduling_policy,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_aware_admission=args.prefix_aware_admission,
        global_cache_hit_threshold=args.global_cache_hit_threshold,
        seed=args.seed,
        cpu_threads=serving_cpu_threads() if args.cpu_threads is None else args.cpu_threads,
        cpu_prefill_threads=prefill_threads(args),
        kv_connector=args.kv_connector,
        kv_role=args.kv_role,
        kv_host=args.kv_host,
        kv_port=args.kv_port,
        kv_peer_allowlist=[h.strip() for h in args.kv_peer_allowlist.split(",") if h.strip()],
        kv_pull_threshold=args.kv_pull_threshold,
        kv_load_failure_policy=args.kv_load_failure_policy,
        kv_producer_timeout=args.kv_producer_timeout,
        kv_load_timeout=args.kv_load_timeout,
        kv_secret_file=args.kv_secret_file,
        max_body_bytes=max_body,
        ready_max_stall_s=args.ready_max_stall_s,
        kv_events_config=getattr(args, "kv_events_config", None),
        kv_offloading_size=args.kv_offloading_size,
        kv_offloading_backend=args.kv_offloading_backend,
        kv_offloading_path=args.kv_offloading_path,
        kv_offloading_fsync=args.kv_offloading_fsync,
        enable_lora=args.enable_lora,
        lora_modules=list(args.lora_modules),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        lora_allowed_dirs=list(args.lora_allowed_dir),
        **structured,
    )


def start_engine(config, own_process: bool, log_level: str):
    """The engine, loaded and ready to serve: in a child process or on a thread of this one."""
    from pdpool.engine.core_client import InProcessClient
    from pdpool.engine.core_process import EngineStartError
    from pdpool.engine.core_process_client import CoreProcessClient
    from pdpool.engine.model_info import ModelLoadError

    try:
        config.validate()  # here, before a process is started for nothing
        if own_process:
            return CoreProcessClient(config, log_level)
        from pdpool.engine.engine_core import LLMEngine

        return InProcessClient(LLMEngine(config))
    except (ModelLoadError, EngineStartError, ValueError, OSError) as exc:
        raise CliError(str(exc)) from exc


def adapters_or_exit(aengine):
    """--lora-modules, read and checked; a bad adapter stops the start with its reason."""
    if not aengine.view.config.enable_lora:
        return None
    from pdpool.engine.lora.registry import registry_from_config

    try:
        return registry_from_config(aengine.view.config, aengine.view.model_name)
    except (ValueError, OSError) as exc:
        aengine.shutdown()
        raise CliError(f"--lora-modules: {exc}") from exc


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = config_from_args(args)
    if config.device != "cuda":
        from pdpool.engine.cpu_threads import quiet_openmp_spin

        quiet_openmp_spin()
    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        raise CliError("--tls-cert-file and --tls-key-file go together")
    import uvicorn

    from pdpool.engine.server.api import build_app

    aengine = start_engine(config, args.engine_process, args.log_level)
    app: Any = build_app(aengine, adapters_or_exit(aengine))
    try:
        # After the core process started: it never exports spans (the server emits them).
        if tracing.configure_or_exit(args.otlp_traces_endpoint, "pdpool-engine"):
            from pdpool.engine.server.request_spans import (
                TraceContextMiddleware,
                emit_request_spans,
            )

            app.state.metrics.on_finished = emit_request_spans
            app = TraceContextMiddleware(app)
        tls = (
            {"ssl_certfile": args.tls_cert_file, "ssl_keyfile": args.tls_key_file}
            if args.tls_cert_file
            else {}
        )
        listeners = metrics_listener.Listeners(args.host, args.port, args.metrics_port)
        server = uvicorn.Server(
            uvicorn.Config(
                listeners.wrap(app),
                host=args.host,
                port=args.port,
                log_level=args.log_level.lower(),
                timeout_graceful_shutdown=5,
                **tls,
            )
        )
        # An engine that gives up stops the server as a signal would (drain, then stop),
        # without a signal: the exit status then says why.
        aengine.stop_server = lambda: setattr(server, "should_exit", True)
        listeners.run(server)
    finally:
        aengine.shutdown()
    fatal = getattr(aengine, "fatal", None)
    if fatal:  # the engine core kept dying: the supervisor starts this server afresh
        raise CliError(fatal)
    return 0
