"""`pdpool sidecar`: the P/D proxy in front of one decode engine."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Optional

from pdpool import metrics_listener
from pdpool.cli import add_switch

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
    _add_engine_arguments(p)
    _add_path_arguments(p)
    _add_health_arguments(p)
    _add_kv_event_arguments(p)


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engines")
    g.add_argument("--decode-url", help="the local decode engine, e.g. http://127.0.0.1:8001")
    g.add_argument(
        "--prefill-url",
        dest="prefill_urls",
        action="append",
        help="a prefill engine (repeatable): HOST:PORT or http://HOST:PORT",
    )
    g.add_argument(
        "--prefill-service", help="HOST:PORT of a headless Service whose DNS lists the prefill pods"
    )
    g.add_argument("--prefill-refresh-s", type=float, help="DNS refresh period (default 5)")
    g.add_argument(
        "--engine-rejects",
        choices=("auto", "yes", "no"),
        help="does the decode engine honour cache_hit_threshold (pdpool serve: "
        "yes; stock vLLM: no)? auto (default) probes it once",
    )
    g.add_argument(
        "--tls-ca-file",
        help="reach prefill engines over HTTPS and verify every upstream (the "
        "decode engine too, when --decode-url is https://) against this CA",
    )
    add_switch(
        g,
        "--tls-any-name",
        None,
        "with --tls-ca-file: accept any certificate that CA signed, whatever "
        "its name (a CA dedicated to the pool; peers are reached by pod IP)",
    )


def _add_path_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the P/D path")
    g.add_argument("--mode", choices=("decode-first", "prefill-first", "aggregated"))
    g.add_argument(
        "--cache-hit-threshold",
        type=float,
        help="pool threshold for decode-first (a request's own value wins)",
    )
    g.add_argument(
        "--prefill-min-prompt-tokens",
        type=int,
        help="decode-first with an engine that cannot reject: prompts of at "
        "least this many tokens (estimated: characters / 4) go "
        "prefill-first, shorter ones to decode only (default 128)",
    )
    g.add_argument("--prefill-timeout", type=float, help="seconds per prefill attempt")
    g.add_argument(
        "--decode-retry-s",
        type=float,
        help="how long to retry an unreachable decode engine (default 5)",
    )
    add_switch(
        g, "--pull-from-decode", None, "let prefill pull decode's cached prefix (default: yes)"
    )
    g.add_argument(
        "--kv-pull-threshold",
        type=int,
        help="offer decode's cached prefix to prefill only when it holds at "
        "least this many tokens (default 0)",
    )
    g.add_argument(
        "--max-body-bytes", help="request bodies above this size get 413 (default 32MiB)"
    )
    g.add_argument(
        "--lora-allowed-dir",
        dest="lora_allowed_dirs",
        action="append",
        metavar="DIR",
        help="the pool allows runtime LoRA updates: a prefill leg for an adapter no prefill "
        "engine serves loads the decode engine's adapter there, when its path is under one "
        "of these folders (repeatable); without any, such a request is served by decode alone",
    )
    g.add_argument(
        "--adapter-models-ttl-s",
        type=float,
        help="how long an engine's /v1/models answer (its adapters) is trusted (default 5)",
    )


def _add_health_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill engine health")
    g.add_argument(
        "--probe-interval-s",
        type=float,
        help="health probe period of each prefill engine (default 1; 0: off)",
    )
    g.add_argument("--probe-timeout-s", type=float, help="health probe timeout (default 2)")
    g.add_argument(
        "--outlier-failures",
        type=int,
        help="consecutive failed prefill legs that eject an engine (default 3)",
    )
    g.add_argument(
        "--ejection-s", type=float, help="base ejection time of a sick prefill engine (default 2)"
    )


def _add_kv_event_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill legs by KV events")
    g.add_argument(
        "--prefill-kv-events",
        action="append",
        metavar="HOST:PORT=ENDPOINT[|REPLAY]",
        help="a prefill engine and its KV events endpoint (vLLM "
        "--kv-events-config), e.g. 10.0.0.7:8000=tcp://10.0.0.7:5557 "
        "(repeatable): legs go to the engine with the most of the prompt "
        "cached",
    )
    g.add_argument(
        "--prefill-kv-events-port",
        type=int,
        help="the same, following --prefill-service: every prefill engine "
        "publishes its KV events on this port (--kv-events-config tcp://*:PORT)",
    )
    g.add_argument(
        "--prefill-kv-events-replay-port",
        type=int,
        help="with --prefill-kv-events-port: the prefill engines' replay port",
    )
    g.add_argument("--kv-block-size", type=int, help="the engines' KV block size (default 16)")
    g.add_argument("--kv-tokenizer", help="the model's tokenizer.json (string prompts)")


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
    "lora_allowed_dirs",
    "adapter_models_ttl_s",
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
