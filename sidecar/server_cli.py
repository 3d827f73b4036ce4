"""What `pdpool sidecar` and `pdpool gateway` share as servers: where they listen, their own
TLS certificate, their log level, and running the app under uvicorn."""

from __future__ import annotations

import argparse
from typing import Any, Callable


def add_listen_arguments(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=port)
    p.add_argument(
        "--tls-cert-file", help="serve HTTPS with this certificate (PEM; with --tls-key-file)"
    )
    p.add_argument("--tls-key-file", help="the certificate's private key (PEM)")
    p.add_argument("--log-level", default="warning")


def serve(args: argparse.Namespace, build_app: Callable[[], Any]) -> int:
    """Checks the TLS flags, builds the app (which raises CliError on bad settings) and
    serves it until stopped."""
    import uvicorn

    from pdpool.errors import CliError

    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        raise CliError("--tls-cert-file and --tls-key-file go together")
    tls = (
        {"ssl_certfile": args.tls_cert_file, "ssl_keyfile": args.tls_key_file}
        if args.tls_cert_file
        else {}
    )
    app = build_app()
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        **tls,
        access_log=False,
        lifespan="on",
        # Neither app reads the client's address: no X-Forwarded-For rewriting per request.
        proxy_headers=False,
    )
    return 0
