"""The sidecar: an ASGI proxy in front of one decode engine that runs the P/D flows.

    decode-first   try decode with the cache-hit threshold; on `cache_threshold` run the
                   prefill leg remotely (pulling decode's cached prefix), then decode.
    prefill-first  always prefill remotely first, then decode.
    aggregated     pass through to the decode engine.

Whatever the path, a request that some path can still serve is served: when no prefill
engine answers, the decode engine prefills itself (threshold 0).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx

from . import legs
from .asgi import (BodyTooLarge, ClientGone, Receive, Send, forwardable, header_dict,
                   off_loop_if_large, read_body, run_until_disconnect, send_bytes, send_error,
                   send_start, sse_error_event)
from .discovery import EndpointSet
from .http1 import Http1Pool, Response, UpstreamError
from .metrics import CONTENT_TYPE_LATEST, SidecarMetrics
from .outlier import OutlierDetector
from .picker import LoadPicker
from .prefill_ranking import PrefillRanking
from .capability import EngineCapability, estimate_prompt_tokens
from .kv_router import PD_HEADER as KV_PATH_HEADER
from .security import PREFILLER_HEADER, ForbiddenTarget, allowed_targets
from .settings import SidecarSettings
from .upstream import ClientShards
from .sse import DONE, EventSplitter, event_json, json_event, usage_of

log = logging.getLogger("pdpool.sidecar")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
PATH_HEADER = "x-pdpool-path"
# Failures after which the same request may be sent again: nothing was generated.
RETRYABLE = (UpstreamError, httpx.ConnectError, httpx.ConnectTimeout,
             httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.PoolTimeout)


class UpstreamUnavailable(Exception):
    """The decode engine could not be reached within the retry window."""


@dataclass
class Exchange:
    """One client request as it moves through the legs."""

    route: str
    body: dict
    headers: dict[str, str]
    request_id: str
    send: Send
    targets: list[str] = field(default_factory=list)  # trusted x-prefiller-host-port
    stream: bool = False
    path_taken: str = "decode"
    prefill_usage: Optional[dict] = None
    reply_headers: dict[str, str] = field(default_factory=dict)

    def out_headers(self, content_type: str) -> dict[str, str]:
        return {"content-type": content_type, "x-request-id": self.request_id,
                PATH_HEADER: self.path_taken, **self.reply_headers}


@dataclass
class Buffered:
    """A fully read upstream answer."""
    status_code: int
    headers: dict
    content: bytes


@dataclass
class PrefillResult:
    kv: Optional[dict] = None                  # usable params for the decode leg
    usage: Optional[dict] = None
    client_error: Optional[tuple[int, bytes]] = None


class Sidecar:
    """ASGI app. Decode legs go through the lean HTTP/1.1 client (http1.py), everything
    else (prefill legs, health, other routes) through httpx."""

    def __init__(self, settings: SidecarSettings) -> None:
        self.settings = settings.validate()
        self.metrics = SidecarMetrics()
        self.picker = LoadPicker()
        self.prefill_ranking = PrefillRanking(
            self.picker, settings.prefill_kv_events, settings.kv_block_size,
            settings.kv_tokenizer, events_port=settings.prefill_kv_events_port,
            events_replay_port=settings.prefill_kv_events_replay_port)
        self.endpoints = EndpointSet(settings.prefill_urls, settings.prefill_service,
                                          settings.prefill_refresh_s)
        self.clients: Optional[ClientShards] = None
        self.outliers = OutlierDetector(
            consecutive_failures=settings.outlier_failures, base_ejection_s=settings.ejection_s,
            on_eject=self._on_eject, on_readmit=self._on_readmit)
        self._probe_task: Optional[asyncio.Task] = None
        self._background: set[asyncio.Future] = set()   # fire-and-forget lease releases
        self.capability = EngineCapability(settings.engine_rejects)
        self._capability_task: Optional[asyncio.Future] = None
        self.metrics.engine_rejects.set_function(lambda: self.capability.gauge_value)

    def _on_eject(self, endpoint: str, reason: str) -> None:
        log.warning("prefill engine %s ejected (%s)", endpoint, reason)
        self.metrics.prefill_ejections.labels(endpoint, reason).inc()
        self.metrics.prefill_ejected.labels(endpoint).set(1)

    def _on_readmit(self, endpoint: str) -> None:
        log.warning("prefill engine %s readmitted", endpoint)
        self.metrics.prefill_ejected.labels(endpoint).set(0)

    # ------------------------------------------------------------------ lifecycle
    async def startup(self) -> None:
        tls = self.settings.ssl_context()
        self.clients = ClientShards(connect_timeout=self.settings.connect_timeout,
                                    ssl_context=tls)
        self.decode_pool = Http1Pool(connect_timeout=self.settings.connect_timeout,
                                     ssl_context=tls)
        await self.endpoints.start()
        await self.prefill_ranking.sync(self.endpoints.current)
        if self.settings.probe_interval_s > 0:
            self._probe_task = asyncio.create_task(self._probe_forever())
        if self.settings.mode == "decode-first" and self.capability.known is None:
            self._capability_task = asyncio.ensure_future(self.capability.probe_until_known(
                lambda: self.client, self.settings.decode_url))

    async def _probe_forever(self) -> None:
        """Health probes of every prefill engine with a short timeout: a wedged engine
        (accepts connections, answers nothing) is ejected within a few seconds, and an
        ejected one comes back once it answers again."""
        async def probe(endpoint: str) -> None:
            # Readiness (an engine whose loop is stuck is not ready); /health where an
            # engine has no /ready (vLLM: any answer but 200 or 503).
            timeout = self.settings.probe_timeout_s or None
            try:
                scheme = self.settings.upstream_scheme
                r = await self.client.get(f"{scheme}://{endpoint}/ready", timeout=timeout)
                if r.status_code not in (200, 503):
                    r = await self.client.get(f"{scheme}://{endpoint}/health",
                                              timeout=timeout)
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            self.outliers.probe(endpoint, ok)

        while True:
            await asyncio.sleep(self.settings.probe_interval_s)
            current = self.endpoints.current
            self.outliers.forget(current)
            try:
                await asyncio.gather(*(probe(e) for e in current))
            except Exception:  # noqa: BLE001 - a probe bug must not end the loop
                log.exception("prefill probe failed")

    async def shutdown(self) -> None:
        if self._capability_task:
            self._capability_task.cancel()
            self._capability_task = None
        if self._probe_task:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
            self._probe_task = None
        await self.endpoints.stop()
        self.prefill_ranking.close()
        if self.clients:
            await self.clients.aclose()
            await self.decode_pool.aclose()
            self.clients = None

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if self.clients is None:  # served without lifespan (some test clients)
            await self.startup()
        route, method = scope["path"], scope["method"]
        if route in GENERATION_PATHS and method == "POST":
            await self._generation(scope, receive, send)
        elif route == "/metrics" and method == "GET":
            await send_bytes(send, 200, self.metrics.render(), content_type=CONTENT_TYPE_LATEST)
        elif route == "/health" and method == "GET":
            await self._health(send)
        elif route == "/ready" and method == "GET":
            await self._health(send, "/ready")
        else:
            await self._pass_through(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:  # noqa: BLE001 - reported to the server
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    @property
    def client(self) -> httpx.AsyncClient:
        """The next upstream client (see upstream.py)."""
        return self.clients.next()

    # ------------------------------------------------------------------ simple routes
    async def _health(self, send: Send, path: str = "/health") -> None:
        """Healthy (ready) when the decode engine is: the gateway routes around a sidecar
        whose engine is down, restarting or wedged (its /ready fails while /health may
        not). An engine without /ready (vLLM: any answer but 200 or 503) is judged by its
        /health."""
        try:
            timeout = self.settings.probe_timeout_s or 2.0
            resp = await self.client.get(self.settings.decode_url + path, timeout=timeout)
            if resp.status_code not in (200, 503) and path != "/health":
                resp = await self.client.get(self.settings.decode_url + "/health",
                                             timeout=timeout)
            ok = resp.status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            await send_bytes(send, 200, b'{"status":"ok"}')
        else:
            await send_error(send, 503, "decode engine is not healthy", code="decode_unhealthy")

    async def _pass_through(self, scope: dict, receive: Receive, send: Send) -> None:
        """Other routes (/v1/models, /tokenize, ...) go to the decode engine as they are."""
        try:
            body = await read_body(receive, self.settings.max_body_bytes, scope)
        except ClientGone:
            return
        except BodyTooLarge:
            return await send_error(send, 413, "request body too large")
        url = self.settings.decode_url + scope["path"]
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        try:
            resp = await self.client.request(scope["method"], url, content=body,
                                             headers=forwardable(header_dict(scope)),
                                             timeout=30.0)
        except httpx.HTTPError as exc:
            return await send_error(send, 503, f"decode engine unreachable: {exc!r}")
        headers = {k: v for k, v in resp.headers.items()
                   if k.lower() in ("content-type", "x-request-id")}
        await send_bytes(send, resp.status_code, resp.content, headers,
                         content_type=resp.headers.get("content-type", "application/json"))

    # ------------------------------------------------------------------ generation
    async def _generation(self, scope: dict, receive: Receive, send: Send) -> None:
        headers = header_dict(scope)
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        mode = self.settings.mode
        try:
            raw = await read_body(receive, self.settings.max_body_bytes, scope)
        except ClientGone:
            self.metrics.requests.labels(mode, "cancelled").inc()
            return
        except BodyTooLarge:
            self.metrics.requests.labels(mode, "client_error").inc()
            return await send_error(send, 413, "request body too large")
        try:
            body = await off_loop_if_large(legs.parse_client_body, raw, scope["path"])
            # Repeated header lines count as one comma-separated list (RFC 9110).
            named = ",".join(v.decode("latin-1") for k, v in scope["headers"]
                             if k.decode("latin-1").lower() == PREFILLER_HEADER)
            targets = allowed_targets(named, self.endpoints.current)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, legs.BadRequest
            self.metrics.requests.labels(mode, "client_error").inc()
            return await send_error(send, 400, _bad_request_message(exc),
                                    param=getattr(exc, "param", None),
                                    headers={"x-request-id": request_id})
        except ForbiddenTarget as exc:
            self.metrics.forbidden_targets.inc()
            self.metrics.requests.labels(mode, "client_error").inc()
            return await send_error(send, 403, str(exc), param=PREFILLER_HEADER,
                                    headers={"x-request-id": request_id})
        body, dropped = legs.strip_client_kv_params(body)
        if dropped:
            self.metrics.client_kv_dropped.inc()
        ex = Exchange(route=scope["path"], body=body, request_id=request_id, send=send,
                      headers=forwardable(headers, drop=(PREFILLER_HEADER,)), targets=targets,
                      stream=bool(body.get("stream")))
        ex.headers["x-request-id"] = request_id
        ex.headers["content-type"] = "application/json"
        flow = {"decode-first": self._decode_first, "prefill-first": self._prefill_first,
                "aggregated": self._aggregated}[mode]
        self.metrics.in_flight.inc()
        try:
            gone = await run_until_disconnect(self._guarded(flow, ex), receive)
        finally:
            self.metrics.in_flight.dec()
        self.metrics.requests.labels(mode, "cancelled" if gone else ex.path_taken).inc()

    async def _guarded(self, flow, ex: Exchange) -> None:
        """Upstream trouble becomes an OpenAI-shaped 502/503 while nothing was sent to the
        client; once a stream has started, the stream is ended instead."""
        started = False
        client_send = ex.send

        async def tracking_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await client_send(message)

        ex.send = tracking_send
        try:
            await flow(ex)
        except UpstreamUnavailable as exc:
            ex.path_taken = "upstream_error"
            if not started:
                await send_error(client_send, 503, str(exc), code="decode_unavailable",
                                 headers={"x-request-id": ex.request_id})
        except RETRYABLE as exc:
            ex.path_taken = "upstream_error"
            log.warning("upstream failed for %s: %r", ex.request_id, exc)
            if not started:
                await send_error(client_send, 502, f"upstream engine failed: {exc!r}",
                                 code="upstream_failed",
                                 headers={"x-request-id": ex.request_id})
            else:
                await client_send({"type": "http.response.body", "body": b"",
                                   "more_body": False})

    # ------------------------------------------------------------------ flows
    async def _aggregated(self, ex: Exchange) -> None:
        ex.path_taken = "aggregated"
        self.metrics.legs.labels("aggregated").inc()
        await self._final_decode(ex, legs.aggregated_leg(ex.body))

    async def _prefill_first(self, ex: Exchange) -> None:
        await self._remote_prefill_then_decode(ex, pull=None)

    async def _decode_first(self, ex: Exchange) -> None:
        # The gateway's precise router (kv_router.py) may have decided the path already
        # from the engines' KV events: "pd" skips the decode-first attempt.
        hint = ex.headers.pop(KV_PATH_HEADER, None)
        if hint == "pd":
            self.metrics.kv_path_hints.labels("pd", "honoured").inc()
            return await self._remote_prefill_then_decode(ex, pull=None)
        if await self.capability.rejects(self.client, self.settings.decode_url) is False:
            return await self._decided_by_length(ex)
        leg = legs.decode_first_leg(ex.body, self.settings.cache_hit_threshold)
        self.metrics.legs.labels("decode_first").inc()
        if ex.stream:
            rejection = await self._retrying(self._try_decode_stream, ex, leg)
        else:
            rejection = await self._try_decode_buffered(ex, leg)
        if hint == "decode":   # a rejection is a misprediction of the gateway's index
            self.metrics.kv_path_hints.labels(
                "decode", "correct" if rejection is None else "mispredicted").inc()
        if rejection is None:
            return
        self.metrics.rejections.inc()
        pull = legs.pull_params_from_rejection(rejection, self.settings.kv_pull_threshold) \
            if self.settings.pull_from_decode else None
        if pull is None and isinstance(rejection, dict) and rejection.get("pdpool_lease"):
            self._release_decode_lease(rejection)   # decode's prefix will not be pulled
        await self._remote_prefill_then_decode(ex, pull)

    async def _decided_by_length(self, ex: Exchange) -> None:
        """Decode-first for an engine that cannot reject (stock vLLM): long prompts are
        prefilled remotely, short ones decoded here (capability.py)."""
        if estimate_prompt_tokens(ex.body) >= self.settings.prefill_min_prompt_tokens:
            self.metrics.length_decisions.labels("pd").inc()
            return await self._remote_prefill_then_decode(ex, pull=None)
        self.metrics.length_decisions.labels("decode").inc()
        ex.path_taken = "decode"
        await self._final_decode(ex, legs.aggregated_leg(ex.body))

    async def _retrying(self, attempt, ex: Exchange, leg: dict):
        """Runs `attempt` again while it fails before sending anything to the client
        (the decode engine broke or restarted before the first token was relayed)."""
        deadline = time.monotonic() + self.settings.decode_retry_s
        delay = 0.05
        while True:
            try:
                return await attempt(ex, leg)
            except RETRYABLE as exc:
                if time.monotonic() + delay > deadline:
                    raise UpstreamUnavailable(f"decode engine failed: {exc!r}") from None
                self.metrics.decode_retries.inc()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _try_decode_buffered(self, ex: Exchange, leg: dict) -> Optional[dict]:
        """Returns the rejection's kv params ({} when none) or None when answered."""
        resp = await self._decode_request(ex, leg)
        content = resp.content
        data = _json_or_none(content) if resp.status_code == 200 else None
        if data is not None and legs.is_rejection(data):
            return legs.kv_params_of(data) or {}
        if resp.status_code == 200:
            self._count_computed("decode", _json_usage(data))
        await self._relay_buffered(ex, resp.status_code, content,
                                   resp.headers.get("content-type", "application/json"))
        return None

    async def _try_decode_stream(self, ex: Exchange, leg: dict) -> Optional[dict]:
        """Streams decode's answer through unless its first deciding chunk is a
        rejection; then drains the (short) rejected stream and returns its kv params."""
        async with self._decode_stream(ex, leg) as resp:
            if resp.status_code != 200:
                await self._relay_buffered(ex, resp.status_code, await resp.aread(),
                                           resp.headers.get("content-type", "application/json"))
                return None
            splitter, held = EventSplitter(), []
            chunks = resp.aiter_raw()
            async for chunk in chunks:
                for event in splitter.feed(chunk):
                    held.append(event)
                    data = event_json(event)
                    if data is DONE or legs.chunk_decides(data):
                        if data is not DONE and legs.is_rejection(data):
                            return await _drain_rejection(chunks, splitter, data)
                        return await self._pipe_stream(ex, held, splitter.rest(), chunks,
                                                       resp.headers.get("content-type"))
            # Stream ended without a deciding chunk: pass on what there was.
            return await self._pipe_stream(ex, held, splitter.rest(), chunks,
                                           resp.headers.get("content-type"))

    async def _pipe_stream(self, ex: Exchange, held: list[bytes], rest: bytes, chunks,
                           content_type: Optional[str]) -> None:
        await send_start(ex.send, 200, ex.out_headers(content_type or "text/event-stream"))
        first = b"".join(held) + rest
        if first:
            await ex.send({"type": "http.response.body", "body": first, "more_body": True})
        try:
            async for chunk in chunks:
                await ex.send({"type": "http.response.body", "body": chunk, "more_body": True})
        except RETRYABLE as exc:
            # The engine went away mid-stream: tell the client inside the stream.
            await ex.send({"type": "http.response.body",
                           "body": sse_error_event(502, f"decode engine failed: {exc!r}"),
                           "more_body": True})
        await ex.send({"type": "http.response.body", "body": b"", "more_body": False})
        return None

    async def _remote_prefill_then_decode(self, ex: Exchange, pull: Optional[dict]) -> None:
        if pull:
            self.metrics.pull_offered_tokens.inc(int(pull.get("remote_num_tokens") or 0))
        result = await self._prefill(ex, legs.prefill_leg(ex.body, pull))
        if pull:
            # Whatever the prefill leg did, it no longer reads decode's prefix: end the
            # lease now instead of holding those blocks until it expires.
            self._release_decode_lease(pull)
        if result.client_error:
            ex.path_taken = "client_error"
            status, content = result.client_error
            return await self._relay_buffered(ex, status, content, "application/json")
        if result.kv is None:
            ex.path_taken = "fallback"
            ex.prefill_usage = None
        else:
            ex.path_taken = "pd"
            ex.prefill_usage = result.usage
            self._count_computed("prefill", result.usage)
        await self._final_decode(ex, legs.decode_leg(ex.body, result.kv))

    def _release_decode_lease(self, params: dict) -> None:
        async def release() -> None:
            try:
                await self.client.post(self.settings.decode_url + legs.RELEASE_PATH,
                                       json={"kv_transfer_params": params}, timeout=5.0)
            except httpx.HTTPError as exc:   # it expires on its own soon
                log.info("releasing decode's KV lease failed: %s", exc)
        task = asyncio.ensure_future(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _prefill(self, ex: Exchange, leg: dict) -> PrefillResult:
        """Tries prefill engines, least loaded first; an empty result means fallback."""
        # Ejected engines are skipped (also a trusted x-prefiller-host-port naming them);
        # when all are ejected, decode prefills itself (fallback).
        # Several named (llm-d's comma-separated list): the least loaded of them goes first.
        named = [t for t in ex.targets if not self.outliers.is_ejected(t)]
        preferred = self.picker.order(named)[0] if named else None
        await self.prefill_ranking.sync(self.endpoints.current)   # prefill pods come and go
        candidates, ranked_by = await self.prefill_ranking.order(
            self.outliers.available(self.endpoints.current), preferred, ex.body)
        self.metrics.prefill_ranking.labels(ranked_by).inc()
        for endpoint in candidates:
            self.metrics.legs.labels("prefill").inc()
            started = time.perf_counter()
            outcome, result = await self._prefill_once(ex, endpoint, leg)
            self.metrics.prefill_attempts.labels(outcome).inc()
            if outcome in ("timeout", "connect_error", "server_error"):
                self.outliers.failure(endpoint, outcome)
            elif outcome != "ejected":
                self.outliers.success(endpoint)
            if outcome == "ok":
                self.metrics.prefill_seconds.observe(time.perf_counter() - started)
                ex.reply_headers["x-pdpool-prefill-endpoint"] = endpoint
                return result
            if outcome == "client_error":
                return result
            log.warning("prefill on %s failed (%s) for %s", endpoint, outcome, ex.request_id)
        if not candidates:
            self.metrics.prefill_attempts.labels("no_endpoint").inc()
        return PrefillResult()

    async def _prefill_once(self, ex: Exchange, endpoint: str, leg: dict):
        url = f"{self.settings.upstream_scheme}://{endpoint}{ex.route}"
        with self.picker.track(endpoint):
            # Given up as soon as the engine is ejected (a probe found it wedged): the
            # request moves on to the next engine instead of waiting out its timeout.
            call = asyncio.ensure_future(self.client.post(url, json=leg, headers=ex.headers))
            ejected = asyncio.ensure_future(self.outliers.ejected_event(endpoint).wait())
            try:
                done, _ = await asyncio.wait({call, ejected},
                                             timeout=self.settings.prefill_timeout or None,
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                ejected.cancel()
                if not call.done():
                    call.cancel()  # closes the connection: the engine aborts the request
                    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                        await call
            if call not in done:
                return ("ejected" if ejected in done else "timeout"), None
            try:
                resp = call.result()
            except asyncio.CancelledError:
                return "timeout", None
            except httpx.HTTPError:
                return "connect_error", None
        if resp.status_code == 429 or resp.status_code >= 500:
            return "server_error", None
        if resp.status_code >= 400:
            return "client_error", PrefillResult(client_error=(resp.status_code, resp.content))
        data = _json_or_none(resp.content)
        kv = legs.kv_params_of(data)
        if not legs.prefill_answer_is_usable(kv):
            # An engine without a KV connector: its prefill is useless to decode.
            return "no_kv", None
        return "ok", PrefillResult(kv=kv, usage=_json_usage(data))

    async def _final_decode(self, ex: Exchange, leg: dict) -> None:
        """The last decode leg; usage is rewritten to cover both legs."""
        if ex.path_taken != "aggregated":
            self.metrics.legs.labels("decode").inc()
        if not ex.stream:
            resp = await self._decode_request(ex, leg)
            content = resp.content
            if resp.status_code == 200:
                data = _json_or_none(content)
                if isinstance(data, dict):
                    self._count_computed("decode", data.get("usage"))
                    if ex.prefill_usage is not None and "usage" in data:
                        data["usage"] = legs.merged_usage(data["usage"], ex.prefill_usage)
                        content = json.dumps(data).encode()
            return await self._relay_buffered(ex, resp.status_code, content,
                                              resp.headers.get("content-type",
                                                               "application/json"))
        async with self._decode_stream(ex, leg) as resp:
            if resp.status_code != 200:
                return await self._relay_buffered(ex, resp.status_code, await resp.aread(),
                                                  resp.headers.get("content-type",
                                                                   "application/json"))
            if ex.prefill_usage is None:
                return await self._pipe_stream(ex, [], b"", resp.aiter_raw(),
                                               resp.headers.get("content-type"))
            await self._pipe_rewriting_usage(ex, resp)

    async def _pipe_rewriting_usage(self, ex: Exchange, resp: httpx.Response) -> None:
        await send_start(ex.send, 200, ex.out_headers(
            resp.headers.get("content-type", "text/event-stream")))
        splitter = EventSplitter()
        try:
            async for chunk in resp.aiter_raw():
                out = []
                for event in splitter.feed(chunk):
                    if b'"prompt_tokens"' in event:
                        data = event_json(event)
                        usage = usage_of(data)
                        if usage is not None:
                            self._count_computed("decode", usage)
                            data["usage"] = legs.merged_usage(usage, ex.prefill_usage)
                            event = json_event(data)
                    out.append(event)
                if out:
                    await ex.send({"type": "http.response.body", "body": b"".join(out),
                                   "more_body": True})
        except RETRYABLE as exc:
            await ex.send({"type": "http.response.body",
                           "body": sse_error_event(502, f"decode engine failed: {exc!r}"),
                           "more_body": True})
        tail = splitter.rest()
        await ex.send({"type": "http.response.body", "body": tail, "more_body": False})

    # ------------------------------------------------------------------ decode upstream
    async def _decode_request(self, ex: Exchange, leg: dict) -> "Buffered":
        """A buffered decode leg, retried while the engine is unreachable (restarts) or
        breaks before answering in full (nothing reached the client yet)."""
        async def attempt(ex: Exchange, leg: dict) -> "Buffered":
            resp = await self._open_decode(ex, leg)
            try:
                return Buffered(resp.status_code, resp.headers, await resp.aread())
            finally:
                await resp.aclose()
        return await self._retrying(attempt, ex, leg)

    @contextlib.asynccontextmanager
    async def _decode_stream(self, ex: Exchange, leg: dict):
        """A streaming decode leg, opened with the same retries as `_decode_request`."""
        resp = await self._retrying(self._open_decode, ex, leg)
        try:
            yield resp
        finally:
            await resp.aclose()

    async def _open_decode(self, ex: Exchange, leg: dict) -> Response:
        return await self.decode_pool.send("POST", self.settings.decode_url + ex.route,
                                           json.dumps(leg).encode(), ex.headers)

    async def _relay_buffered(self, ex: Exchange, status: int, content: bytes,
                              content_type: str) -> None:
        if status >= 400 and _json_or_none(content) is None:
            # Keep OpenAI's error shape even when an upstream sent something else.
            ex.path_taken = "upstream_error" if status >= 500 else "client_error"
            return await send_error(ex.send, status,
                                    content.decode("utf-8", "replace")[:500] or "upstream error",
                                    headers={"x-request-id": ex.request_id})
        if status >= 400:
            ex.path_taken = "upstream_error" if status >= 500 else "client_error"
        await send_bytes(ex.send, status, content, ex.out_headers(content_type),
                         content_type=content_type)

    def _count_computed(self, leg: str, usage: Any) -> None:
        if isinstance(usage, dict):
            self.metrics.computed_tokens.labels(leg).inc(legs.computed_tokens(usage))


async def _drain_rejection(chunks, splitter: EventSplitter, first: dict) -> dict:
    """Reads the rest of a rejected stream for its kv params (final chunk)."""
    kv = legs.kv_params_of(first)
    async for chunk in chunks:
        for event in splitter.feed(chunk):
            data = event_json(event)
            if isinstance(data, dict) and legs.kv_params_of(data):
                kv = legs.kv_params_of(data)
    return kv or {}


def _json_or_none(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return None


def _json_usage(data: Any) -> Optional[dict]:
    return data.get("usage") if isinstance(data, dict) else None


def _bad_request_message(exc: Exception) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"request body is not valid JSON: {exc.msg} (line {exc.lineno})"
    return str(exc)


def build_app(settings: SidecarSettings, **kwargs) -> Sidecar:
    return Sidecar(settings, **kwargs)
