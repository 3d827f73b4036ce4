"""Talking to the decode engine: decode legs sent (and sent again while the engine restarts),
their answers relayed to the client, buffered or streamed.

Decode legs go through the lean HTTP/1.1 client (http1.py); every other upstream call
(prefill legs, health, other routes) through httpx.
"""

from __future__ import annotations

import asyncio
import functools
import json
import ssl
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, TypeVar, Union

import httpx

from pdpool import tracing

from . import legs
from ..net.asgi import send_bytes, send_error, send_piece, send_start, sse_error_event
from .exchange import Buffered, Exchange, json_or_none
from ..net.http1 import Http1Pool, Response, UpstreamError
from ..net.metrics import SidecarMetrics
from .settings import SidecarSettings
from .span_attributes import leg_attributes, rejection_attributes
from ..net.sse import DONE, EventSplitter, event_json
from .usage import StreamUsageRewriter, count_computed, decode_answer_usage, json_usage

# Failures after which the same request may be sent again: nothing was generated.
RETRYABLE = (
    UpstreamError,
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
    httpx.PoolTimeout,
)

T = TypeVar("T")


class UpstreamUnavailable(Exception):
    """The decode engine could not be reached within the retry window."""


class DecodeRelay:
    """The decode legs of one sidecar: one retry loop for buffered and streamed legs alike."""

    def __init__(self, settings: SidecarSettings, metrics: SidecarMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.pool: Optional[Http1Pool] = None

    def connect(self, ssl_context: Optional[ssl.SSLContext]) -> None:
        self.pool = Http1Pool(
            connect_timeout=self.settings.connect_timeout, ssl_context=ssl_context
        )

    async def aclose(self) -> None:
        if self.pool is not None:
            await self.pool.aclose()

    async def first(self, ex: Exchange, leg: dict[str, Any]) -> Optional[dict[str, Any]]:
        """Decode-first: relays decode's answer unless it is a rejection, which never reaches
        the client; then returns the rejection's kv params ({} when none), else None."""
        started = time.perf_counter()
        if ex.span is None:
            rejection = await self._first(ex, leg, None)
        else:
            attributes = leg_attributes(ex, leg)
            with tracing.span("decode_first", ex.span, "client", attributes) as span:
                rejection = await self._first(ex, leg, span)
                tracing.set_attributes(span, rejection_attributes(rejection))
        if rejection is not None:
            self.metrics.phase("rejection").observe(time.perf_counter() - started)
        return rejection

    async def _first(
        self, ex: Exchange, leg: dict[str, Any], span: Any
    ) -> Optional[dict[str, Any]]:
        if ex.stream:
            return await self._send(ex, leg, functools.partial(_stream_unless_rejected, ex), span)
        resp = await self._send(ex, leg, _read_all, span)
        data = json_or_none(resp.content) if resp.status_code == 200 else None
        if data is not None and legs.is_rejection(data):
            return legs.kv_params_of(data) or {}
        if resp.status_code == 200:
            count_computed(self.metrics, "decode", json_usage(data))
        await relay_buffered(ex, resp.status_code, resp.content, _content_type(resp))
        return None

    async def final(self, ex: Exchange, leg: dict[str, Any]) -> None:
        """The last decode leg; after a prefill leg its usage covers both legs."""
        if ex.path_taken != "aggregated":
            self.metrics.legs_by("decode").inc()
        attributes = None if ex.span is None else leg_attributes(ex, leg)
        with tracing.child("decode", ex.span, "client", attributes) as span:
            if ex.stream:
                return await self._send(
                    ex, leg, functools.partial(self._stream_through, ex), span, "decode_first_token"
                )
            resp = await self._send(ex, leg, _read_all, span)
            content = resp.content
            if resp.status_code == 200:
                content = decode_answer_usage(self.metrics, content, ex.prefill_usage)
            await relay_buffered(ex, resp.status_code, content, _content_type(resp))

    async def _send(
        self,
        ex: Exchange,
        leg: dict[str, Any],
        use: Callable[[Response], Awaitable[T]],
        span: Any = None,
        phase: Optional[str] = None,
    ) -> T:
        """Sends a decode leg and hands its answer to `use`; both again while they fail before
        anything reached the client (the engine broke or restarted before the first token
        was relayed). `use` handles failures after it started the client's answer. `span`:
        the leg's (its traceparent goes upstream); `phase`: observed until the answer's
        headers (a stream's first bytes)."""
        assert self.pool is not None, "connect() runs at startup"
        pool, content = self.pool, json.dumps(leg).encode()
        headers = ex.headers if span is None else tracing.inject(span, ex.headers)
        deadline = time.monotonic() + self.settings.decode_retry_s
        delay, retries = 0.05, 0
        while True:
            try:
                sent = time.perf_counter()
                resp = await pool.send(
                    "POST", self.settings.decode_url + ex.route, content, headers
                )
                if phase is not None:
                    self.metrics.phase(phase).observe(time.perf_counter() - sent)
                try:
                    return await use(resp)
                finally:
                    await resp.aclose()
            except RETRYABLE as exc:
                if time.monotonic() + delay > deadline:
                    raise UpstreamUnavailable(f"decode engine failed: {exc!r}") from None
                self.metrics.decode_retries.inc()
                retries += 1
                tracing.event(span, "retry", {"pdpool.retry": retries, "error": repr(exc)})
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _stream_through(self, ex: Exchange, resp: Response) -> None:
        if resp.status_code != 200:
            return await _relay_refusal(ex, resp)
        rewriter = (
            None
            if ex.prefill_usage is None
            else StreamUsageRewriter(self.metrics, ex.prefill_usage)
        )
        await _pipe_stream(ex, resp, rewriter=rewriter)


async def relay_buffered(ex: Exchange, status: int, content: bytes, content_type: str) -> None:
    if status >= 400:
        ex.path_taken = "upstream_error" if status >= 500 else "client_error"
        if json_or_none(content) is None:
            # Keep OpenAI's error shape even when an upstream sent something else.
            return await send_error(
                ex.send,
                status,
                content.decode("utf-8", "replace")[:500] or "upstream error",
                headers={"x-request-id": ex.request_id},
            )
    await send_bytes(
        ex.send, status, content, ex.out_headers(content_type), content_type=content_type
    )


async def _read_all(resp: Response) -> Buffered:
    return Buffered(resp.status_code, resp.headers, await resp.aread())


def _content_type(resp: Union[Response, Buffered], default: str = "application/json") -> str:
    return resp.headers.get("content-type") or default


async def _relay_refusal(ex: Exchange, resp: Response) -> None:
    """A stream the engine did not start (an error status): its body goes on as it is."""
    await relay_buffered(ex, resp.status_code, await resp.aread(), _content_type(resp))


async def _stream_unless_rejected(ex: Exchange, resp: Response) -> Optional[dict[str, Any]]:
    """Streams decode's answer through unless its first deciding event is a rejection; then
    drains the (short) rejected stream and returns its kv params."""
    if resp.status_code != 200:
        await _relay_refusal(ex, resp)
        return None
    splitter = EventSplitter()
    held: list[bytes] = []
    chunks = resp.aiter_raw()
    decided = await _until_decided(chunks, splitter, held)
    if legs.is_rejection(decided):
        return await _drain_rejection(chunks, splitter, decided, held)
    # Accepted, or the stream ended without a deciding event: pass on what there is.
    await chunks.aclose()  # the rest is relayed from the connection (resp keeps the framing)
    await _pipe_stream(ex, resp, first=b"".join(held) + splitter.rest())
    return None


async def _until_decided(
    chunks: AsyncIterator[bytes], splitter: EventSplitter, held: list[bytes]
) -> Any:
    """Holds back events until one shows whether decode accepted the request (text or a
    finish reason); returns its JSON, None when the stream ended first. Every event of the
    deciding chunk is held: the rest of the stream may have come in the same read."""
    async for chunk in chunks:
        decided: Any = None
        for event in splitter.feed(chunk):
            held.append(event)
            if decided is None:
                data = event_json(event)
                if data is DONE or legs.chunk_decides(data):
                    decided = data
        if decided is not None:
            return decided
    return None


async def _drain_rejection(
    chunks: AsyncIterator[bytes], splitter: EventSplitter, first: dict[str, Any], held: list[bytes]
) -> dict[str, Any]:
    """Reads the rest of a rejected stream (what was held, then what follows) for its kv
    params (final chunk)."""
    kv = legs.kv_params_of(first)

    def look(event: bytes) -> None:
        nonlocal kv
        data = event_json(event)
        if isinstance(data, dict) and legs.kv_params_of(data):
            kv = legs.kv_params_of(data)

    for event in held:
        look(event)
    async for chunk in chunks:
        for event in splitter.feed(chunk):
            look(event)
    return kv or {}


async def _pipe_stream(
    ex: Exchange,
    resp: Response,
    first: bytes = b"",
    rewriter: Optional[StreamUsageRewriter] = None,
) -> None:
    """Relays an upstream stream to the client as it arrives: `first` (what was read
    already), then every piece from the upstream connection's own callback (no task switch
    per token). The piece that completes the upstream answer ends the client's answer in
    the same message (one write fewer per request)."""
    await send_start(ex.send, 200, ex.out_headers(_content_type(resp, "text/event-stream")))
    send = ex.send  # looked up once the answer has started (see proxy.Sidecar._guarded)
    ended = False

    def write(piece: bytes, last: bool) -> Optional[Awaitable[None]]:
        nonlocal ended
        out = rewriter.feed(piece) if rewriter else piece
        if last:
            ended = True
            out += rewriter.rest() if rewriter else b""
        return send_piece(send, out, last)

    try:
        if first:
            waiting = write(first, resp.complete)
            if waiting is not None:
                await waiting
        await resp.relay(write)
    except RETRYABLE as exc:
        # The engine went away mid-stream: tell the client inside the stream.
        await send(
            {
                "type": "http.response.body",
                "body": sse_error_event(502, f"decode engine failed: {exc!r}"),
                "more_body": True,
            }
        )
    if not ended:
        tail = rewriter.rest() if rewriter else b""
        await send({"type": "http.response.body", "body": tail, "more_body": False})
