"""The gateway: the entry point in front of the decode sidecars.

Routes each generation request to the sidecar that owns its prompt prefix (see
affinity.py), balanced by in-flight load; skips sidecars that fail health checks; retries
another sidecar when one cannot be reached (nothing was generated yet). Streams pass
through untouched.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Optional

import httpx

from .affinity import DEFAULT_PREFIX_CHARS, HashRing, affinity_key, route_order
from .asgi import (BodyTooLarge, ClientGone, Receive, Send, forwardable, header_dict,
                   read_body, run_until_disconnect, send_bytes, send_error, send_start)
from .discovery import EndpointSet
from .http1 import Http1Pool, Response, UpstreamError
from .metrics import CONTENT_TYPE_LATEST, GatewayMetrics

log = logging.getLogger("pdpool.gateway")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
RETRYABLE = (UpstreamError, httpx.HTTPError)
# A sidecar answers 503 when its decode engine is unreachable: nothing ran, try another.
RETRY_STATUSES = (502, 503)
# Headers the gateway's own server sets again (or that describe the upstream connection).
RELAY_DROP = frozenset({"content-length", "transfer-encoding", "connection", "date", "server"})


@dataclass
class GatewaySettings:
    decode_urls: list[str] = field(default_factory=list)
    decode_service: Optional[str] = None
    refresh_s: float = 5.0
    health_interval_s: float = 2.0
    prefix_chars: int = DEFAULT_PREFIX_CHARS
    balance: float = 1.25
    connect_timeout: float = 2.0

    def validate(self) -> "GatewaySettings":
        if not self.decode_urls and not self.decode_service:
            raise ValueError("give --decode-url (repeatable) or --decode-service")
        if self.prefix_chars < 1 or self.balance < 1.0:
            raise ValueError("prefix chars must be >= 1 and balance >= 1.0")
        return self


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings.validate()
        self.metrics = GatewayMetrics()
        self.backends = EndpointSet(settings.decode_urls, settings.decode_service,
                                    settings.refresh_s)
        self.in_flight: dict[str, int] = {}
        self.unhealthy: set[str] = set()
        self._ring = HashRing([])
        self.client: Optional[httpx.AsyncClient] = None   # health checks
        self.pool = Http1Pool(connect_timeout=settings.connect_timeout)  # proxied traffic
        self._health_task: Optional[asyncio.Task] = None

    # ------------------------------------------------------------------ lifecycle
    async def startup(self) -> None:
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=self.settings.connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024))
        await self.backends.start()
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_forever())

    async def shutdown(self) -> None:
        if self._health_task:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        await self.backends.stop()
        await self.pool.aclose()
        if self.client:
            await self.client.aclose()
            self.client = None

    def ring(self) -> HashRing:
        current = self.backends.current
        if sorted(set(current)) != self._ring.backends:
            self._ring = HashRing(current)
        return self._ring

    async def check_health(self) -> None:
        async def probe(backend: str) -> None:
            try:
                r = await self.client.get(f"http://{backend}/health", timeout=2.0)
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            self._mark(backend, ok)
        await asyncio.gather(*(probe(b) for b in self.backends.current))

    def _mark(self, backend: str, ok: bool) -> None:
        (self.unhealthy.discard if ok else self.unhealthy.add)(backend)
        self.metrics.healthy.labels(backend).set(1 if ok else 0)

    async def _health_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            await self.check_health()

    # ------------------------------------------------------------------ ASGI
    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await self.startup()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await self.shutdown()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        route = scope["path"]
        if route == "/metrics" and scope["method"] == "GET":
            return await send_bytes(send, 200, self.metrics.render(),
                                    content_type=CONTENT_TYPE_LATEST)
        if route == "/health" and scope["method"] == "GET":
            healthy = [b for b in self.backends.current if b not in self.unhealthy]
            if healthy:
                return await send_bytes(send, 200, json.dumps({"healthy": healthy}).encode())
            return await send_error(send, 503, "no healthy decode sidecar")
        await self._proxy(scope, receive, send)

    async def _proxy(self, scope: dict, receive: Receive, send: Send) -> None:
        try:
            raw = await read_body(receive)
        except ClientGone:
            return
        except BodyTooLarge:
            return await send_error(send, 413, "request body too large")
        headers = header_dict(scope)
        headers.setdefault("x-request-id", uuid.uuid4().hex)
        key = ""
        if scope["path"] in GENERATION_PATHS:
            try:
                key = affinity_key(json.loads(raw), self.settings.prefix_chars)
            except (ValueError, RecursionError):
                key = ""  # the sidecar answers the client's malformed body with a 400
        order, preferred = route_order(self.ring(), key, lambda b: self.in_flight.get(b, 0),
                                       lambda b: b not in self.unhealthy, self.settings.balance)
        if not order:
            return await send_error(send, 503, "no decode sidecar configured")
        self.metrics.affinity.labels("preferred" if preferred else "spilled").inc()
        await run_until_disconnect(self._try_backends(scope, raw, headers, order, send), receive)

    async def _try_backends(self, scope, raw: bytes, headers: dict, order: list[str],
                            send: Send) -> None:
        path = scope["path"]
        if scope.get("query_string"):
            path += "?" + scope["query_string"].decode("latin-1")
        fwd = forwardable(headers)
        last_error = "no decode sidecar reachable"
        for attempt, backend in enumerate(order):
            if attempt:
                self.metrics.retries.inc()
            self.in_flight[backend] = self.in_flight.get(backend, 0) + 1
            self.metrics.in_flight.labels(backend).inc()
            try:
                try:
                    resp = await self.pool.send(scope["method"], f"http://{backend}{path}",
                                                raw, fwd)
                except RETRYABLE as exc:
                    self._mark(backend, False)
                    last_error = f"{backend} unreachable: {exc!r}"
                    continue
                try:
                    if resp.status_code in RETRY_STATUSES and attempt + 1 < len(order):
                        last_error = f"{backend} answered {resp.status_code}"
                        continue
                    self.metrics.requests.labels(backend, str(resp.status_code)).inc()
                    return await self._relay(resp, send)
                finally:
                    await resp.aclose()
            finally:
                self.in_flight[backend] -= 1
                self.metrics.in_flight.labels(backend).dec()
        await send_error(send, 503, last_error, code="no_backend")

    async def _relay(self, resp: Response, send: Send) -> None:
        headers = {k: v for k, v in resp.headers.items()
                   if k.lower() not in RELAY_DROP}
        await send_start(send, resp.status_code, headers)
        try:
            async for chunk in resp.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except RETRYABLE:
            log.warning("backend stream broke mid-response")
        await send({"type": "http.response.body", "body": b"", "more_body": False})
