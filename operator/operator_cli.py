"""`pdpool operator`: run the PDInferencePool operator (kopf) against a cluster.

Credentials: the pod's service account inside a cluster, else $KUBECONFIG / ~/.kube/config
(or --kubeconfig).
"""
from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", metavar="NS",
                       help="watch only this namespace (repeatable)")
    scope.add_argument("--all-namespaces", "-A", action="store_true",
                       help="watch every namespace (the default)")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster or $KUBECONFIG)")
    parser.add_argument("--health-port", type=int, default=0,
                        help="serve a liveness endpoint at :PORT/healthz (0: off)")
    parser.add_argument("--verbose", action="store_true", help="debug logging")


def main(args: argparse.Namespace) -> int:
    from pdpool.cli import CliError

    if args.kubeconfig:
        if not os.path.isfile(args.kubeconfig):
            raise CliError(f"kubeconfig {args.kubeconfig} does not exist")
        os.environ["KUBECONFIG"] = args.kubeconfig
    if not 0 <= args.health_port <= 65535:
        raise CliError(f"--health-port {args.health_port} is not a port")

    import kopf

    from . import handlers  # noqa: F401  (registers the handlers with kopf)

    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    namespaces = args.namespace or []
    liveness = f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None
    kopf.run(clusterwide=not namespaces, namespaces=namespaces, standalone=True,
             liveness_endpoint=liveness)
    return 0
