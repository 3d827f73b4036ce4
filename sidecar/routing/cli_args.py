"""The routing core's flags, for a front-end's command line: generated from RoutingSettings
(sidecar/routing/settings.py), so they have one spelling, one meaning and one default wherever
routing runs."""

from __future__ import annotations

import argparse
from typing import Any

from pdpool.settings_flags import add_flags, values_from_args

from .settings import RoutingSettings


def add_routing_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, RoutingSettings)


def routing_settings_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """RoutingSettings' fields from the parsed flags (raises ValueError on a bad --kv-events)."""
    return values_from_args(RoutingSettings, args)
