"""The routing core's flags (sidecar/routing/settings.py), for a front-end's command line:
one spelling and one meaning wherever routing runs."""

from __future__ import annotations

import argparse
from typing import Any

from pdpool.cli import add_switch


def add_routing_arguments(p: argparse.ArgumentParser) -> None:
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
        "--outlier-failures", type=int, default=3, help="failed requests in a row that eject"
    )
    p.add_argument(
        "--ejection-s",
        type=float,
        default=2.0,
        help="base ejection time (times the recent ejections, at most 30 s)",
    )
    _add_kv_arguments(p)
    _add_lora_arguments(p)
    add_flow_arguments(p)


def _add_lora_arguments(p: argparse.ArgumentParser) -> None:
    add_switch(
        p,
        "--lora-affinity",
        True,
        "send a LoRA adapter's request to an engine where the adapter is loaded (else one "
        "with a free slot), within the load bound, from the engines' vllm:lora_requests_info "
        "(docs/lora.md); --no-lora-affinity: adapters are routed as the base model",
    )
    p.add_argument(
        "--lora-scrape-interval-s",
        type=float,
        default=0.5,
        help="how often each engine's LoRA series are read",
    )
    p.add_argument(
        "--lora-load-cost",
        type=float,
        default=256.0,
        help="with KV-aware routing: the cost, in prompt tokens, of an engine whose slots "
        "are all taken by other adapters (a free slot costs a fifth of it or less)",
    )
    p.add_argument(
        "--model-rewrites",
        dest="model_rewrites_file",
        metavar="FILE",
        help="GIE InferenceModelRewrite rules (YAML: rules of matches and weighted "
        "targets, docs/lora.md): a request's model is rewritten by a weighted draw before "
        "routing (adapter rollouts); re-read when it changes",
    )


def add_flow_arguments(p: argparse.ArgumentParser) -> None:
    """Flow control's flags (docs/flow-control.md)."""
    p.add_argument(
        "--tenants-file",
        help="flow control: YAML of tenants (keys, weight, priority, limits; see "
        "docs/flow-control.md): fair queues per tenant in priority bands when the pool is "
        "saturated, 429 + Retry-After when a request cannot wait; implies API keys (the "
        "file's); re-read when it changes",
    )
    p.add_argument(
        "--tenant-header",
        help="with --tenants-file: the tenant is named by this request header (a pool "
        "behind another gateway that authenticates) instead of the API key",
    )


def _add_kv_arguments(p: argparse.ArgumentParser) -> None:
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
        help="precise KV-aware routing that follows --decode-service: each sidecar's engine "
        "(same pod IP) publishes its KV events on this port (its --kv-events-config "
        "tcp://*:PORT)",
    )
    p.add_argument(
        "--kv-events-replay-port",
        type=int,
        default=None,
        help="with --kv-events-port: the engines' replay port",
    )
    p.add_argument("--kv-block-size", type=int, default=16, help="the engines' KV block size")
    p.add_argument("--kv-tokenizer", default=None, help="the model's tokenizer.json")
    add_switch(
        p,
        "--kv-engine-tokenize",
        True,
        "ask a decode engine's /tokenize (through its sidecar) for prompts not tokenized "
        "here (chats; strings without --kv-tokenizer); --no-kv-engine-tokenize: those keep "
        "hash affinity",
    )
    p.add_argument(
        "--kv-threshold",
        type=float,
        default=0.0,
        help="predicted hit ratio below which requests go P/D up front (the pool's "
        "cache-hit threshold)",
    )
    p.add_argument(
        "--kv-load-cost",
        type=float,
        default=64.0,
        help="cost of one in-flight request on a sidecar, in prompt tokens",
    )


def routing_settings_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """RoutingSettings' fields from the parsed flags (raises ValueError on a bad --kv-events)."""
    from ..kv.events_spec import parse_kv_events

    return {
        "decode_urls": args.decode_urls,
        "decode_service": args.decode_service,
        "prefix_chars": args.prefix_chars,
        "balance": args.balance,
        "health_interval_s": args.health_interval_s,
        "probe_timeout_s": args.probe_timeout_s,
        "outlier_failures": args.outlier_failures,
        "ejection_s": args.ejection_s,
        "kv_events": parse_kv_events(args.kv_events, "--kv-events"),
        "kv_block_size": args.kv_block_size,
        "kv_tokenizer": args.kv_tokenizer,
        "kv_engine_tokenize": args.kv_engine_tokenize,
        "kv_threshold": args.kv_threshold,
        "kv_load_cost": args.kv_load_cost,
        "kv_events_port": args.kv_events_port,
        "kv_events_replay_port": args.kv_events_replay_port,
        "tenants_file": args.tenants_file,
        "tenant_header": args.tenant_header,
        "lora_affinity": args.lora_affinity,
        "lora_scrape_interval_s": args.lora_scrape_interval_s,
        "lora_load_cost": args.lora_load_cost,
        "model_rewrites_file": args.model_rewrites_file,
    }
