"""`pdpool gateway`: the entry point in front of the decode sidecars."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pdpool.cli import add_switch

from ..net.server_cli import add_listen_arguments, serve
from ..routing.cli_args import add_flow_arguments

if TYPE_CHECKING:
    from .app import Gateway


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_listen_arguments(p, port=8080)
    p.add_argument(
        "--decode-url",
        dest="decode_urls",
        action="append",
        default=[],
        help="a decode sidecar (repeatable): HOST:PORT or http://HOST:PORT",
    )
    p.add_argument(
        "--decode-service", help="HOST:PORT of a headless Service whose DNS lists the decode pods"
    )
    p.add_argument(
        "--prefix-chars", type=int, default=256, help="prompt characters hashed for prefix affinity"
    )
    p.add_argument(
        "--balance",
        type=float,
        default=1.25,
        help="load bound: a sidecar takes at most this times the average load",
    )
    p.add_argument("--health-interval-s", type=float, default=2.0)
    p.add_argument(
        "--probe-timeout-s",
        type=float,
        default=3.0,
        help="health probe timeout; a failed probe ejects the sidecar",
    )
    p.add_argument(
        "--outlier-failures",
        type=int,
        default=3,
        help="failed requests in a row that eject a sidecar",
    )
    p.add_argument(
        "--ejection-s",
        type=float,
        default=2.0,
        help="base ejection time (times the recent ejections, at most 30 s)",
    )
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
    add_flow_arguments(p)
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
    p.add_argument(
        "--kv-events",
        action="append",
        default=[],
        metavar="URL=ENDPOINT[|REPLAY]",
        help="precise KV-aware routing: the decode sidecar URL and its engine's KV "
        "events endpoint (vLLM --kv-events-config), e.g. "
        "http://10.0.0.5:8000=tcp://10.0.0.5:5557|tcp://10.0.0.5:5558 "
        "(repeatable; sidecars without one keep hash affinity)",
    )
    p.add_argument(
        "--kv-events-port",
        type=int,
        default=None,
        help="precise KV-aware routing that follows --decode-service: each "
        "sidecar's engine (same pod IP) publishes its KV events on this port "
        "(its --kv-events-config tcp://*:PORT)",
    )
    p.add_argument(
        "--kv-events-replay-port",
        type=int,
        default=None,
        help="with --kv-events-port: the engines' replay port",
    )
    p.add_argument(
        "--kv-block-size",
        type=int,
        default=16,
        help="the engines' KV block size (their --block-size)",
    )
    p.add_argument(
        "--kv-tokenizer",
        default=None,
        help="the model's tokenizer.json, to route string prompts precisely",
    )
    add_switch(
        p,
        "--kv-engine-tokenize",
        True,
        "ask a decode engine's /tokenize for prompts this gateway cannot tokenize (chats; "
        "strings without --kv-tokenizer); --no-kv-engine-tokenize: those keep hash affinity",
    )
    p.add_argument(
        "--kv-threshold",
        type=float,
        default=0.0,
        help="predicted hit ratio below which requests go P/D up front "
        "(the pool's cache-hit threshold)",
    )
    p.add_argument(
        "--kv-load-cost",
        type=float,
        default=64.0,
        help="cost of one in-flight request on a sidecar, in prompt tokens",
    )


def main(args: argparse.Namespace) -> int:
    return serve(args, lambda: _build_gateway(args))


def _build_gateway(args: argparse.Namespace) -> Gateway:
    from pdpool.errors import CliError
    from pdpool.units import parse_size

    from .app import Gateway, GatewaySettings
    from ..routing.kv_events_spec import parse_kv_events

    try:
        settings = GatewaySettings(
            decode_urls=args.decode_urls,
            decode_service=args.decode_service,
            prefix_chars=args.prefix_chars,
            balance=args.balance,
            health_interval_s=args.health_interval_s,
            probe_timeout_s=args.probe_timeout_s,
            outlier_failures=args.outlier_failures,
            ejection_s=args.ejection_s,
            migrate=args.migrate,
            stall_timeout_s=args.stall_timeout_s,
            default_max_tokens=args.default_max_tokens,
            max_body_bytes=parse_size(args.max_body_bytes),
            api_keys_file=args.api_keys_file,
            tenants_file=args.tenants_file,
            tenant_header=args.tenant_header,
            tls_ca_file=args.tls_ca_file,
            tls_any_name=args.tls_any_name,
            kv_events=parse_kv_events(args.kv_events, "--kv-events"),
            kv_block_size=args.kv_block_size,
            kv_tokenizer=args.kv_tokenizer,
            kv_engine_tokenize=args.kv_engine_tokenize,
            kv_threshold=args.kv_threshold,
            kv_load_cost=args.kv_load_cost,
            kv_events_port=args.kv_events_port,
            kv_events_replay_port=args.kv_events_replay_port,
        )
        return Gateway(settings)
    except (ValueError, OSError) as exc:
        raise CliError(str(exc)) from None
