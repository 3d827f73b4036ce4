"""`pdpool gateway`: the entry point in front of the decode sidecars."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pdpool import metrics_listener
from pdpool.settings_flags import add_flags, values_from_args

from ..net.server_cli import add_listen_arguments, serve
from .settings import GatewaySettings

if TYPE_CHECKING:
    from .app import Gateway


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Where it listens, then a flag per GatewaySettings setting (settings.py: the routing
    core's, then the gateway's own)."""
    add_listen_arguments(p, port=8080)
    metrics_listener.add_argument(p)
    add_flags(p, GatewaySettings)


def main(args: argparse.Namespace) -> int:
    return serve(args, lambda: _build_gateway(args), args.metrics_port)


def _build_gateway(args: argparse.Namespace) -> Gateway:
    from pdpool.errors import CliError

    from .app import Gateway

    try:
        return Gateway(GatewaySettings(**values_from_args(GatewaySettings, args)))
    except (ValueError, OSError) as exc:
        raise CliError(str(exc)) from None
