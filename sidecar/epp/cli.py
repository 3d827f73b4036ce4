"""`pdpool epp`: the Gateway API Inference Extension endpoint picker (Envoy ext_proc)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pdpool.settings_flags import add_flags, values_from_args

from ..net.server_cli import add_listen_arguments, serve
from .settings import EppSettings

if TYPE_CHECKING:
    from .server import EndpointPicker


def add_arguments(p: argparse.ArgumentParser) -> None:
    # GIE's ports: ext_proc on --port (9002), the gRPC health service on --health-port
    # (9003, also on --port), HTTP /metrics and /health on --metrics-port (9090).
    defaults = EppSettings()
    add_listen_arguments(p, port=defaults.grpc_port, service="pdpool-epp", host=defaults.grpc_host)
    p.add_argument("--metrics-port", type=int, default=9090, help="HTTP /metrics and /health port")
    add_flags(p, EppSettings)


def main(args: argparse.Namespace) -> int:
    # The HTTP server (metrics, health) is the one `serve` runs; gRPC starts with it.
    http = argparse.Namespace(**{**vars(args), "port": args.metrics_port})
    return serve(http, lambda: _build(args))


def _build(args: argparse.Namespace) -> EndpointPicker:
    from pdpool.errors import CliError

    from .server import EndpointPicker

    try:
        settings = EppSettings(
            **values_from_args(EppSettings, args), grpc_host=args.host, grpc_port=args.port
        )
        settings.validate()
        return EndpointPicker(settings)
    except (ValueError, OSError) as exc:
        raise CliError(str(exc)) from None
