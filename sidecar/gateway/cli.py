"""`pdpool gateway`: the entry point in front of the decode sidecars."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pdpool import metrics_listener
from pdpool.cli import add_switch

from ..net.server_cli import add_listen_arguments, serve
from ..routing.cli_args import add_routing_arguments, routing_settings_kwargs

if TYPE_CHECKING:
    from .app import Gateway


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_listen_arguments(p, port=8080)
    metrics_listener.add_argument(p)
    add_routing_arguments(p)
    add_switch(p, "--migrate", True, "continue broken streams on another sidecar")
    p.add_argument(
        "--stall-timeout-s",
        type=float,
        default=20.0,
        help="a stream silent this long mid-way is treated as broken",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=16,
        help="the engines' default max_tokens (for continuing requests that set none)",
    )
    p.add_argument(
        "--max-body-bytes",
        default="32MiB",
        help="request bodies above this size get 413 (default 32MiB)",
    )
    p.add_argument(
        "--api-keys-file",
        help="file of API keys, one per line (>= 16 characters): clients must "
        "send one (Authorization: Bearer KEY); re-read when it changes",
    )
    p.add_argument(
        "--tls-ca-file", help="reach the sidecars over HTTPS, verified against this CA bundle"
    )
    add_switch(
        p,
        "--tls-any-name",
        False,
        "with --tls-ca-file: accept any certificate that CA signed, whatever "
        "its name (a CA dedicated to the pool; sidecars are reached by pod IP)",
    )


def main(args: argparse.Namespace) -> int:
    return serve(args, lambda: _build_gateway(args), args.metrics_port)


def _build_gateway(args: argparse.Namespace) -> Gateway:
    from pdpool.errors import CliError
    from pdpool.units import parse_size

    from .app import Gateway, GatewaySettings

    try:
        settings = GatewaySettings(
            **routing_settings_kwargs(args),
            migrate=args.migrate,
            stall_timeout_s=args.stall_timeout_s,
            default_max_tokens=args.default_max_tokens,
            max_body_bytes=parse_size(args.max_body_bytes),
            api_keys_file=args.api_keys_file,
            tls_ca_file=args.tls_ca_file,
            tls_any_name=args.tls_any_name,
        )
        return Gateway(settings)
    except (ValueError, OSError) as exc:
        raise CliError(str(exc)) from None
