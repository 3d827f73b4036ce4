"""One request's ext_proc stream: what the endpoint picker answers to each message Envoy
sends (FULL_DUPLEX_STREAMED bodies), from the request headers to the response's end.

Request path: headers are held until the body has arrived (routing reads the prompt), then
the routed header answer and the body, unchanged, go back together; a request without a
body (GET /health, /v1/models) is routed at its headers. Response path: the sidecar Envoy
reached is read back (`upstream.address`), every body chunk is passed on as it comes, and
the request counts as served or failed at its end; Envoy's own 503 for an endpoint it
could not reach becomes a clear error and ejects that endpoint."""

from __future__ import annotations

import contextlib
import json
import time
from typing import TYPE_CHECKING, Any, Optional

from pdpool.body_budget import RETRY_AFTER_S, BodiesBusy

from ..net.client_body import (
    BadRequest,
    parse_client_body,
    strip_client_kv_params,
    with_priority,
)
from ..net.routes import is_generation
from ..flow.admission import Slot
from ..routing.core import PD_HEADER
from . import protocol

if TYPE_CHECKING:
    from .server import EndpointPicker

# Headers only the picker sets: a client's copy never reaches a sidecar.
OWNED_HEADERS = (PD_HEADER, protocol.DESTINATION_HEADER)

Answers = list[Any]  # ProcessingResponse messages


class Exchange:
    def __init__(self, picker: "EndpointPicker") -> None:
        self.picker = picker
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self._hold = picker.bodies.hold()  # a large body's share, until the stream ends
        self.endpoint: Optional[str] = None
        self.status: Optional[int] = None
        self.routed = False
        self.headers_seen = False
        self._tracked = contextlib.ExitStack()
        self._slot: Optional[Slot] = None  # flow control's hold on the pool, until the end
        self._started = time.perf_counter()

    # ------------------------------------------------------------------ dispatch
    async def handle(self, request: Any) -> Answers:
        kind = request.WhichOneof("request")
        refusal = self._out_of_order(kind)
        if refusal is not None:
            return [refusal]
        if kind == "request_headers":
            return await self._request_headers(request)
        if kind == "request_body":
            return await self._request_body(request)
        if kind == "request_trailers":  # a body ended by trailers: route it now
            answers = [] if self.routed else await self._route(request, body_ended=True)
            return [*answers, protocol.trailers(request_side=True)]
        if kind == "response_headers":
            return self._response_headers(request)
        if kind == "response_body":
            return self._response_body(request.response_body)
        if kind == "response_trailers":
            self._finish()
            return [protocol.trailers(request_side=False)]
        return []

    def _out_of_order(self, kind: Optional[str]) -> Optional[Any]:
        """A 400 for a request-side message Envoy never sends where it came (headers twice,
        a body before the headers or after the request was routed): routing the request
        again would take a second flow-control slot that nothing releases."""
        if kind == "request_headers":
            wrong = self.headers_seen
        elif kind in ("request_body", "request_trailers"):
            wrong = not self.headers_seen or self.routed
        else:
            return None
        if not wrong:
            return None
        return protocol.immediate(400, f"ext_proc: {kind} out of order for this request")

    def close(self) -> None:
        """The stream ended (the request is over, or Envoy or the client gave up on it: not
        the endpoint's failure)."""
        self._tracked.close()
        self._release()

    def _release(self) -> None:
        """What the request holds: its large body's share, its flow-control slot."""
        self._hold.release()
        if self._slot is not None:
            self._slot.release()
            self._slot = None

    # ------------------------------------------------------------------ request path
    async def _request_headers(self, request: Any) -> Answers:
        self.headers = protocol.header_map(request.request_headers)
        self.headers_seen = True
        self._started = time.perf_counter()
        if request.request_headers.end_of_stream:
            return await self._route(request, body_ended=False)
        return []

    async def _request_body(self, request: Any) -> Answers:
        part = request.request_body
        self.body += part.body
        limit = self.picker.settings.max_body_bytes
        if len(self.body) > limit:
            return [protocol.immediate(413, f"request body exceeds {limit} bytes")]
        try:
            self._hold.grow_to(len(self.body))
        except BodiesBusy as exc:
            self.picker.metrics.bodies_busy.inc()
            retry = {"retry-after": RETRY_AFTER_S}
            return [protocol.immediate(503, str(exc), code="bodies_busy", headers=retry)]
        if part.end_of_stream:
            return await self._route(request, body_ended=True)
        return []  # the body is answered whole once routed

    async def _route(self, request: Any, body_ended: bool) -> Answers:
        raw = bytes(self.body)
        parsed, refusal = self._parse(raw)
        if refusal is not None:
            return [refusal]
        if parsed is not None:
            parsed, dropped = strip_client_kv_params(parsed)
            if dropped:  # the body goes on without them (a client never steers KV transfers)
                raw = json.dumps(parsed).encode()
            if self.picker.rewrites is not None:  # GIE's weighted model rewrite, then routing
                parsed, raw = self.picker.rewrites.apply(parsed, raw)
        admission = await self.picker.admit(parsed, self.headers)
        if isinstance(admission, Slot):
            self._slot = admission
            parsed, raw = self._with_band(parsed, raw)
        elif admission is not None:
            return [admission]
        allowed = protocol.subset_hint(request)
        if self.picker.settings.test_endpoint_selection:
            chosen = protocol.test_selection(self.headers)
            allowed = chosen if chosen is not None else allowed
        pick = await self.picker.pick(parsed, self.headers, allowed)
        if pick.endpoint is None:
            return [protocol.immediate(503, pick.reason, code="no_backend")]
        self.endpoint, self.routed = pick.endpoint, True
        self._tracked.enter_context(self.picker.routing.tracked(pick.endpoint))
        ours = {PD_HEADER: pick.pd_path} if pick.pd_path is not None else {}
        answers = [
            protocol.routed_headers(
                pick.endpoint,
                ours,
                remove=OWNED_HEADERS + self.picker.client_key_headers,
                body_bytes=len(raw) if body_ended else None,
            )
        ]
        if body_ended:
            answers += protocol.request_body(raw)
        self.picker.observe_decision(time.perf_counter() - self._started)
        return answers

    def _with_band(self, parsed: Any, raw: bytes) -> tuple[Any, bytes]:
        """The admitted request's band goes on to the engines (both legs) as their
        `priority`, whatever the client sent."""
        priority = self.picker.engine_priority(self.headers)
        if priority is None:
            return parsed, raw
        parsed, changed = with_priority(parsed, priority)
        return parsed, json.dumps(parsed).encode() if changed else raw

    def _parse(self, raw: bytes) -> tuple[Optional[Any], Optional[Any]]:
        """The generation body as the engines read it (a 400 when none would accept it);
        None for other routes."""
        path = self.headers.get(":path", "").split("?", 1)[0]
        if not is_generation(self.headers.get(":method", ""), path):
            return None, None
        try:
            return parse_client_body(raw, path), None
        except BadRequest as exc:
            return None, protocol.immediate(400, str(exc), param=exc.param)

    # ------------------------------------------------------------------ response path
    def _response_headers(self, request: Any) -> Answers:
        headers = protocol.header_map(request.response_headers)
        self.status = status_code(headers.get(":status", ""))
        served = protocol.upstream_address(request)
        if self.endpoint is not None and self.status >= 500 and protocol.envoy_reply(request):
            # Envoy's own reply: it could not reach (or lost) the endpoint picked.
            self.picker.routing.failed(self.endpoint, "connect_error")
            self.picker.count(self.endpoint, 503)
            return [
                protocol.immediate(
                    503,
                    f"decode sidecar {self.endpoint} could not be reached through the gateway",
                    code="no_backend",
                )
            ]
        if (
            served is not None
            and served != self.endpoint
            and self.endpoint is not None
            and served in self.picker.routing.backends.current
        ):
            # Not where it was sent (a gateway that does its own load balancing): count it
            # there. Only a backend the picker knows: the address is the stream's word, and
            # any other would become a new series of metrics and routing state.
            self._tracked.close()
            self._tracked = contextlib.ExitStack()
            self._tracked.enter_context(self.picker.routing.tracked(served))
            self.endpoint = served
        if self.endpoint is not None:
            self.picker.count(self.endpoint, self.status)
        if request.response_headers.end_of_stream:
            self._finish()
        return [protocol.response_headers(self.endpoint)]

    def _response_body(self, part: Any) -> Answers:
        if self._slot is not None and (part.body or part.end_of_stream):
            self._slot.started()  # the first token: out of the pool's starting bound
        ended = part.end_of_stream
        if ended:
            self._finish()
        return [protocol.response_body(part.body, ended)]

    def _finish(self) -> None:
        """The response is complete: the endpoint served, or failed by its own fault."""
        if self.endpoint is None or self.status is None:
            return
        self.picker.routing.answered(self.endpoint, self.status)
        self._tracked.close()
        self._release()


def status_code(text: str) -> int:
    """An HTTP status from its header (0 when it is not three ASCII digits)."""
    return int(text) if len(text) == 3 and text.isascii() and text.isdigit() else 0
