"""What the routing core needs to know: the decode set, affinity, ejection and KV routing.

Every front-end (the HTTP gateway, the ext_proc endpoint picker) extends these with its own
serving settings, so one set of flags means the same thing wherever routing runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pdpool.pool_defaults import KV_BLOCK_SIZE, KV_LOAD_COST_TOKENS
from pdpool.settings_flags import setting

from .affinity import DEFAULT_PREFIX_CHARS
from ..kv.events_spec import parse_kv_events


def _kv_events(items: Any) -> dict[str, str]:
    return items if isinstance(items, dict) else parse_kv_events(items, "--kv-events")


@dataclass
class RoutingSettings:
    """Each field with a `setting(...)` is a flag of the gateway and the endpoint picker
    (pdpool/settings_flags.py): its default here is the flag's."""

    decode_urls: list[str] = setting(
        default_factory=list,
        name="--decode-url",
        repeat="append",
        help="a decode sidecar (repeatable): HOST:PORT or http://HOST:PORT",
    )
    decode_service: Optional[str] = setting(
        None, help="HOST:PORT of a headless Service whose DNS lists the decode pods"
    )
    refresh_s: float = 5.0
    health_interval_s: float = setting(2.0)
    prefix_chars: int = setting(
        DEFAULT_PREFIX_CHARS, help="prompt characters hashed for prefix affinity"
    )
    balance: float = setting(
        1.25, help="load bound: a sidecar takes at most this times the average load"
    )
    # more than the sidecar's own check of its engine
    probe_timeout_s: float = setting(
        3.0, help="health probe timeout; a failed probe ejects the sidecar"
    )
    # Outlier detection: this many failed requests in a row eject a backend (a failed
    # health probe or a refused connection ejects it at once) for ejection_s x recent
    # ejections; it comes back when a probe succeeds after that.
    outlier_failures: int = setting(3, help="failed requests in a row that eject")
    ejection_s: float = setting(
        2.0, help="base ejection time (times the recent ejections, at most 30 s)"
    )
    # Precise KV-aware routing (kv_cost.py): backend -> its engine's KV events endpoint
    # ("tcp://host:5557" or "tcp://host:5557|tcp://host:5558" with replay).
    kv_events: dict[str, str] = setting(
        default_factory=dict,
        repeat="append",
        metavar="URL=ENDPOINT[|REPLAY]",
        parse=_kv_events,
        help="precise KV-aware routing: the decode sidecar URL and its engine's KV "
        "events endpoint (vLLM --kv-events-config), e.g. "
        "http://10.0.0.5:8000=tcp://10.0.0.5:5557|tcp://10.0.0.5:5558 "
        "(repeatable; sidecars without one keep hash affinity)",
    )
    kv_block_size: int = setting(KV_BLOCK_SIZE, help="the engines' KV block size")
    # the model's tokenizer.json (string prompts)
    kv_tokenizer: Optional[str] = setting(None, help="the model's tokenizer.json")
    # Prompts it cannot tokenize itself (chats; strings without kv_tokenizer) are tokenized
    # by a decode engine's /tokenize (engine_tokenize.py): one round trip, affinity on failure.
    kv_engine_tokenize: bool = setting(
        True,
        switch=True,
        help="ask a decode engine's /tokenize (through its sidecar) for prompts not tokenized "
        "here (chats; strings without --kv-tokenizer); --no-kv-engine-tokenize: those keep "
        "hash affinity",
    )
    kv_tokenize_timeout_s: float = 2.0
    kv_threshold: float = setting(
        0.0,
        help="predicted hit ratio below which requests go P/D up front (the pool's "
        "cache-hit threshold)",
    )
    kv_load_cost: float = setting(
        KV_LOAD_COST_TOKENS, help="cost of one in-flight request on a sidecar, in prompt tokens"
    )
    # The same, following discovery: every listed backend's engine (same pod, same IP)
    # publishes on these ports (kv_feeds.py).
    kv_events_port: Optional[int] = setting(
        None,
        type=int,
        help="precise KV-aware routing that follows --decode-service: each sidecar's engine "
        "(same pod IP) publishes its KV events on this port (its --kv-events-config "
        "tcp://*:PORT)",
    )
    kv_events_replay_port: Optional[int] = setting(
        None, type=int, help="with --kv-events-port: the engines' replay port"
    )
    # Flow control (admission.py): tenants' fair queues in priority bands, 429 when a request
    # cannot wait. None: off, requests go straight to routing. A tenant is its API key, or
    # the value of tenant_header (pools behind another gateway that authenticates).
    tenants_file: Optional[str] = setting(
        None,
        help="flow control: YAML of tenants (keys, weight, priority, limits; see "
        "docs/flow-control.md): fair queues per tenant in priority bands when the pool is "
        "saturated, 429 + Retry-After when a request cannot wait; implies API keys (the "
        "file's); re-read when it changes",
    )
    tenant_header: Optional[str] = setting(
        None,
        help="with --tenants-file: the tenant is named by this request header (a pool "
        "behind another gateway that authenticates) instead of the API key",
    )
    # LoRA residency (lora_affinity.py): an adapter's request goes where the adapter is
    # loaded, from each engine's vllm:lora_requests_info read every lora_scrape_interval_s;
    # with KV routing an engine lacking the adapter costs up to lora_load_cost tokens.
    lora_affinity: bool = setting(
        True,
        switch=True,
        help="send a LoRA adapter's request to an engine where the adapter is loaded (else "
        "one with a free slot), within the load bound, from the engines' "
        "vllm:lora_requests_info (docs/lora.md); --no-lora-affinity: adapters are routed as "
        "the base model",
    )
    lora_scrape_interval_s: float = setting(
        0.5, help="how often each engine's LoRA series are read"
    )
    lora_load_cost: float = setting(
        256.0,
        help="with KV-aware routing: the cost, in prompt tokens, of an engine whose slots "
        "are all taken by other adapters (a free slot costs a fifth of it or less)",
    )
    # GIE's InferenceModelRewrite rules (model_rewrite.py): a request's model replaced by a
    # weighted draw before routing. None: models go on as sent.
    model_rewrites_file: Optional[str] = setting(
        None,
        name="--model-rewrites",
        metavar="FILE",
        help="GIE InferenceModelRewrite rules (YAML: rules of matches and weighted "
        "targets, docs/lora.md): a request's model is rewritten by a weighted draw before "
        "routing (adapter rollouts); re-read when it changes",
    )

    @property
    def kv_routing(self) -> bool:
        return bool(self.kv_events) or self.kv_events_port is not None

    def validate_routing(self) -> None:
        if not self.decode_urls and not self.decode_service:
            raise ValueError("give --decode-url (repeatable) or --decode-service")
        if self.prefix_chars < 1 or self.balance < 1.0:
            raise ValueError("prefix chars must be >= 1 and balance >= 1.0")
        if not 0.05 <= self.lora_scrape_interval_s <= 3600 or self.lora_load_cost < 0:
            raise ValueError(
                "--lora-scrape-interval-s must be in [0.05, 3600] and --lora-load-cost >= 0"
            )
        if self.outlier_failures < 1:
            raise ValueError("outlier failures must be >= 1")
        if self.tenant_header and not self.tenants_file:
            raise ValueError("--tenant-header needs --tenants-file")
        from ..kv.feeds import check_event_ports

        self.kv_events_port, self.kv_events_replay_port = check_event_ports(
            self.kv_events_port,
            self.kv_events_replay_port,
            ("--kv-events-port", "--kv-events-replay-port"),
        )
