"""What the HTTP side reads of an engine besides its outputs: the static facts a server needs
(name, limits, tokenizer) and a snapshot of its counters and gauges. One shape for both ways
of running the engine: on a thread of the server's process (read live) or in a process of its
own (a snapshot sent with every step)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import TYPE_CHECKING, Any, Literal, Mapping, Optional, Protocol

if TYPE_CHECKING:  # for annotations only: the server process never imports torch
    from pdpool.engine.config import EngineConfig
    from pdpool.engine.engine_core import LLMEngine
    from pdpool.engine.model_info import ModelInfo


@dataclasses.dataclass(frozen=True)
class EngineState:
    running: int
    waiting: int
    blocks_used: int
    blocks_total: int
    usage: float
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    threshold_rejections: dict[str, int]
    connector: dict[str, float]
    stats: dict[str, int]
    fault: Optional[str]
    has_work: bool
    # How long the admission of new requests has been held up, and by what ("": it is not):
    # guided ones by compiles that overran their deadline (structured/compile_jobs.py), or
    # all of them by a message the core's reader is still handling. /ready reads it.
    admission_holdup_s: float = 0.0
    admission_holdup: str = ""
    # Waiting requests by their priority (server/priority_metrics.py bounds the labels).
    waiting_by_priority: dict[int, int] = dataclasses.field(default_factory=dict)
    # The KV offload tier's counters (connector/offload_tier.py stats); empty without a tier.
    offload: dict[str, float] = dataclasses.field(default_factory=dict)
    # LoRA adapters of running and waiting requests, with their counts (vLLM's
    # SchedulerStats.running_lora_adapters / waiting_lora_adapters).
    running_lora_adapters: dict[str, int] = dataclasses.field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = dataclasses.field(default_factory=dict)
    # The LoRA manager's counters (lora/slots.py: lora_loads, lora_slot_loads); empty without.
    lora: dict[str, int] = dataclasses.field(default_factory=dict)


def engine_state(engine: LLMEngine) -> EngineState:
    """A snapshot of `engine` (an LLMEngine); call it on the engine's thread."""
    sched = engine.scheduler
    cache = sched.kv_usage()
    held, by = compile_holdup(engine)
    return EngineState(
        running=len(sched.running),
        waiting=len(sched.waiting),
        blocks_used=cache.blocks_used,
        blocks_total=cache.blocks_total,
        usage=cache.usage,
        prefix_queries=cache.prefix_queries,
        prefix_hits=cache.prefix_hits,
        preemptions=sched.num_preemptions,
        threshold_rejections=dict(sched.num_threshold_rejections),
        connector=dict(engine.connector.stats()),
        stats=dict(engine.stats),
        fault=engine.fault,
        has_work=engine.has_unfinished(),
        admission_holdup_s=held,
        admission_holdup=by,
        waiting_by_priority=dict(Counter(r.priority for r in sched.waiting)),
        offload=dict(engine.offload.stats()) if engine.offload is not None else {},
        running_lora_adapters=dict(Counter(r.lora.name for r in sched.running if r.lora)),
        waiting_lora_adapters=dict(Counter(r.lora.name for r in sched.waiting if r.lora)),
        lora=dict(engine.lora.stats) if engine.lora is not None else {},
    )


def compile_holdup(engine: LLMEngine) -> tuple[float, str]:
    """How long, and why, guided requests have not been admitted (0, "": they are)."""
    held = engine.grammar_jobs.holdup_s()
    if held <= 0:
        return 0.0, ""
    return held, "grammar compiles that overran their deadline hold every overrun slot"


def admission_problem(held_s: float, by: str, max_stall_s: float) -> Optional[str]:
    """Readiness's reading of an admission holdup: a problem past `max_stall_s`."""
    if held_s > max_stall_s:
        return f"the admission of new requests has been held up for {held_s:.1f}s: {by}"
    return None


class ServerTokenizer(Protocol):
    """What the server asks of a tokenizer, in the names of transformers' tokenizers (a
    transformers tokenizer, or server.text_tokenizer.TextTokenizer without torch)."""

    def __call__(self, text: str, add_special_tokens: bool = ...) -> Mapping[str, list[int]]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> list[Optional[str]]: ...

    def get_vocab(self) -> dict[str, int]: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = ...,
        tokenize: Literal[False] = ...,
        continue_final_message: bool = ...,
    ) -> str: ...


class EngineView(Protocol):
    """The facts and state the server reads of its engine: LiveEngineView (an engine on a
    thread of the server's process) or core_process_client.EngineMirror (an engine core)."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def info(self) -> ModelInfo: ...

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def kv_capacity_tokens(self) -> int: ...

    @property
    def kv_fingerprint(self) -> str: ...

    @property
    def tokenizer(self) -> ServerTokenizer: ...

    @property
    def fault(self) -> Optional[str]: ...

    def state(self) -> EngineState: ...


class LiveEngineView:
    """The server's view of an engine on one of its own threads: facts and state read live
    (the gauges read Python ints and lists; a torn read is one scrape off by one)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.config, self.info = engine.config, engine.info
        self.model_name, self.max_model_len = engine.model_name, engine.max_model_len
        self.kv_capacity_tokens = engine.kv_capacity_tokens
        self.kv_fingerprint = engine.memory.fingerprint
        self.tokenizer: ServerTokenizer = engine.tokenizer

    def state(self) -> EngineState:
        return engine_state(self.engine)

    @property
    def fault(self) -> Optional[str]:
        return self.engine.fault
