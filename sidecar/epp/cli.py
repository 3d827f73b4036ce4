"""`pdpool epp`: the Gateway API Inference Extension endpoint picker (Envoy ext_proc)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pdpool.cli import add_switch

from ..net.server_cli import add_listen_arguments, serve
from ..routing.cli_args import add_routing_arguments, routing_settings_kwargs

if TYPE_CHECKING:
    from .server import EndpointPicker


def add_arguments(p: argparse.ArgumentParser) -> None:
    # GIE's ports: ext_proc on --port (9002), the gRPC health service on --health-port
    # (9003, also on --port), HTTP /metrics and /health on --metrics-port (9090).
    add_listen_arguments(p, port=9002, service="pdpool-epp")
    p.add_argument("--health-port", type=int, default=9003, help="gRPC health service port")
    p.add_argument("--metrics-port", type=int, default=9090, help="HTTP /metrics and /health port")
    add_routing_arguments(p)
    p.add_argument(
        "--max-body-bytes", default="32MiB", help="request bodies above this size get 413"
    )
    p.add_argument(
        "--tls-ca-file", help="reach the sidecars over HTTPS, verified against this CA bundle"
    )
    add_switch(p, "--tls-any-name", False, "accept any certificate the CA signed")
    add_switch(
        p,
        "--test-endpoint-selection",
        False,
        "honour GIE's conformance header test-epp-endpoint-selection (tests only: it lets "
        "a client choose the endpoint)",
    )


def main(args: argparse.Namespace) -> int:
    # The HTTP server (metrics, health) is the one `serve` runs; gRPC starts with it.
    http = argparse.Namespace(**{**vars(args), "port": args.metrics_port})
    return serve(http, lambda: _build(args))


def _build(args: argparse.Namespace) -> EndpointPicker:
    from pdpool.errors import CliError
    from pdpool.units import parse_size

    from .server import EndpointPicker, EppSettings

    try:
        settings = EppSettings(
            **routing_settings_kwargs(args),
            grpc_host=args.host,
            grpc_port=args.port,
            health_port=args.health_port,
            max_body_bytes=parse_size(args.max_body_bytes),
            tls_ca_file=args.tls_ca_file,
            tls_any_name=args.tls_any_name,
            test_endpoint_selection=args.test_endpoint_selection,
        )
        settings.validate_routing()
        return EndpointPicker(settings)
    except (ValueError, OSError) as exc:
        raise CliError(str(exc)) from None
