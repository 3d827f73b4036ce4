"""`pdpool serve MODEL_DIR`: one engine with its OpenAI-compatible server."""

from __future__ import annotations

import argparse
import logging
from typing import Any, Optional

from pdpool import metrics_listener, tracing
from pdpool.cli import CliError, add_switch
from pdpool.settings_flags import add_flags, values_from_args
from pdpool.start_up_gc import freeze_start_up_objects


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The server's own flags, then one per EngineConfig setting (its default, type and help
    are the field's: engine/config.py)."""
    from pdpool.engine.config import EngineConfig

    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    metrics_listener.add_argument(p)
    add_flags(p, EngineConfig)
    p.add_argument("--tls-cert-file", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key-file", help="the certificate's private key (PEM)")
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
    """EngineConfig from the flags (CliError for a value its flag cannot read); the CPU
    thread counts the flags leave open are this machine's (cpu_threads.py)."""
    from pdpool.engine.config import EngineConfig
    from pdpool.engine.cpu_threads import serving_cpu_threads

    try:
        values = values_from_args(EngineConfig, args)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    if values["cpu_threads"] is None:
        values["cpu_threads"] = serving_cpu_threads()
    values["cpu_prefill_threads"] = prefill_threads(args)
    return EngineConfig(**values)


def start_engine(config, own_process: bool, log_level: str):
    """The engine, loaded and ready to serve: in a child process or on a thread of this one."""
    from pdpool.engine.core_client import InProcessClient
    from pdpool.engine.cpu_memory import keep_freed_memory
    from pdpool.engine.core_process import EngineStartError
    from pdpool.engine.core_process_client import CoreProcessClient
    from pdpool.engine.model_info import ModelLoadError
    from pdpool.glibc_malloc import unmap_large_frees

    try:
        config.validate()  # here, before a process is started for nothing
        if own_process:
            client = CoreProcessClient(config, log_level)
            # After the core started: it keeps its freed memory; this process relays requests.
            unmap_large_frees()
            return client
        from pdpool.engine.engine_core import LLMEngine

        if config.device != "cuda":
            keep_freed_memory()
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

    from pdpool.bounded_http import BoundedRequestHttp
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
                http=BoundedRequestHttp,
                **tls,
            )
        )
        # An engine that gives up stops the server as a signal would (drain, then stop),
        # without a signal: the exit status then says why.
        aengine.stop_server = lambda: setattr(server, "should_exit", True)
        freeze_start_up_objects()
        listeners.run(server)
    finally:
        aengine.shutdown()
    fatal = getattr(aengine, "fatal", None)
    if fatal:  # the engine core kept dying: the supervisor starts this server afresh
        raise CliError(fatal)
    return 0
