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
    # --host/--port: HTTP /health and /metrics; --grpc-port: ext_proc and gRPC health.
    add_listen_arguments(p, port=9003, service="pdpool-epp")
    p.add_argument("--grpc-host", default="0.0.0.0")
    p.add_argument(
        "--grpc-port", type=int, default=9002, help="the ext_proc gRPC port (GIE's default 9002)"
    )
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
    return serve(args, lambda: _build(args))


def _build(args: argparse.Namespace) -> EndpointPicker:
    from pdpool.errors import CliError
    from pdpool.units import parse_size

    from .server import EndpointPicker, EppSettings

    try:
        settings = EppSettings(
            **routing_settings_kwargs(args),
            grpc_host=args.grpc_host,
            grpc_port=args.grpc_port,
            max_body_bytes=parse_size(args.max_body_bytes),
            tls_ca_file=args.tls_ca_file,
            tls_any_name=args.tls_any_name,
            test_endpoint_selection=args.test_endpoint_selection,
        )
        settings.validate_routing()
        return EndpointPicker(settings)
    except (ValueError, OSError) as exc:
        raise CliError(str(exc)) from None
