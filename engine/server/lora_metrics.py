"""vLLM's `vllm:lora_requests_info`: a gauge whose labels name the adapters of running and
waiting requests (comma-joined) and --max-loras, and whose value is the time they were
read. vLLM keeps every label set it ever set; this exports the current one only, so a
long-lived engine's series stay bounded."""

from __future__ import annotations

import time
from typing import Iterator

from prometheus_client.core import GaugeMetricFamily

from pdpool.engine.engine_state import EngineView

NAME = "vllm:lora_requests_info"
LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")


class LoRARequestsInfo:
    def __init__(self, view: EngineView) -> None:
        self.view = view

    def collect(self) -> Iterator[GaugeMetricFamily]:
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
