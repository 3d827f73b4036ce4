"""The `pdpool` console script.

Each subcommand lives in its own module that exposes `add_arguments(parser)` and
`main(args) -> int`. Those modules import heavy dependencies (torch, kopf) only inside
`main`, so `pdpool --help` and the sidecar/operator commands never load torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

from pdpool.errors import CliError

# name -> (module, one-line help)
COMMANDS = {
    "tiny-model": ("pdpool.engine.tiny_model_cli", "write a small random-weight HF checkpoint"),
    "serve": ("pdpool.engine.serve_cli", "run one engine with its OpenAI-compatible server"),
    "sidecar": ("pdpool.sidecar.proxy.cli", "run the P/D proxy in front of a decode engine"),
    "gateway": ("pdpool.sidecar.gateway.cli", "run the gateway in front of decode sidecars"),
    "epp": (
        "pdpool.sidecar.epp.cli",
        "run the Gateway API Inference Extension endpoint picker (Envoy ext_proc)",
    ),
    "up": ("pdpool.up.cli", "run the whole P/D topology as local processes"),
    "operator": ("pdpool.operator.operator_cli", "run the Kubernetes operator"),
}


def add_switch(
    parser: argparse._ActionsContainer, flag: str, default: Optional[bool], help: str
) -> None:
    """An on/off option, spelled one way in every command: `--X` turns it on, `--no-X`
    off (argparse's BooleanOptionalAction, as vLLM's switches). `default` None leaves it
    unset, so that a config file's value stands unless a flag is given."""
    parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdpool", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            # A part not built (or not installed) yet still shows up in --help.
            p.set_defaults(_module=None, _missing=module_name)
            continue
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    if args._module is None:
        print(
            f"pdpool {args.command}: not available ({args._missing} is not installed)",
            file=sys.stderr,
        )
        return 2
    try:
        return int(args._module.main(args) or 0)
    except KeyboardInterrupt:
        return 130
    except CliError as exc:
        print(f"pdpool {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
