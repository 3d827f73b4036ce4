"""`pdpool sidecar`: the P/D proxy in front of one decode engine."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Optional

from pdpool import metrics_listener
from pdpool.settings_flags import add_flags, values_from_args

from ..net.server_cli import add_listen_arguments, serve

if TYPE_CHECKING:
    from .settings import SidecarSettings


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_listen_arguments(p, port=8000, service="pdpool-sidecar")
    p.add_argument(
        "--workers",
        default="auto",
        help="processes sharing the port (SO_REUSEPORT), so that a burst of arrivals is "
        "served on every core; auto (default): the usable cores, at most 4",
    )
    metrics_listener.add_argument(p)
    p.add_argument("--config", help="YAML or JSON file of settings (flags override it)")
    from .settings import SidecarSettings

    # not given: None, so that the file's value (else the field's default) stands
    add_flags(p, SidecarSettings, overlay=True)


def settings_from_args(args: argparse.Namespace) -> SidecarSettings:
    from pdpool.errors import CliError

    from .settings import SidecarSettings, build_settings, load_config_file

    try:
        file_values = load_config_file(args.config) if args.config else {}
        return build_settings(file_values, values_from_args(SidecarSettings, args, overlay=True))
    except (ValueError, TypeError) as exc:
        raise CliError(str(exc)) from None


def main(args: argparse.Namespace) -> int:
    from ..net.workers import Worker, parse_workers
    from .app import Sidecar, build_app

    settings = settings_from_args(args)
    workers = parse_workers(args.workers)

    def build(worker: Optional[Worker] = None) -> Any:
        app: Sidecar = build_app(settings)
        if worker is None:
            return app
        from ..net.worker_app import WorkerApp
        from .capability_share import CapabilityShare

        app.capability_share = CapabilityShare(worker.capability_file, worker.index == 0)
        return WorkerApp(app, worker, app.metrics.render)

    return serve(args, build, args.metrics_port, workers=workers)
