"""The sidecar's ASGI app: one per decode engine, in front of it.

Generation requests (`/v1/completions`, `/v1/chat/completions`) are read, checked and run
through the pool's P/D flow (flows.py); the other generation routes (net/routes.py: the
token route) are read, checked and cleaned alike, then run whole on the decode engine;
`/health`, `/ready` and `/metrics` are answered here; every other route is passed to the
decode engine as it is.

    proxy.py          the app: lifecycle, routes, the request read and its errors
    flows.py          decode-first / prefill-first / aggregated: which legs, in which order
    prefill_legs.py   which prefill engine runs a prefill leg, running it, lease release
    relay.py          decode legs (one retry loop), relaying their answers to the client
    usage.py          usage covering both legs, computed-token counts
    exchange.py       one request as it moves through the legs
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any, Optional

import httpx

from pdpool import tracing
from pdpool.body_budget import BodiesBusy, BodyBudget, BodyHold

from ..net.client_body import parse_client_body, strip_client_kv_params
from ..net.routes import GENERATION_PATHS, PD_PATHS
from ..net.asgi import (
    BodyTooLarge,
    ClientGone,
    Message,
    Receive,
    Scope,
    Send,
    forwardable,
    header_dict,
    off_loop_if_large,
    raw_headers,
    read_body,
    run_until_disconnect,
    send_bodies_busy,
    send_bytes,
    send_error,
    serve_lifespan,
)
from ..net.turns import StartsPerTurn
from .adapter_legs import AdapterLegs
from .capability import EngineCapability
from .capability_share import CapabilityShare
from .exchange import Exchange
from .flows import Flow, Flows
from ..net.metrics import CONTENT_TYPE_LATEST, KVBlocksCollector, SidecarMetrics
from ..flow.saturation import ENGINE_METRICS_PATH
from .prefill_legs import PrefillLegs, prefill_pool
from ..routing.prefill_ranking import PrefillRanking
from .relay import RETRYABLE, DecodeRelay, UpstreamUnavailable
from .revision_legs import RevisionLegs
from ..net.security import PREFILLER_HEADER, ForbiddenTarget, allowed_targets
from .settings import SidecarSettings
from ..net.upstream import ClientShards, readiness

log = logging.getLogger("pdpool.sidecar")


class Sidecar:
    """ASGI app. Decode legs go through the lean HTTP/1.1 client (relay.py), everything
    else (prefill legs, health, other routes) through httpx."""

    def __init__(self, settings: SidecarSettings) -> None:
        self.settings = settings.validate()
        self.metrics = SidecarMetrics()
        self._starts = StartsPerTurn()
        self.bodies = BodyBudget(settings.max_body_bytes_in_flight)
        # The prefill engines: discovery, legs in flight, ejection and probes.
        self.prefill_pool = prefill_pool(self.settings, self.metrics)
        # The pool's parts, under the names tests read.
        self.picker, self.endpoints = self.prefill_pool.picker, self.prefill_pool.endpoints
        self.outliers = self.prefill_pool.outliers
        self.prefill_ranking = PrefillRanking(
            self.picker,
            settings.prefill_kv_events,
            settings.kv_block_size,
            settings.kv_tokenizer,
            events_port=settings.prefill_kv_events_port,
            events_replay_port=settings.prefill_kv_events_replay_port,
        )
        if self.prefill_ranking.router is not None:
            self.metrics.registry.register(
                KVBlocksCollector(
                    "pdpool_sidecar_prefill_kv_blocks",
                    "Blocks each prefill engine holds, as its KV events told the ranking",
                    "endpoint",
                    self.prefill_ranking.router.index.block_counts,
                )
            )
        self.clients: Optional[ClientShards] = None
        self._probe_task: Optional[asyncio.Task[None]] = None
        self.capability = EngineCapability(
            settings.engine_rejects, probe_timeout_s=settings.probe_timeout_s or 2.0
        )
        self._capability_task: Optional[asyncio.Task[None]] = None
        # One worker of several (net/workers.py): the capability is learned once for all.
        self.capability_share: Optional[CapabilityShare] = None
        self._starting: Optional[asyncio.Future[None]] = None  # startup() without lifespan
        self.metrics.engine_rejects.set_function(lambda: self.capability.gauge_value)
        # The parts share the app's settings object (tests change it on a running app).
        self.prefill = PrefillLegs(
            self.settings,
            self.metrics,
            pool=self.prefill_pool,
            ranking=self.prefill_ranking,
            next_client=lambda: self.client,
            adapters=AdapterLegs(self.settings, self.metrics, lambda: self.client),
            revisions=RevisionLegs(self.settings, self.metrics, lambda: self.client),
        )
        self.decode = DecodeRelay(self.settings, self.metrics)
        self.flows = Flows(
            self.settings,
            self.metrics,
            capability=self.capability,
            decode=self.decode,
            prefill=self.prefill,
        )

    # ------------------------------------------------------------------ lifecycle
    async def startup(self) -> None:
        tls = self.settings.ssl_context()
        self.clients = ClientShards(connect_timeout=self.settings.connect_timeout, ssl_context=tls)
        self.decode.connect(tls)
        await self.prefill_pool.start()
        await self.prefill_ranking.sync(self.endpoints.current)
        self.prefill.revisions.refresh(self.endpoints.current)  # known before the first leg
        if self.settings.probe_interval_s > 0:
            self._probe_task = asyncio.create_task(self.prefill.probe_forever())
        if self.settings.mode == "decode-first" and self.capability.known is None:
            # In the background only: requests read what is known and never wait for it.
            probe = self.capability.probe_until_known(lambda: self.client, self.settings.decode_url)
            if self.capability_share is not None:
                probe = self.capability_share.learn(self.capability, probe)
            self._capability_task = asyncio.create_task(probe)

    async def shutdown(self) -> None:
        await _cancelled(self._capability_task)
        self._capability_task = None
        await _cancelled(self._probe_task)
        self._probe_task = None
        await self.prefill_pool.stop()
        self.prefill_ranking.close()
        if self.clients:
            await self.clients.aclose()
            await self.decode.aclose()
            self.clients = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send, self.startup, self.shutdown)
            return
        if scope["type"] != "http":
            return
        if self.clients is None:  # served without lifespan (some test clients)
            await self._start_once()
        route, method = scope["path"], scope["method"]
        if route in PD_PATHS and method == "POST":
            await self._starts.wait()
            with self.bodies.hold() as hold:  # a large body counts until its request ends
                await self._generation(scope, receive, send, hold)
        elif route == "/metrics" and method == "GET":
            await send_bytes(send, 200, self.metrics.render(), content_type=CONTENT_TYPE_LATEST)
        elif route == ENGINE_METRICS_PATH and method == "GET":
            # the engine's own /metrics (the gateway's flow control reads its saturation)
            await self._pass_through({**scope, "path": "/metrics"}, receive, send)
        elif route == "/health" and method == "GET":
            await self._health(send)
        elif route == "/ready" and method == "GET":
            await self._health(send, "/ready")
        else:
            with self.bodies.hold() as hold:
                await self._pass_through(scope, receive, send, hold)

    async def _start_once(self) -> None:
        """startup() for an app served without lifespan: run once, by the first request;
        the requests that arrive meanwhile wait for that same start (nothing can be served
        before it), instead of each making clients and background tasks of its own."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self.startup())
        await asyncio.shield(self._starting)

    @property
    def client(self) -> httpx.AsyncClient:
        """The next upstream client (see upstream.py)."""
        assert self.clients is not None, "startup() makes the clients"
        return self.clients.next()

    # ------------------------------------------------------------------ simple routes
    async def _health(self, send: Send, path: str = "/health") -> None:
        """Healthy (ready) when the decode engine is: the gateway routes around a sidecar
        whose engine is down, restarting or wedged (its /ready fails while /health may
        not). An engine without /ready (vLLM: any answer but 200 or 503) is judged by its
        /health."""
        try:
            timeout = self.settings.probe_timeout_s or 2.0
            if path == "/health":
                resp = await self.client.get(self.settings.decode_url + path, timeout=timeout)
            else:
                resp = await readiness(self.client, self.settings.decode_url, timeout)
            ok = resp.status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            await send_bytes(send, 200, b'{"status":"ok"}')
        else:
            await send_error(send, 503, "decode engine is not healthy", code="decode_unhealthy")

    async def _pass_through(
        self, scope: Scope, receive: Receive, send: Send, hold: Optional[BodyHold] = None
    ) -> None:
        """Other routes (/v1/models, /tokenize, ...) go to the decode engine as they are (a
        generation route without P/D legs only once checked and cleaned)."""
        try:
            body = await read_body(receive, self.settings.max_body_bytes, scope, hold)
        except ClientGone:
            return
        except BodyTooLarge:
            return await send_error(send, 413, "request body too large")
        except BodiesBusy as exc:
            self.metrics.bodies_busy.inc()
            return await send_bodies_busy(send, exc)
        if scope["path"] in GENERATION_PATHS and scope["method"] == "POST":
            # a generation route without P/D legs: checked and cleaned all the same
            cleaned = await self._cleaned(body, scope["path"], send)
            if cleaned is None:
                return
            body = cleaned
        url = self.settings.decode_url + scope["path"]
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        try:
            resp = await self.client.request(
                scope["method"],
                url,
                content=body,
                # as bytes: a header may carry any latin-1 octet, which httpx will not
                # encode from a str
                headers=raw_headers(forwardable(header_dict(scope))),
                timeout=30.0,
            )
        except httpx.HTTPError as exc:
            return await send_error(send, 503, f"decode engine unreachable: {exc!r}")
        headers = {
            k: v for k, v in resp.headers.items() if k.lower() in ("content-type", "x-request-id")
        }
        await send_bytes(
            send,
            resp.status_code,
            resp.content,
            headers,
            content_type=resp.headers.get("content-type", "application/json"),
        )

    async def _cleaned(self, raw: bytes, route: str, send: Send) -> Optional[bytes]:
        """A generation body run whole on the decode engine, without client KV params;
        None when it was refused (400)."""
        try:
            body = await off_loop_if_large(parse_client_body, raw, route)
        except (ValueError, RecursionError) as exc:
            await self._refuse(send, 400, _bad_request_message(exc), getattr(exc, "param", None))
            return None
        body, dropped = strip_client_kv_params(body)
        if not dropped:
            return raw
        self.metrics.client_kv_dropped.inc()
        return json.dumps(body).encode()

    # ------------------------------------------------------------------ generation
    async def _generation(self, scope: Scope, receive: Receive, send: Send, hold: BodyHold) -> None:
        mode = self.settings.mode
        ex = await self._read_exchange(scope, receive, send, hold)
        if ex is None:
            return
        if tracing.enabled():
            ex.span = tracing.start(
                "sidecar", tracing.from_headers(ex.headers), "server", _request_attributes(ex, mode)
            )
        self.metrics.in_flight.inc()
        gone = False
        try:
            gone = await run_until_disconnect(self._guarded(self.flows.for_mode(mode), ex), receive)
        finally:
            self.metrics.in_flight.dec()
            path = "cancelled" if gone else ex.path_taken
            if ex.span is not None:
                ex.span.set_attribute("pdpool.path", path)
                ex.span.end()
        self.metrics.requests_by(mode, path).inc()
        if ex.stream and ex.first_byte_at:
            self.metrics.ttft_by(path).observe(ex.first_byte_at - ex.read_at)

    async def _read_exchange(
        self, scope: Scope, receive: Receive, send: Send, hold: Optional[BodyHold] = None
    ) -> Optional[Exchange]:
        """The request, checked; None when it was answered (or the client left) here."""
        headers = header_dict(scope)
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        mode = self.settings.mode
        try:
            raw = await read_body(receive, self.settings.max_body_bytes, scope, hold)
        except ClientGone:
            self.metrics.requests.labels(mode, "cancelled").inc()
            return None
        except BodyTooLarge:
            await self._refuse(send, 413, "request body too large")
            return None
        except BodiesBusy as exc:
            self.metrics.requests.labels(mode, "bodies_busy").inc()
            self.metrics.bodies_busy.inc()
            await send_bodies_busy(send, exc, {"x-request-id": request_id})
            return None
        with_id = {"x-request-id": request_id}
        try:
            body = await off_loop_if_large(parse_client_body, raw, scope["path"])
            targets = allowed_targets(_named_prefillers(scope), self.endpoints.current)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, BadRequest
            param = getattr(exc, "param", None)
            await self._refuse(send, 400, _bad_request_message(exc), param, with_id)
            return None
        except ForbiddenTarget as exc:
            self.metrics.forbidden_targets.inc()
            await self._refuse(send, 403, str(exc), PREFILLER_HEADER, with_id)
            return None
        body, dropped = strip_client_kv_params(body)
        if dropped:
            self.metrics.client_kv_dropped.inc()
        ex = Exchange(
            route=scope["path"],
            body=body,
            request_id=request_id,
            send=send,
            headers=forwardable(headers, drop=(PREFILLER_HEADER,)),
            targets=targets,
            stream=bool(body.get("stream")),
        )
        ex.headers["x-request-id"] = request_id
        ex.headers["content-type"] = "application/json"
        return ex

    async def _refuse(
        self,
        send: Send,
        status: int,
        message: str,
        param: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        """A generation request answered with a client error, and counted as one."""
        self.metrics.requests.labels(self.settings.mode, "client_error").inc()
        await send_error(send, status, message, param=param, headers=headers)

    async def _guarded(self, flow: Flow, ex: Exchange) -> None:
        """Upstream trouble becomes an OpenAI-shaped 502/503 while nothing was sent to the
        client; once a stream has started, the stream is ended instead."""
        started = False
        client_send = ex.send

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                ex.first_byte_at = time.perf_counter()
                ex.send = client_send  # what follows goes straight out: one call less per event
            await client_send(message)

        ex.send = tracking_send
        try:
            await flow(ex)
        except UpstreamUnavailable as exc:
            ex.path_taken = "upstream_error"
            if not started:
                await send_error(
                    client_send,
                    503,
                    str(exc),
                    code="decode_unavailable",
                    headers={"x-request-id": ex.request_id},
                )
        except RETRYABLE as exc:
            ex.path_taken = "upstream_error"
            log.warning("upstream failed for %s: %r", ex.request_id, exc)
            if not started:
                await send_error(
                    client_send,
                    502,
                    f"upstream engine failed: {exc!r}",
                    code="upstream_failed",
                    headers={"x-request-id": ex.request_id},
                )
            else:
                await client_send({"type": "http.response.body", "body": b"", "more_body": False})


async def _cancelled(task: Optional[asyncio.Task[None]]) -> None:
    """Cancels a background task and waits until it has stopped."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _named_prefillers(scope: Scope) -> str:
    """The request's x-prefiller-host-port; repeated header lines count as one
    comma-separated list (RFC 9110)."""
    return ",".join(
        v.decode("latin-1")
        for k, v in scope["headers"]
        if k.decode("latin-1").lower() == PREFILLER_HEADER
    )


def _request_attributes(ex: Exchange, mode: str) -> dict[str, Any]:
    return {
        tracing.GEN_AI_REQUEST_ID: ex.request_id,
        "http.route": ex.route,
        "pdpool.mode": mode,
        "pdpool.stream": ex.stream,
    }


def _bad_request_message(exc: Exception) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"request body is not valid JSON: {exc.msg} (line {exc.lineno})"
    return str(exc)


def build_app(settings: SidecarSettings) -> Sidecar:
    return Sidecar(settings)
