"""What the routing core needs to know: the decode set, affinity, ejection and KV routing.

Every front-end (the HTTP gateway, the ext_proc endpoint picker) extends these with its own
serving settings, so one set of flags means the same thing wherever routing runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .affinity import DEFAULT_PREFIX_CHARS


@dataclass
class RoutingSettings:
    decode_urls: list[str] = field(default_factory=list)
    decode_service: Optional[str] = None
    refresh_s: float = 5.0
    health_interval_s: float = 2.0
    prefix_chars: int = DEFAULT_PREFIX_CHARS
    balance: float = 1.25
    probe_timeout_s: float = 3.0  # more than the sidecar's own check of its engine
    # Outlier detection: this many failed requests in a row eject a backend (a failed
    # health probe or a refused connection ejects it at once) for ejection_s x recent
    # ejections; it comes back when a probe succeeds after that.
    outlier_failures: int = 3
    ejection_s: float = 2.0
    # Precise KV-aware routing (kv_router.py): backend -> its engine's KV events endpoint
    # ("tcp://host:5557" or "tcp://host:5557|tcp://host:5558" with replay).
    kv_events: dict[str, str] = field(default_factory=dict)
    kv_block_size: int = 16
    kv_tokenizer: Optional[str] = None  # the model's tokenizer.json (string prompts)
    # Prompts it cannot tokenize itself (chats; strings without kv_tokenizer) are tokenized
    # by a decode engine's /tokenize (engine_tokenize.py): one round trip, affinity on failure.
    kv_engine_tokenize: bool = True
    kv_tokenize_timeout_s: float = 2.0
    kv_threshold: float = 0.0  # below this predicted hit ratio: P/D up front
    kv_load_cost: float = 64.0  # tokens of cost per in-flight request
    # The same, following discovery: every listed backend's engine (same pod, same IP)
    # publishes on these ports (kv_feeds.py).
    kv_events_port: Optional[int] = None
    kv_events_replay_port: Optional[int] = None
    # Flow control (admission.py): tenants' fair queues in priority bands, 429 when a request
    # cannot wait. None: off, requests go straight to routing. A tenant is its API key, or
    # the value of tenant_header (pools behind another gateway that authenticates).
    tenants_file: Optional[str] = None
    tenant_header: Optional[str] = None
    # LoRA residency (lora_affinity.py): an adapter's request goes where the adapter is
    # loaded, from each engine's vllm:lora_requests_info read every lora_scrape_interval_s;
    # with KV routing an engine lacking the adapter costs up to lora_load_cost tokens.
    lora_affinity: bool = True
    lora_scrape_interval_s: float = 0.5
    lora_load_cost: float = 256.0
    # GIE's InferenceModelRewrite rules (model_rewrite.py): a request's model replaced by a
    # weighted draw before routing. None: models go on as sent.
    model_rewrites_file: Optional[str] = None

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
