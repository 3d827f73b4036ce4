"""vLLM's `vllm:lora_requests_info`: a gauge whose labels name the adapters of running and
waiting requests (comma-joined) and --max-loras, and whose value is the time they were
read. vLLM keeps every label set it ever set; this exports the current one only, so a
long-lived engine's series stay bounded.

vLLM counts no adapter loads; pdpool's own counters do (what residency-aware routing saves):
`pdpool_lora_slot_loads_total`, adapters copied into one of the --max-loras slots, and
`pdpool_lora_adapter_reads_total`, adapters read from their folder into the --max-cpu-loras
cache."""

from __future__ import annotations

import time
from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdpool.engine.engine_state import EngineView

NAME = "vllm:lora_requests_info"
LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")


class LoRARequestsInfo:
    def __init__(self, view: EngineView) -> None:
        self.view = view

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        state = self.view.state()
        family = GaugeMetricFamily(NAME, "Running stats on lora requests.", labels=list(LABELS))
        family.add_metric(
            [
                str(self.view.config.max_loras),
                ",".join(state.waiting_lora_adapters),
                ",".join(state.running_lora_adapters),
            ],
            time.time(),
        )
        yield family
        for name, key, doc in (
            ("pdpool_lora_slot_loads", "lora_slot_loads", "LoRA adapters copied into a slot."),
            ("pdpool_lora_adapter_reads", "lora_loads", "LoRA adapters read from disk."),
        ):
            yield CounterMetricFamily(name, doc, value=state.lora.get(key, 0))
