"""`pdpool serve`'s structured-output flags: the spec caps (limits.py) and the grammar
compile bounds (compile_jobs.py), read into EngineConfig's fields."""

from __future__ import annotations

import argparse
from typing import Any

from pdpool.engine.structured.limits import StructuredLimits
from pdpool.units import parse_size

_CAPS = {
    "max_bytes": "bytes of a spec's text (schema JSON, regex, grammar, the choices together)",
    "max_properties": "object properties in a JSON schema, all objects together",
    "max_depth": "levels of nesting (objects and arrays) in a JSON schema",
    "max_enum_values": "enum and const values in a JSON schema, all together",
    "max_choices": "guided_choice alternatives",
    "max_pattern_chars": "characters of a regex (guided_regex, or a schema's pattern)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    defaults = StructuredLimits()
    for name, what in _CAPS.items():
        p.add_argument(
            f"--structured-{name.replace('_', '-')}",
            type=int,
            default=getattr(defaults, name),
            help=f"structured outputs: at most this many {what}; above it, 400 (default "
            f"%(default)s)",
        )
    p.add_argument(
        "--structured-compile-timeout-s",
        type=float,
        default=30.0,
        help="a guided request whose grammar has not compiled in this time gets 400 (the "
        "compile runs on unattended; see --structured-max-overrun-compiles)",
    )
    p.add_argument(
        "--structured-max-compiles",
        type=int,
        default=2,
        help="grammar compiles at once; more wait for a slot (default %(default)s)",
    )
    p.add_argument(
        "--structured-max-overrun-compiles",
        type=int,
        default=2,
        help="compiles past their deadline that may run on; while that many do, new guided "
        "requests get 503 (default %(default)s)",
    )
    p.add_argument(
        "--structured-cache-bytes",
        default="256MiB",
        help="memory for compiled grammars, least recently used leave first (default 256MiB)",
    )


def config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's structured-output fields from the flags (ValueError for a bad size)."""
    limits = StructuredLimits(**{name: getattr(args, f"structured_{name}") for name in _CAPS})
    return {
        "structured_limits": limits,
        "structured_compile_timeout_s": args.structured_compile_timeout_s,
        "structured_max_compiles": args.structured_max_compiles,
        "structured_max_overrun_compiles": args.structured_max_overrun_compiles,
        "structured_cache_bytes": parse_size(args.structured_cache_bytes),
    }
