"""OpenTelemetry tracing of pdpool's servers (engine, sidecar, gateway), turned on as vLLM
turns it on: `--otlp-traces-endpoint URL`.

Off by default, and cheap when off: nothing of OpenTelemetry's SDK is imported, `span()`
returns one shared null context, and callers test `enabled()` before building attributes.
When on, spans go to an OTLP exporter in a batch (a background thread), with the standard
variables honoured: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (grpc, vLLM's default, or
http/protobuf), OTEL_EXPORTER_OTLP_[TRACES_]HEADERS, OTEL_SERVICE_NAME,
OTEL_RESOURCE_ATTRIBUTES, OTEL_BSP_* (the batch's delay and sizes).

Parents are passed explicitly (a span, or the context read from a request's W3C
`traceparent`), never taken from a context variable: a request's legs run in the same task
and each must name its own parent. `inject()` writes the `traceparent` a leg sends upstream,
so that engines (ours and stock vLLM) join the same trace.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import time
from typing import Any, ContextManager, Mapping, Optional

log = logging.getLogger("pdpool.tracing")

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
PROTOCOLS = ("grpc", "http/protobuf")

# vLLM's span attribute names (vllm/tracing/utils.py SpanAttributes), so that dashboards
# and queries written for vLLM's `llm_request` spans read ours the same way.
GEN_AI_REQUEST_ID = "gen_ai.request.id"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"

_tracer: Any = None  # an SDK tracer once configure() turned tracing on
_provider: Any = None
_NULL: ContextManager[None] = contextlib.nullcontext()


def enabled() -> bool:
    return _tracer is not None


def protocol_from_env() -> str:
    """OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL, else grpc (as
    vLLM); ValueError for any other value."""
    value = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    ).strip()
    if value not in PROTOCOLS:
        raise ValueError(
            f"unsupported OTLP traces protocol {value!r} (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL): "
            f"use one of {', '.join(PROTOCOLS)}"
        )
    return value


def configure(endpoint: Optional[str], service_name: str) -> bool:
    """Turns tracing on for this process when `endpoint` is set; returns whether it is on.
    OTEL_SERVICE_NAME wins over `service_name`. ValueError for a bad protocol, RuntimeError
    when the SDK is not installed."""
    global _tracer, _provider
    if not endpoint:
        return False
    protocol = protocol_from_env()
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError(
            f"--otlp-traces-endpoint needs opentelemetry-sdk and an OTLP exporter: {exc}"
        ) from None
    attributes = {"process.pid": os.getpid()}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = service_name  # type: ignore[assignment]
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint, protocol)))
    _provider, _tracer = provider, provider.get_tracer("pdpool")
    atexit.register(shutdown)
    log.info("tracing on: OTLP %s to %s", protocol, endpoint)
    return True


def add_argument(p: argparse.ArgumentParser) -> None:
    """vLLM's flag, on every pdpool server and `pdpool up`."""
    p.add_argument(
        "--otlp-traces-endpoint",
        help="export OpenTelemetry traces (OTLP) to this URL; a client's W3C traceparent "
        "is followed and passed on. Protocol, headers, service name: the OTEL_* variables "
        "(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: grpc, the default as in vLLM, or "
        "http/protobuf)",
    )


def configure_or_exit(endpoint: Optional[str], service_name: str) -> bool:
    """configure() for a command line: CliError (one line, non-zero exit) for what cannot
    work."""
    from pdpool.errors import CliError

    try:
        return configure(endpoint, service_name)
    except (ValueError, RuntimeError) as exc:
        raise CliError(str(exc)) from None


def _exporter(endpoint: str, protocol: str) -> Any:
    # Each exporter reads its headers, timeout and compression from the OTEL_* variables.
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = not endpoint.startswith("https://")
        return OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(endpoint=endpoint)


def shutdown() -> None:
    """Exports what is batched and stops; tracing is off afterwards."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def _kind(kind: str) -> Any:
    from opentelemetry.trace import SpanKind

    return {"server": SpanKind.SERVER, "client": SpanKind.CLIENT}.get(kind, SpanKind.INTERNAL)


def _context(parent: Any) -> Any:
    """A span or a context (from `from_headers`) as the context a child starts in."""
    if parent is None:
        return None
    from opentelemetry.trace import Span, set_span_in_context

    return set_span_in_context(parent) if isinstance(parent, Span) else parent


def from_headers(headers: Mapping[str, str]) -> Any:
    """The parent context a request's `traceparent` (and `tracestate`) names; None when
    tracing is off or there is none (a new trace starts)."""
    if _tracer is None or TRACEPARENT not in headers:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {k: headers[k] for k in (TRACEPARENT, TRACESTATE) if k in headers}
    return TraceContextTextMapPropagator().extract(carrier)


def start(
    name: str,
    parent: Any = None,
    kind: str = "internal",
    attributes: Optional[Mapping[str, Any]] = None,
    start_ns: Optional[int] = None,
) -> Any:
    """A started span (end it with .end()); None when tracing is off."""
    if _tracer is None:
        return None
    return _tracer.start_span(
        name,
        context=_context(parent),
        kind=_kind(kind),
        attributes=dict(attributes or {}),
        start_time=start_ns,
    )


def span(
    name: str,
    parent: Any = None,
    kind: str = "internal",
    attributes: Optional[Mapping[str, Any]] = None,
) -> ContextManager[Any]:
    """`with span(...) as s:` a span ended on exit (an exception is recorded on it); s is
    None when tracing is off."""
    if _tracer is None:
        return _NULL
    from opentelemetry.trace import use_span

    return use_span(start(name, parent, kind, attributes), end_on_exit=True)


def child(
    name: str, parent: Any, kind: str = "internal", attributes: Optional[Mapping[str, Any]] = None
) -> ContextManager[Any]:
    """As span(), but only under a parent: nothing when the parent is None (tracing off,
    or this request not traced)."""
    if parent is None:
        return _NULL
    return span(name, parent, kind, attributes)


def moment(name: str, attributes: Mapping[str, Any]) -> None:
    """Something no request owns (an ejection): a span of its own, a trace of one span."""
    if _tracer is not None:
        _tracer.start_span(name, attributes=dict(attributes)).end()


def inject(span_: Any, headers: Mapping[str, str]) -> dict[str, str]:
    """`headers` with the `traceparent` that makes `span_` the parent upstream (the same
    headers when there is no span)."""
    if span_ is None:
        return dict(headers)
    ctx = span_.get_span_context()
    out = dict(headers)
    out[TRACEPARENT] = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
    return out


def event(span_: Any, name: str, attributes: Optional[Mapping[str, Any]] = None) -> None:
    if span_ is not None:
        span_.add_event(name, dict(attributes or {}))


def set_attributes(span_: Any, attributes: Mapping[str, Any]) -> None:
    if span_ is not None:
        span_.set_attributes({k: v for k, v in attributes.items() if v is not None})


def wall_ns(
    monotonic_s: float, now_wall_ns: Optional[int] = None, now_mono: Optional[float] = None
) -> int:
    """A time.monotonic() reading as wall-clock nanoseconds (spans are timed in wall clock;
    the engine records monotonic times, comparable across its processes)."""
    wall = time.time_ns() if now_wall_ns is None else now_wall_ns
    mono = time.monotonic() if now_mono is None else now_mono
    return wall - int((mono - monotonic_s) * 1e9)


def record(
    name: str,
    parent: Any,
    start_ns: int,
    end_ns: int,
    attributes: Optional[Mapping[str, Any]] = None,
    kind: str = "internal",
) -> Any:
    """A span with known start and end (phases measured elsewhere, e.g. in the engine core);
    returns it (a parent for more), None when tracing is off."""
    s = start(name, parent, kind, attributes, start_ns)
    if s is not None:
        s.end(end_time=max(end_ns, start_ns))
    return s
