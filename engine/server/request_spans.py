"""Traces of the engine's requests (pdpool.tracing), as vLLM makes them: the engine core
records when each request moved on (outputs.RequestPhases), and this process emits the
spans once the request finished, from those times. One `llm_request` span (vLLM's name and
gen_ai.* attributes) per engine request, child of the caller's W3C `traceparent`, with a
child span per phase: queue, kv_load (KV pulled from a peer), prefill, decode.

Installed only when tracing is on (`pdpool serve --otlp-traces-endpoint`): otherwise no
middleware and no hook run at all."""

from __future__ import annotations

import time
from contextvars import ContextVar
from typing import Any, Optional

from pdpool import tracing
from pdpool.engine.outputs import RequestOutput, RequestPhases

# The trace headers of the HTTP request being served (None: not a traced route).
_TRACE_HEADERS: ContextVar[Optional[dict[str, str]]] = ContextVar("pdpool_trace", default=None)
TRACED_METHODS = ("POST",)
_WANTED = (b"traceparent", b"tracestate")


class TraceContextMiddleware:
    """ASGI: remembers each POST's trace headers for the spans emitted when its engine
    requests finish (they run in this request's task, or tasks it starts)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] in TRACED_METHODS:
            headers = {
                k.decode("latin-1"): v.decode("latin-1")
                for k, v in scope["headers"]
                if k.lower() in _WANTED
            }
            _TRACE_HEADERS.set(headers)
        await self.app(scope, receive, send)


def emit_request_spans(out: RequestOutput, e2e: Optional[float]) -> None:
    """The spans of one finished engine request (called from the metrics hook)."""
    headers = _TRACE_HEADERS.get()
    if headers is None or e2e is None:
        return
    finished, now_mono, now_wall = out.produced_at, time.monotonic(), time.time_ns()

    def wall(t: float) -> int:
        return tracing.wall_ns(t, now_wall, now_mono)

    phases = out.phases
    attributes = request_attributes(out, e2e, phases)
    root = tracing.record(
        "llm_request",
        tracing.from_headers(headers),
        wall(finished - e2e),
        wall(finished),
        attributes,
        kind="server",
    )
    if root is None or phases is None:
        return
    for name, start, end, attrs in phase_spans(out, phases, finished):
        tracing.record(name, root, wall(start), wall(end), attrs)


def request_attributes(
    out: RequestOutput, e2e: float, phases: Optional[RequestPhases]
) -> dict[str, Any]:
    """vLLM's llm_request attributes (its names), and ours (pdpool.*) for the KV."""
    attrs: dict[str, Any] = {
        tracing.GEN_AI_REQUEST_ID: out.request_id,
        tracing.GEN_AI_USAGE_PROMPT_TOKENS: out.num_prompt_tokens,
        tracing.GEN_AI_USAGE_COMPLETION_TOKENS: out.num_output_tokens,
        tracing.GEN_AI_LATENCY_E2E: e2e,
        "pdpool.finish_reason": out.finish_reason or "",
        "pdpool.cached_tokens": out.num_cached_tokens,
        "pdpool.pulled_tokens": out.num_pulled_tokens,
    }
    if phases is None:
        return attrs
    timed = {
        tracing.GEN_AI_LATENCY_TIME_IN_QUEUE: _between(phases.arrived, phases.admitted),
        tracing.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: _between(phases.arrived, phases.first_token),
        tracing.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: _between(phases.running, phases.first_token),
        tracing.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: _between(phases.first_token, out.produced_at),
        tracing.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: _between(phases.running, out.produced_at),
    }
    attrs.update({k: v for k, v in timed.items() if v is not None})
    return attrs


def phase_spans(
    out: RequestOutput, phases: RequestPhases, finished: float
) -> list[tuple[str, float, float, dict[str, Any]]]:
    """(name, start, end, attributes) of each phase the request went through."""
    spans: list[tuple[str, float, float, dict[str, Any]]] = []
    if phases.admitted is not None:
        spans.append(("queue", phases.arrived, phases.admitted, {}))
    loaded = phases.admitted is not None and phases.running is not None
    if loaded and out.num_pulled_tokens:
        assert phases.admitted is not None and phases.running is not None
        spans.append(
            (
                "kv_load",
                phases.admitted,
                phases.running,
                {"pdpool.kv.pulled_tokens": out.num_pulled_tokens},
            )
        )
    if phases.running is not None and phases.first_token is not None:
        computed = out.num_prompt_tokens - out.num_cached_tokens
        spans.append(
            (
                "prefill",
                phases.running,
                phases.first_token,
                {
                    tracing.GEN_AI_USAGE_PROMPT_TOKENS: out.num_prompt_tokens,
                    "pdpool.cached_tokens": out.num_cached_tokens,
                    "pdpool.computed_tokens": computed,
                },
            )
        )
    if phases.first_token is not None and out.num_output_tokens > 1:
        spans.append(
            (
                "decode",
                phases.first_token,
                finished,
                {tracing.GEN_AI_USAGE_COMPLETION_TOKENS: out.num_output_tokens},
            )
        )
    return spans


def _between(start: Optional[float], end: Optional[float]) -> Optional[float]:
    return None if start is None or end is None else max(end - start, 0.0)
