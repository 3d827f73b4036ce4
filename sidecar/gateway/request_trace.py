"""One generation request through the gateway, as traces and metrics see it: its span
(pdpool.tracing; parent of the routing decision and of each attempt on a backend, whose
traceparent goes to that sidecar) and its phases (the routing decision; a stream's time to
first bytes by the path the sidecar took).

The request being served is in a context variable: the places that start the client's
answer (deep in the relay) tell it so without the request being passed down to them."""

from __future__ import annotations

import time
from contextvars import ContextVar
from typing import Any, ContextManager, Mapping, Optional

from pdpool import tracing

from ..net.metrics import GatewayMetrics
from ..routing.core import Route

PATH_HEADER = "x-pdpool-path"  # the sidecar's answer: which P/D path served it


class GatewayRequest:
    __slots__ = ("first_bytes_at", "metrics", "path", "read_at", "span", "stream")

    def __init__(
        self, metrics: GatewayMetrics, headers: Mapping[str, str], route: str, stream: bool
    ) -> None:
        self.metrics, self.stream = metrics, stream
        self.read_at = time.perf_counter()
        self.first_bytes_at = 0.0
        self.path = "unknown"
        self.span: Any = None
        if tracing.enabled():
            attributes = {
                tracing.GEN_AI_REQUEST_ID: headers.get("x-request-id", ""),
                "http.route": route,
                "pdpool.stream": stream,
            }
            self.span = tracing.start(
                "gateway", tracing.from_headers(headers), "server", attributes
            )

    def routing(self) -> ContextManager[Any]:
        """The routing decision's span (attributes: see `routed`)."""
        return tracing.child("route", self.span)

    def routed(self, span: Any, route: Route, started: float) -> None:
        self.metrics.phase("route").observe(time.perf_counter() - started)
        if span is not None:
            tracing.set_attributes(span, route_attributes(route))

    def attempt(self, backend: str, number: int, continuation: bool = False) -> ContextManager[Any]:
        """One attempt on a backend (a retry, or a migrated stream's continuation)."""
        attributes = {
            "pdpool.backend": backend,
            "pdpool.attempt": number,
            "pdpool.continuation": continuation,
        }
        return tracing.child("attempt", self.span, "client", attributes)

    def started(self, headers: Mapping[str, str]) -> None:
        """The client's answer starts now, with the backend's headers."""
        if not self.first_bytes_at:
            self.first_bytes_at = time.perf_counter()
            self.path = headers.get(PATH_HEADER, "unknown")

    def finish(self) -> None:
        if self.stream and self.first_bytes_at:
            self.metrics.ttft_by(self.path).observe(self.first_bytes_at - self.read_at)
        if self.span is not None:
            self.span.set_attribute("pdpool.path", self.path)
            self.span.end()


CURRENT: ContextVar[Optional[GatewayRequest]] = ContextVar("pdpool_gateway_request", default=None)


def answer_started(headers: Mapping[str, str]) -> None:
    req = CURRENT.get()
    if req is not None:
        req.started(headers)


def record_outcome(span: Any, outcome: Any) -> None:
    """An attempt's result on its span: ok, or why it moved on (an Attempt's reason)."""
    if span is None:
        return
    reason = "ok" if outcome is None else outcome[0] if isinstance(outcome, tuple) else outcome
    span.set_attribute("pdpool.outcome", str(reason))


def route_attributes(route: Route) -> dict[str, Any]:
    out: dict[str, Any] = {
        "pdpool.route.backend": route.order[0] if route.order else "",
        "pdpool.route.candidates": list(route.order),
        "pdpool.route.preferred": route.preferred,
        "pdpool.route.pd_path": route.pd_path or "sidecar decides",
    }
    if route.hit_ratio is not None:
        out["pdpool.kv.hit_ratio"] = route.hit_ratio
    return out
