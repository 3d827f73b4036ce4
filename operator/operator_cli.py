"""`pdpool operator`: run the PDInferencePool operator (kopf) against a cluster.

Credentials: the pod's service account inside a cluster, else $KUBECONFIG / ~/.kube/config
(or --kubeconfig). `pdpool operator render -f POOL.yaml` prints the objects it would create
for a pool, without a cluster.
"""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        metavar="NS",
        help="watch only this namespace (repeatable)",
    )
    scope.add_argument(
        "--all-namespaces", "-A", action="store_true", help="watch every namespace (the default)"
    )
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster or $KUBECONFIG)")
    parser.add_argument(
        "--health-port",
        type=int,
        default=0,
        help="serve a liveness endpoint at :PORT/healthz (0: off)",
    )
    parser.add_argument(
        "--metrics-url-template",
        default="{scheme}://{ip}:{port}/metrics",
        help="where the autoscaling planner reads a pod's metrics: {scheme}, {ip}, {port}, "
        "{pod}, {namespace} are filled in (default: the pod IP's /metrics)",
    )
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    render = actions.add_parser(
        "render",
        help="print the objects made for a pool (no cluster)",
        description="print, as YAML, every object the operator makes "
        "for the PDInferencePool(s) in a file",
    )
    render.add_argument("-f", "--filename", required=True, help="pool manifest(s); - for stdin")
    render.add_argument(
        "--namespace",
        "-n",
        dest="render_namespace",
        default="default",
        help="namespace of pools whose metadata names none (default: default)",
    )


def main(args: argparse.Namespace) -> int:
    from pdpool.errors import CliError

    if getattr(args, "action", None) == "render":
        return _render(args)

    if args.kubeconfig:
        if not os.path.isfile(args.kubeconfig):
            raise CliError(f"kubeconfig {args.kubeconfig} does not exist")
        os.environ["KUBECONFIG"] = args.kubeconfig
    try:
        args.metrics_url_template.format(
            scheme="http", ip="10.0.0.1", port=1, pod="p", namespace="n"
        )
    except (KeyError, IndexError, ValueError) as exc:
        raise CliError(f"--metrics-url-template: unknown or malformed field {exc}") from None
    if not 0 <= args.health_port <= 65535:
        raise CliError(f"--health-port {args.health_port} is not a port")

    import kopf

    from . import handlers  # (importing registers the handlers with kopf)

    handlers.configure_autoscaler(args.metrics_url_template)

    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    namespaces = args.namespace or []
    liveness = f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None
    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=True,
        liveness_endpoint=liveness,
    )
    return 0


def _render(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    import yaml

    from pdpool.errors import CliError

    from .render import render_pools
    from .spec import SpecError

    try:
        text = sys.stdin.read() if args.filename == "-" else Path(args.filename).read_text()
        docs = list(yaml.safe_load_all(text))
    except OSError as exc:
        raise CliError(f"{args.filename}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise CliError(f"{args.filename}: not YAML ({exc})") from None
    try:
        manifests = render_pools(docs, args.render_namespace)
    except SpecError as exc:
        raise CliError(f"{args.filename}: {exc}") from None
    sys.stdout.write(yaml.safe_dump_all(manifests, sort_keys=False))
    return 0
