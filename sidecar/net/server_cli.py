"""What `pdpool sidecar` and `pdpool gateway` share as servers: where they listen, their own
TLS certificate, their log level, and running the app under uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import copy
import socket
from typing import Any, Callable, Optional

from pdpool.glibc_malloc import unmap_large_frees
from pdpool import metrics_listener, tracing
from pdpool.start_up_gc import freeze_start_up_objects


def add_listen_arguments(
    p: argparse.ArgumentParser, port: int, service: str = "pdpool-gateway", host: str = "0.0.0.0"
) -> None:
    """`service`: the OpenTelemetry service name of the server's spans (OTEL_SERVICE_NAME
    wins)."""
    p.add_argument("--host", default=host)
    p.add_argument("--port", type=int, default=port)
    p.add_argument(
        "--tls-cert-file", help="serve HTTPS with this certificate (PEM; with --tls-key-file)"
    )
    p.add_argument("--tls-key-file", help="the certificate's private key (PEM)")
    p.add_argument("--log-level", default="warning")
    tracing.add_argument(p)
    p.set_defaults(otlp_service_name=service)


def serve(
    args: argparse.Namespace,
    build_app: Callable[..., Any],
    metrics_port: Optional[int] = None,
    workers: int = 1,
) -> int:
    """Checks the TLS flags, builds the app (which raises CliError on bad settings) and
    serves it until stopped; with `metrics_port`, /metrics alone there too
    (pdpool/metrics_listener.py). With `workers` > 1, that many processes share the ports
    (workers.py) and each builds its app as `build_app(worker)`."""
    from pdpool.errors import CliError

    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        raise CliError("--tls-cert-file and --tls-key-file go together")
    if workers > 1:
        from .workers import Worker, run_workers

        def run_one(worker: Worker, sockets: list[socket.socket]) -> int:
            real_metrics_port = sockets[1].getsockname()[1] if len(sockets) > 1 else None
            return _serve_app(args, lambda: build_app(worker), real_metrics_port, sockets)

        return run_workers(workers, args.host, args.port, metrics_port, run_one)
    listeners = metrics_listener.Listeners(args.host, args.port, metrics_port)
    return _serve_app(args, build_app, listeners.metrics_port, listeners.sockets, listeners)


def log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging, every line with its time, and the servers' own loggers (pdpool.*)
    through the same handler at `level`: a gateway's ejections and a sidecar's retries can be
    set beside the engines' logs and the clients' errors."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    for formatter in config["formatters"].values():
        formatter["fmt"] = "%(asctime)s " + formatter["fmt"]
    config["loggers"]["pdpool"] = {
        "handlers": ["default"],
        "level": level.upper(),
        "propagate": False,
    }
    return config


def _serve_app(
    args: argparse.Namespace,
    build_app: Callable[[], Any],
    metrics_port: Optional[int],
    sockets: list[socket.socket],
    listeners: Optional[metrics_listener.Listeners] = None,
) -> int:
    """Builds the app and serves it on `sockets` (none: uvicorn binds host:port itself)."""
    import uvicorn

    from pdpool.bounded_http import BoundedRequestHttp
    from pdpool.errors import CliError

    tracing.configure_or_exit(args.otlp_traces_endpoint, args.otlp_service_name)
    tls = (
        {"ssl_certfile": args.tls_cert_file, "ssl_keyfile": args.tls_key_file}
        if args.tls_cert_file
        else {}
    )
    app = build_app()
    if metrics_port is not None:
        app = metrics_listener.MetricsOnly(app, metrics_port)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        **tls,
        access_log=False,
        log_config=log_config(args.log_level),
        http=BoundedRequestHttp,
        lifespan="on",
        # Neither app reads the client's address: no X-Forwarded-For rewriting per request.
        proxy_headers=False,
    )
    config.load()  # imports the server's protocol and loop modules now: frozen below too
    freeze_start_up_objects()
    unmap_large_frees()  # memory read for large bodies goes back when they are done
    server = uvicorn.Server(config)
    with contextlib.suppress(KeyboardInterrupt):
        if listeners is not None:
            listeners.run(server)
        else:
            server.run(sockets=sockets or None)
    if not server.started:
        raise CliError(f"the server did not start on {args.host}:{args.port}")
    return 0
