"""The gateway: the entry point in front of the decode sidecars.

Routes each generation request to the sidecar that owns its prompt prefix (see
affinity.py), balanced by in-flight load; ejects sidecars that fail health probes or
keep failing requests (outlier.py); retries another sidecar when one cannot be reached
(nothing was generated yet). A stream that breaks mid-way (its decode engine or sidecar
died, stalled, or was ejected) goes on elsewhere as a continuation (migration.py), so
the client sees one uninterrupted stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from contextvars import ContextVar
from typing import Any, Awaitable, Iterable, Optional, Union

import httpx

from pdpool import tracing
from pdpool.body_budget import BodiesBusy, BodyBudget, BodyHold

from . import migration
from .settings import GatewaySettings
from .request_trace import CURRENT, GatewayRequest, answer_started, record_outcome
from ..net.apikeys import OPEN_PATHS, ApiKeys, presented_key
from ..net.asgi import (
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    forwardable,
    header_dict,
    off_loop_if_large,
    read_body,
    run_until_disconnect,
    send_bodies_busy,
    send_bytes,
    send_error,
    send_piece,
    send_start,
    serve_lifespan,
    sse_error_event,
)
from ..routing.model_rewrite import ModelRewrites, counted_rewrites
from ..net.client_body import parse_client_body, strip_client_kv_params, with_priority
from ..net.routes import GENERATION_PATHS, forwarded
from ..net.turns import StartsPerTurn
from ..routing.backends import Backends
from ..net.http1 import Http1Pool, Response, UpstreamError
from ..net.metrics import CONTENT_TYPE_LATEST, GatewayMetrics
from ..routing.core import PD_HEADER, Routing
from ..routing.outlier import EjectionRace
from ..net.sse import DONE, EventSplitter, event_json, json_event
from ..flow.admission import FlowControl, Shed, Slot, shed_body
from ..flow.tenants import Tenant

log = logging.getLogger("pdpool.gateway")

RETRYABLE = (UpstreamError, httpx.HTTPError)
# A sidecar answers 503 when its decode engine is unreachable: nothing ran, try another.
RETRY_STATUSES = (502, 503)
# The sidecar that answered (the first one, for a stream that migrated).
BACKEND_HEADER = "x-pdpool-backend"
# Headers the gateway's own server sets again (or that describe the upstream connection).
RELAY_DROP = frozenset({"content-length", "transfer-encoding", "connection", "date", "server"})
# The request's flow-control slot, where flow control is on (for its usage).
FLOW_SLOT: ContextVar[Optional[Slot]] = ContextVar("pdpool_flow_slot", default=None)
# How one upstream attempt ended: None when the client was answered, else (reason, message).
Attempt = Optional[tuple[str, str]]


class _Leg:
    """Progress of one upstream attempt, watched by `_supervised`."""

    def __init__(self) -> None:
        self.last_byte: Optional[float] = None
        self.started = False  # the client's response has started (no retry then)


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings.validate()
        self.api_keys = ApiKeys(settings.api_keys_file) if settings.api_keys_file else None
        self.metrics = GatewayMetrics()
        self._starts = StartsPerTurn()  # a burst's forwards interleaved with first tokens
        self.bodies = BodyBudget(settings.max_body_bytes_in_flight)
        self.routing = Routing(settings, self.metrics)
        # Flow control (flow/admission.py); None: off, and no step of it on the hot path.
        self.flow = (
            FlowControl(
                settings.tenants_file,
                settings.tenant_header,
                self.routing.healthy_backends,
                self.metrics.registry,
                settings.default_max_tokens,
            )
            if settings.tenants_file
            else None
        )
        self.sidecars = Backends(
            settings.tls_ca_file, settings.tls_any_name, settings.probe_timeout_s
        )
        self.scheme, self.tls = self.sidecars.scheme, self.sidecars.tls
        # GIE's InferenceModelRewrite rules (routing/model_rewrite.py); None: off.
        self.rewrites: Optional[ModelRewrites] = (
            counted_rewrites(settings.model_rewrites_file, self.metrics.registry)
            if settings.model_rewrites_file
            else None
        )
        self.pool = Http1Pool(
            connect_timeout=settings.connect_timeout,  # proxied traffic
            ssl_context=self.tls,
        )

    # ------------------------------------------------------------------ lifecycle
    async def startup(self) -> None:
        s = self.settings
        await self.sidecars.start(
            self.routing, self.flow, self.metrics, s.connect_timeout, s.kv_tokenize_timeout_s
        )

    async def shutdown(self) -> None:
        if self.flow is not None:
            await self.flow.stop()
        await self.routing.stop()
        await self.pool.aclose()
        await self.sidecars.stop()

    async def check_health(self) -> None:
        await self.routing.check_health()

    # ------------------------------------------------------------------ ASGI
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await serve_lifespan(receive, send, self.startup, self.shutdown)
        if scope["type"] != "http":
            return
        route = scope["path"]
        if (
            self.api_keys is not None
            and route not in OPEN_PATHS
            and not self.api_keys.allows(presented_key(header_dict(scope)))
        ):
            return await send_error(
                send,
                401,
                "a valid API key is required (Authorization: Bearer <key>)",
                code="invalid_api_key",
                headers={"www-authenticate": "Bearer"},
            )
        tenant = None
        if self.flow is not None and route not in OPEN_PATHS:
            tenant = self.flow.tenant(header_dict(scope))
            if tenant is None:
                return await self._unknown_tenant(send)
        if route == "/metrics" and scope["method"] == "GET":
            return await send_bytes(
                send, 200, self.metrics.render(), content_type=CONTENT_TYPE_LATEST
            )
        if route in ("/health", "/ready") and scope["method"] == "GET":
            healthy = self.routing.healthy_backends()
            if healthy:
                return await send_bytes(send, 200, json.dumps({"healthy": healthy}).encode())
            return await send_error(send, 503, "no healthy decode sidecar")
        if not forwarded(scope["method"], route):  # a backend's internal routes stay inside
            return await send_error(send, 404, f"no route {scope['method']} {route}")
        await self._proxy(scope, receive, send, tenant)

    async def _unknown_tenant(self, send: Send) -> None:
        assert self.flow is not None
        if self.flow.tenant_header is not None:
            return await send_error(
                send,
                401,
                f"the {self.flow.tenant_header} header must name a tenant of the tenants file",
                code="unknown_tenant",
            )
        return await send_error(
            send,
            401,
            "a valid API key is required (Authorization: Bearer <key>)",
            code="invalid_api_key",
            headers={"www-authenticate": "Bearer"},
        )

    async def _proxy(
        self, scope: Scope, receive: Receive, send: Send, tenant: Optional[Tenant] = None
    ) -> None:
        with self.bodies.hold() as hold:  # a large body counts until its request ends
            await self._proxy_held(scope, receive, send, tenant, hold)

    async def _proxy_held(
        self, scope: Scope, receive: Receive, send: Send, tenant: Optional[Tenant], hold: BodyHold
    ) -> None:
        raw = await self._body(scope, receive, send, hold)
        if raw is None:
            return
        headers = header_dict(scope)
        if self.api_keys is not None or (self.flow is not None and not self.flow.tenant_header):
            # the client's key goes no further than the gateway
            headers.pop("authorization", None)
            headers.pop("x-api-key", None)
        headers.setdefault("x-request-id", uuid.uuid4().hex)
        if scope["path"] not in GENERATION_PATHS:
            return await self._forward(scope, receive, send, raw, headers, None)
        await self._starts.wait(tenant.name if tenant is not None else None)
        read = await _generation_body(scope["path"], raw, headers["x-request-id"], send)
        if read is None:
            return
        body, raw = read
        if self.rewrites is not None:  # GIE's weighted model rewrite, before routing
            body, raw = self.rewrites.apply(body, raw)
        slot = None
        if tenant is not None:  # flow control: wait for the request's turn
            slot = await self._admission(tenant, headers, body, receive, send)
            if slot is None:
                return
            FLOW_SLOT.set(slot)  # the flow's task (a copy of this context) sees it
            send = _first_body_starts(send, slot)
            assert self.flow is not None
            # The band goes on to the engines (both legs), as their `priority`.
            body, changed = with_priority(body, self.flow.engine_priority(tenant, headers))
            raw = json.dumps(body).encode() if changed else raw
        req = GatewayRequest(self.metrics, headers, scope["path"], body.get("stream") is True)
        CURRENT.set(req)  # this request's task (and the flow's, a copy of its context)
        try:
            await self._forward(scope, receive, send, raw, headers, body, req)
        finally:
            req.finish()
            if slot is not None:
                slot.release()

    async def _body(
        self, scope: Scope, receive: Receive, send: Send, hold: BodyHold
    ) -> Optional[bytes]:
        """The request's body; None when it was answered here (413, 503) or its client left."""
        try:
            return await read_body(receive, self.settings.max_body_bytes, scope, hold)
        except ClientGone:
            return None
        except BodyTooLarge:
            await send_error(
                send, 413, f"request body exceeds {self.settings.max_body_bytes} bytes"
            )
        except BodiesBusy as exc:
            self.metrics.bodies_busy.inc()
            await send_bodies_busy(send, exc)
        return None

    async def _admission(
        self, tenant: Tenant, headers: dict[str, str], body: Any, receive: Receive, send: Send
    ) -> Optional[Slot]:
        """The request's slot in the pool once it is admitted; None when it was answered
        429 (with Retry-After) or its client left while it waited (out of the queue)."""
        assert self.flow is not None
        flow, got = self.flow, []

        async def wait_turn() -> None:
            got.append(await flow.acquire(tenant, headers, body))

        try:
            await run_until_disconnect(wait_turn(), receive)
        except Shed as shed:
            message, code, retry = shed_body(shed)
            retry["x-request-id"] = headers["x-request-id"]
            await send_error(send, 429, message, code=code, headers=retry)
            return None
        return got[0] if got else None

    async def _forward(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        raw: bytes,
        headers: dict[str, str],
        body: Optional[dict[str, Any]],
        req: Optional[GatewayRequest] = None,
    ) -> None:
        """Routes the request and runs its flow (a generation has its `req`)."""
        started = time.perf_counter()
        if req is None:
            route = await self.routing.route(body, headers)
        else:
            with req.routing() as span:
                route = await self.routing.route(body, headers)
                req.routed(span, route, started)
        if not route.order:
            return await send_error(send, 503, "no decode sidecar configured")
        headers.pop(PD_HEADER, None)  # only the router sets it
        if route.pd_path is not None:
            headers[PD_HEADER] = route.pd_path
        order = route.order
        if (
            self.settings.migrate
            and scope["method"] == "POST"
            and isinstance(body, dict)
            and migration.can_migrate(scope["path"], body)
        ):
            flow = self._migrating_stream(scope, body, headers, order, send)
        else:
            # A non-streamed generation is read whole before the client sees it, so one
            # that breaks (or whose backend is ejected) is simply sent again elsewhere.
            buffered = isinstance(body, dict) and body.get("stream") is not True
            flow = self._try_backends(scope, raw, headers, order, send, buffered)
        await run_until_disconnect(flow, receive)

    async def _supervised(
        self, backend: str, leg: _Leg, work: Awaitable[Attempt]
    ) -> Union[Attempt, str]:
        """Runs one attempt on `backend`; gives up on it (returns "ejected" or "stalled")
        when the backend is ejected meanwhile (a probe found it sick) while another one is
        healthy, or a started stream goes silent for `stall_timeout_s`. (With no other
        backend the request stays: its sidecar retries a restarting engine itself.)"""
        loop = asyncio.get_running_loop()
        race = EjectionRace(self.routing.outliers, backend, work, *RETRYABLE, past_ejection=False)
        async with race:
            while True:
                outcome = await race.wait(1.0)
                if outcome == "done":
                    return race.result()
                if outcome == "ejected":
                    if self.routing.others_healthy(backend):
                        return "ejected"
                    race.stop_watching()
                if (
                    leg.last_byte is not None
                    and loop.time() - leg.last_byte > self.settings.stall_timeout_s
                ):
                    return "stalled"

    # ------------------------------------------------------------------ plain requests
    async def _try_backends(
        self,
        scope: Scope,
        raw: bytes,
        headers: dict[str, str],
        order: list[str],
        send: Send,
        buffered: bool = False,
    ) -> None:
        path = scope["path"]
        if scope.get("query_string"):
            path += "?" + scope["query_string"].decode("latin-1")
        fwd = forwardable(headers)
        last_error = "no decode sidecar reachable"
        for attempt, backend in enumerate(order):
            if attempt:
                self.metrics.retries.inc()
            with self.routing.tracked(backend), _attempt_span(backend, attempt) as span:
                leg = _Leg()
                outcome = await self._supervised(
                    backend,
                    leg,
                    self._attempt(
                        scope["method"],
                        backend,
                        path,
                        raw,
                        fwd if span is None else tracing.inject(span, fwd),
                        send,
                        buffered,
                        leg,
                        last=attempt + 1 == len(order),
                    ),
                )
                record_outcome(span, outcome)
            if outcome is None:
                return
            if leg.started:  # a relayed stream (not migratable) left its ejected backend
                self.routing.failed(backend, outcome if isinstance(outcome, str) else outcome[0])
                return await send(
                    {
                        "type": "http.response.body",
                        "more_body": False,
                        "body": sse_error_event(502, f"{backend}: {outcome}"),
                    }
                )
            reason = outcome[0] if isinstance(outcome, tuple) else outcome  # or ejected
            last_error = f"{backend}: {outcome[1] if isinstance(outcome, tuple) else outcome}"
            self.routing.failed(backend, reason)
        await send_error(send, 503, last_error, code="no_backend")

    async def _attempt(
        self,
        method: str,
        backend: str,
        path: str,
        raw: bytes,
        fwd: dict[str, str],
        send: Send,
        buffered: bool,
        leg: _Leg,
        last: bool,
    ) -> Attempt:
        """None when the client was answered, else (failure reason, message)."""
        try:
            resp = await self.pool.send(method, f"{self.scheme}://{backend}{path}", raw, fwd)
        except RETRYABLE as exc:
            return "connect_error", f"unreachable: {exc!r}"
        try:
            if resp.status_code in RETRY_STATUSES and not last:
                return "server_error", f"answered {resp.status_code}"
            if buffered:
                try:
                    content = await resp.aread()
                except RETRYABLE as exc:
                    return "broken", f"broke mid-answer: {exc!r}"
                self.metrics.requests.labels(backend, str(resp.status_code)).inc()
                self.routing.answered(backend, resp.status_code)
                if self.flow is not None:
                    _record_usage(content)
                await _send_whole(send, resp, content, backend)
                return None
            self.metrics.requests.labels(backend, str(resp.status_code)).inc()
            self.routing.answered(backend, resp.status_code)
            leg.started = True
            await self._relay(resp, send, backend)
            return None
        finally:
            await resp.aclose()

    async def _relay(self, resp: Response, send: Send, backend: str) -> None:
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in RELAY_DROP}
        headers[BACKEND_HEADER] = backend
        answer_started(headers)
        await send_start(send, resp.status_code, headers)
        ended = False

        def write(piece: bytes, last: bool) -> Optional[Awaitable[None]]:
            # from the backend connection's callback; the last piece ends the answer
            nonlocal ended
            ended = last
            return send_piece(send, piece, last)

        try:
            await resp.relay(write)
        except RETRYABLE:
            log.warning("backend stream broke mid-response")
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    # ------------------------------------------------------------------ migrating streams
    async def _migrating_stream(
        self,
        scope: Scope,
        body: dict[str, Any],
        headers: dict[str, str],
        order: list[str],
        send: Send,
    ) -> None:
        """A streamed generation that survives the death of its decode path: when a leg
        breaks, the rest is asked of another backend as a token-id continuation."""
        state = migration.StreamState(scope["path"], body, self.settings.default_max_tokens)
        fwd = forwardable(headers)
        fwd["content-type"] = "application/json"
        first = json.dumps({**body, migration.TOKEN_IDS: True}).encode()
        client = {"started": False}
        failed: list[str] = []
        last_error = "no decode sidecar reachable"
        attempts = len(order) + self.settings.max_migrations
        for attempt in range(attempts):
            if not client["started"]:
                route, payload, continuation = scope["path"], first, False
            elif state.can_continue():
                route, continuation = "/v1/completions", True
                payload = json.dumps(state.continuation()).encode()
            else:
                break
            backend = self.routing.next_backend(order, failed) if attempt else order[0]
            if attempt:
                self.metrics.retries.inc()
                if backend in failed:
                    await asyncio.sleep(min(0.25 * attempt, 2.0))
            with (
                self.routing.tracked(backend),
                _attempt_span(backend, attempt, continuation) as span,
            ):
                leg = _Leg()
                outcome = await self._supervised(
                    backend,
                    leg,
                    self._stream_leg(
                        backend,
                        route,
                        payload,
                        fwd if span is None else tracing.inject(span, fwd),
                        state,
                        send,
                        client,
                        continuation,
                        leg,
                        last=attempt + 1 == attempts,
                    ),
                )
                record_outcome(span, outcome)
            if outcome is None:
                if continuation:
                    self.metrics.migrations.labels("ok").inc()
                return
            reason = outcome[0] if isinstance(outcome, tuple) else outcome
            last_error = f"{backend}: {outcome[1] if isinstance(outcome, tuple) else outcome}"
            log.warning(
                "stream leg on %s failed (%s)%s",
                backend,
                reason,
                "; continuing elsewhere" if client["started"] else "",
            )
            self.routing.failed(backend, reason)
            failed.append(backend)
        if not client["started"]:
            return await send_error(send, 503, last_error, code="no_backend")
        if state.finished:  # only the tail broke: end the stream properly
            tail = b"".join(json_event(e) for e in state.final_events()) + b"data: [DONE]\n\n"
            await send({"type": "http.response.body", "body": tail, "more_body": False})
            return
        self.metrics.migrations.labels("failed").inc()
        await send(
            {
                "type": "http.response.body",
                "more_body": False,
                "body": sse_error_event(502, f"the stream could not be continued: {last_error}"),
            }
        )

    async def _stream_leg(
        self,
        backend: str,
        route: str,
        payload: bytes,
        fwd: dict[str, str],
        state: "migration.StreamState",
        send: Send,
        client: dict[str, bool],
        continuation: bool,
        leg: _Leg,
        last: bool,
    ) -> Attempt:
        """One upstream leg of a migrating stream. None when the client's stream is
        complete (or answered with an error it must see); else (reason, message)."""
        loop = asyncio.get_running_loop()
        try:
            resp = await self.pool.send("POST", f"{self.scheme}://{backend}{route}", payload, fwd)
        except RETRYABLE as exc:
            return "connect_error", f"unreachable: {exc!r}"
        try:
            self.metrics.requests.labels(backend, str(resp.status_code)).inc()
            if resp.status_code != 200:
                outcome = await _relay_refusal(send, resp, backend, client, last)
                if outcome is None:  # the client has the answer: counted as the policy says
                    self.routing.answered(backend, resp.status_code)
                return outcome
            splitter = EventSplitter()
            try:
                async for chunk in resp.aiter_raw():
                    leg.last_byte = loop.time()
                    out, broken = _relayed_events(splitter.feed(chunk), state, continuation)
                    if out:
                        await _relay_body(send, resp, backend, client, b"".join(out))
                    if broken is not None:
                        return "stream_error", broken
            except RETRYABLE as exc:
                return "broken", repr(exc)
        finally:
            await resp.aclose()
        if not state.done:
            return "broken", "stream ended without [DONE]"
        self.routing.served(backend)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return None


async def _generation_body(
    route: str, raw: bytes, request_id: str, send: Send
) -> Optional[tuple[dict[str, Any], bytes]]:
    """A generation's body, checked as the sidecar and the engine check it (pdpool.protocol:
    a body none of them would accept never takes a backend's time) and without client KV
    params (a client never steers KV transfers), with the bytes that go on; None when it
    was answered 400."""
    try:
        body = await off_loop_if_large(parse_client_body, raw, route)
    except ValueError as exc:
        await send_error(
            send,
            400,
            str(exc),
            param=getattr(exc, "param", None),
            headers={"x-request-id": request_id},
        )
        return None
    body, dropped = strip_client_kv_params(body)
    return body, json.dumps(body).encode() if dropped else raw


def _attempt_span(backend: str, number: int, continuation: bool = False) -> Any:
    """The current request's span for one attempt on a backend (None: not traced)."""
    req = CURRENT.get()
    return (
        req.attempt(backend, number, continuation) if req is not None else contextlib.nullcontext()
    )


async def _relay_refusal(
    send: Send, resp: Response, backend: str, client: dict[str, bool], last: bool
) -> Attempt:
    """A leg answered other than 200: retried elsewhere when it may be (and this is not the
    last leg), else shown to the client: whole when nothing was sent yet, or as an error
    event ending a stream already started."""
    if resp.status_code in RETRY_STATUSES and not last:
        return "server_error", f"answered {resp.status_code}"
    try:
        content = await resp.aread()
    except RETRYABLE as exc:
        return "broken", repr(exc)
    if client["started"]:
        message = content.decode("utf-8", "replace")[:300]
        await send(
            {
                "type": "http.response.body",
                "more_body": False,
                "body": sse_error_event(resp.status_code, message),
            }
        )
        return None
    await _send_whole(send, resp, content, backend)
    return None


def _relayed_events(
    events: Iterable[bytes], state: "migration.StreamState", continuation: bool
) -> tuple[list[bytes], Optional[str]]:
    """The events of one upstream chunk as the client gets them, and the error when the
    chunk carries one that ends the leg (the sidecar's engine died)."""
    out: list[bytes] = []
    for event in events:
        data = event_json(event)
        if data is DONE:
            state.done = True
            out.append(b"data: [DONE]\n\n")
            continue
        if not isinstance(data, dict):
            continue  # comments, keep-alives
        if "error" in data and not data.get("choices"):
            return out, str(data.get("error"))[:200]
        relayed = state.observe(data, continuation)
        if relayed is not None:
            out.append(json_event(relayed))
    return out, None


async def _relay_body(
    send: Send, resp: Response, backend: str, client: dict[str, bool], body: bytes
) -> None:
    """Relays a piece of the stream; the first one starts the client's response."""
    if not client["started"]:
        client["started"] = True
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in RELAY_DROP}
        headers[BACKEND_HEADER] = backend
        answer_started(headers)
        await send_start(send, 200, headers)
    await send({"type": "http.response.body", "body": body, "more_body": True})


def _first_body_starts(send: Send, slot: Slot) -> Send:
    """`send`, telling flow control when the answer's first byte goes out (a stream's first
    token): the slot leaves the pool's starting bound then, not when the answer ends."""

    async def sending(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and (
            message.get("body") or not message.get("more_body")
        ):
            slot.started()
        await send(message)

    return sending


def _record_usage(content: bytes) -> None:
    """Flow control's token budget: a whole answer's usage replaces the request's estimate
    (streams keep the estimate)."""
    slot = FLOW_SLOT.get()
    if slot is None or not slot.counts_tokens:
        return
    try:
        used = json.loads(content)["usage"]["total_tokens"]
    except (ValueError, KeyError, TypeError):
        return
    if isinstance(used, int):
        slot.record_usage(used)


async def _send_whole(send: Send, resp: Response, content: bytes, backend: str) -> None:
    """An upstream answer read whole, relayed with its headers and the backend that gave it."""
    headers = {k: v for k, v in resp.headers.items() if k.lower() not in RELAY_DROP}
    headers[BACKEND_HEADER] = backend
    answer_started(headers)
    content_type = headers.pop("content-type", "application/json")
    await send_bytes(send, resp.status_code, content, headers, content_type=content_type)
