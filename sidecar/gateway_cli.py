"""`pdpool gateway`: the entry point in front of the decode sidecars."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--decode-url", dest="decode_urls", action="append", default=[],
                   help="a decode sidecar (repeatable): HOST:PORT or http://HOST:PORT")
    p.add_argument("--decode-service",
                   help="HOST:PORT of a headless Service whose DNS lists the decode pods")
    p.add_argument("--prefix-chars", type=int, default=256,
                   help="prompt characters hashed for prefix affinity")
    p.add_argument("--balance", type=float, default=1.25,
                   help="load bound: a sidecar takes at most this times the average load")
    p.add_argument("--health-interval-s", type=float, default=2.0)
    p.add_argument("--log-level", default="warning")


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from pdpool.cli import CliError

    from .gateway import Gateway, GatewaySettings
    try:
        settings = GatewaySettings(decode_urls=args.decode_urls,
                                   decode_service=args.decode_service,
                                   prefix_chars=args.prefix_chars, balance=args.balance,
                                   health_interval_s=args.health_interval_s)
        app = Gateway(settings)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                access_log=False, lifespan="on")
    return 0
