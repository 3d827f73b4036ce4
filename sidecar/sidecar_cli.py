"""`pdpool sidecar`: the P/D proxy in front of one decode engine."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .settings import SidecarSettings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--config", help="YAML or JSON file of settings (flags override it)")
    p.add_argument("--decode-url", help="the local decode engine, e.g. http://127.0.0.1:8001")
    p.add_argument(
        "--prefill-url",
        dest="prefill_urls",
        action="append",
        help="a prefill engine (repeatable): HOST:PORT or http://HOST:PORT",
    )
    p.add_argument(
        "--prefill-service", help="HOST:PORT of a headless Service whose DNS lists the prefill pods"
    )
    p.add_argument("--prefill-refresh-s", type=float, help="DNS refresh period (default 5)")
    p.add_argument("--mode", choices=("decode-first", "prefill-first", "aggregated"))
    p.add_argument(
        "--cache-hit-threshold",
        type=float,
        help="pool threshold for decode-first (a request's own value wins)",
    )
    p.add_argument("--prefill-timeout", type=float, help="seconds per prefill attempt")
    p.add_argument(
        "--decode-retry-s",
        type=float,
        help="how long to retry an unreachable decode engine (default 5)",
    )
    p.add_argument(
        "--no-pull-from-decode",
        dest="pull_from_decode",
        action="store_const",
        const=False,
        help="do not let prefill pull decode's cached prefix",
    )
    p.add_argument(
        "--kv-pull-threshold",
        type=int,
        help="offer decode's cached prefix to prefill only when it holds at "
        "least this many tokens (default 0)",
    )
    p.add_argument(
        "--probe-interval-s",
        type=float,
        help="health probe period of each prefill engine (default 1; 0: off)",
    )
    p.add_argument("--probe-timeout-s", type=float, help="health probe timeout (default 2)")
    p.add_argument(
        "--outlier-failures",
        type=int,
        help="consecutive failed prefill legs that eject an engine (default 3)",
    )
    p.add_argument(
        "--ejection-s", type=float, help="base ejection time of a sick prefill engine (default 2)"
    )
    p.add_argument(
        "--max-body-bytes", help="request bodies above this size get 413 (default 32MiB)"
    )
    p.add_argument(
        "--engine-rejects",
        choices=("auto", "yes", "no"),
        help="does the decode engine honour cache_hit_threshold (pdpool serve: "
        "yes; stock vLLM: no)? auto (default) probes it once",
    )
    p.add_argument(
        "--prefill-min-prompt-tokens",
        type=int,
        help="decode-first with an engine that cannot reject: prompts of at "
        "least this many tokens (estimated: characters / 4) go "
        "prefill-first, shorter ones to decode only (default 128)",
    )
    p.add_argument("--tls-cert-file", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key-file", help="the certificate's private key (PEM)")
    p.add_argument(
        "--tls-ca-file",
        help="reach prefill engines over HTTPS and verify every upstream (the "
        "decode engine too, when --decode-url is https://) against this CA",
    )
    p.add_argument(
        "--tls-any-name",
        action="store_const",
        const=True,
        help="with --tls-ca-file: accept any certificate that CA signed, whatever "
        "its name (a CA dedicated to the pool; peers are reached by pod IP)",
    )
    p.add_argument(
        "--prefill-kv-events",
        action="append",
        metavar="HOST:PORT=ENDPOINT[|REPLAY]",
        help="a prefill engine and its KV events endpoint (vLLM "
        "--kv-events-config), e.g. 10.0.0.7:8000=tcp://10.0.0.7:5557 "
        "(repeatable): legs go to the engine with the most of the prompt "
        "cached",
    )
    p.add_argument(
        "--prefill-kv-events-port",
        type=int,
        help="the same, following --prefill-service: every prefill engine "
        "publishes its KV events on this port (--kv-events-config tcp://*:PORT)",
    )
    p.add_argument(
        "--prefill-kv-events-replay-port",
        type=int,
        help="with --prefill-kv-events-port: the prefill engines' replay port",
    )
    p.add_argument("--kv-block-size", type=int, help="the engines' KV block size (default 16)")
    p.add_argument("--kv-tokenizer", help="the model's tokenizer.json (string prompts)")
    p.add_argument("--log-level", default="warning")


SETTING_FLAGS = (
    "decode_url",
    "prefill_urls",
    "prefill_service",
    "prefill_refresh_s",
    "mode",
    "cache_hit_threshold",
    "prefill_timeout",
    "decode_retry_s",
    "pull_from_decode",
    "kv_pull_threshold",
    "probe_interval_s",
    "probe_timeout_s",
    "outlier_failures",
    "ejection_s",
    "max_body_bytes",
    "engine_rejects",
    "prefill_min_prompt_tokens",
    "tls_ca_file",
    "tls_any_name",
    "prefill_kv_events",
    "kv_block_size",
    "kv_tokenizer",
    "prefill_kv_events_port",
    "prefill_kv_events_replay_port",
)


def settings_from_args(args: argparse.Namespace) -> SidecarSettings:
    from pdpool.errors import CliError
    from .settings import build_settings, load_config_file

    try:
        file_values = load_config_file(args.config) if args.config else {}
        return build_settings(file_values, {k: getattr(args, k) for k in SETTING_FLAGS})
    except (ValueError, TypeError) as exc:
        raise CliError(str(exc)) from None


def main(args: argparse.Namespace) -> int:
    import uvicorn
    from .proxy import build_app
    from pdpool.errors import CliError

    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        raise CliError("--tls-cert-file and --tls-key-file go together")
    tls = (
        {"ssl_certfile": args.tls_cert_file, "ssl_keyfile": args.tls_key_file}
        if args.tls_cert_file
        else {}
    )
    settings = settings_from_args(args)
    app = build_app(settings)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        **tls,
        access_log=False,
        lifespan="on",
    )
    return 0
