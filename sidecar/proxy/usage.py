"""The usage a client is told after a P/D run, and the count of prompt tokens each leg computed.

The merging rule itself is `legs.merged_usage`; here it is applied to a buffered answer or to
the usage chunk of a stream, and `pdpool_sidecar_computed_prompt_tokens_total{leg}` counted.
"""

from __future__ import annotations

import json
from typing import Any

from . import legs
from .exchange import json_or_none
from ..net.metrics import SidecarMetrics
from ..net.sse import EventSplitter, event_json, json_event, usage_of


def json_usage(data: Any) -> Any:
    """The `usage` of a JSON answer (any JSON value; None when absent)."""
    return data.get("usage") if isinstance(data, dict) else None


def count_computed(metrics: SidecarMetrics, leg: str, usage: Any) -> None:
    if isinstance(usage, dict):
        metrics.computed_tokens.labels(leg).inc(legs.computed_tokens(usage))


def decode_answer_usage(metrics: SidecarMetrics, content: bytes, prefill_usage: Any) -> bytes:
    """A decode leg's buffered answer (200), its computed tokens counted and, after a prefill
    leg, its usage covering both legs."""
    data = json_or_none(content)
    if not isinstance(data, dict):
        return content
    count_computed(metrics, "decode", data.get("usage"))
    if prefill_usage is None or "usage" not in data:
        return content
    data["usage"] = legs.merged_usage(data["usage"], prefill_usage)
    return json.dumps(data).encode()


class StreamUsageRewriter:
    """Rewrites the usage chunk of a decode stream to cover the prefill leg too (and counts
    the tokens decode computed). Bytes in, bytes out: only whole events leave `feed`."""

    def __init__(self, metrics: SidecarMetrics, prefill_usage: Any) -> None:
        self.metrics = metrics
        self.prefill_usage = prefill_usage
        self.splitter = EventSplitter()

    def feed(self, chunk: bytes) -> bytes:
        out = []
        for event in self.splitter.feed(chunk):
            if b'"prompt_tokens"' in event:  # parse only the (rare) events with usage
                data = event_json(event)
                usage = usage_of(data)
                if usage is not None:
                    count_computed(self.metrics, "decode", usage)
                    data["usage"] = legs.merged_usage(usage, self.prefill_usage)
                    event = json_event(data)
            out.append(event)
        return b"".join(out)

    def rest(self) -> bytes:
        return self.splitter.rest()
