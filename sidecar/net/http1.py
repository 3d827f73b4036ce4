"""A lean HTTP/1.1 client for the hot path: the legs that stream tokens through.

Every streamed token is one SSE event, so what a proxy spends per upstream chunk decides
its overhead. httpx passes each chunk through several layers of async generators and
checks every pooled socket on each request; this client's connections are plain asyncio
protocols (wire.py), kept idle in a list per host.

A body is read as it arrives, whatever has come in one read: one await per network read,
and events that arrived together leave together. `Response.relay` goes further: each piece
is decoded and handed on from the connection's own data callback, with no await at all.
Host names are resolved once and kept (resolver.py), so that a new connection never queues
behind other requests' DNS lookups.

Scope on purpose: http:// or https:// (TLS verified against the pool's SSL context, or
the system's), requests with a byte body, responses framed by
Content-Length or chunked encoding (what uvicorn and vLLM send), no redirects. Anything
else raises UpstreamProtocolError, which callers treat like a broken connection.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from typing import Any, AsyncGenerator, Awaitable, Callable, Optional, Union
from urllib.parse import urlsplit

from .resolver import Resolver
from .wire import Wire


class UpstreamError(Exception):
    """Base: the upstream could not be reached or broke the exchange."""


class UpstreamConnectError(UpstreamError):
    pass


class UpstreamProtocolError(UpstreamError):
    pass


MAX_HEAD = 64 * 1024
READ_SIZE = 65536
# A pool key: (host, port, tls).
_Key = tuple[str, int, bool]


class ChunkedBody:
    """Decodes a chunked transfer-coded body fed in pieces of any size: `feed` returns the
    payload bytes they complete (never waiting for a whole chunk), `done` is set at the
    last chunk, `extra` holds bytes that came after the body."""

    def __init__(self) -> None:
        self._pending = b""  # an incomplete size or trailer line
        self._left = 0  # payload bytes of the current chunk still to come
        self._crlf = 0  # bytes of the CRLF after a payload still to come
        self._trailers = False
        self.done = False
        self.extra = b""

    def feed(self, data: bytes) -> bytes:
        if self._pending:
            data, self._pending = self._pending + data, b""
        out: list[bytes] = []
        pos, end = 0, len(data)
        while pos < end and not self.done:
            if self._left:
                take = min(self._left, end - pos)
                out.append(data[pos : pos + take])
                pos += take
                self._left -= take
                self._crlf = 0 if self._left else 2
            elif self._crlf:
                pos = self._skip_crlf(data, pos)
            else:
                line_end = data.find(b"\r\n", pos)
                if line_end < 0:
                    self._keep_partial_line(data[pos:])
                    break
                self._line(data[pos:line_end])
                pos = line_end + 2
        if self.done:
            self.extra += data[pos:]
        return out[0] if len(out) == 1 else b"".join(out)

    def _skip_crlf(self, data: bytes, pos: int) -> int:
        expected = b"\r\n"[2 - self._crlf :]
        got = data[pos : pos + self._crlf]
        if not expected.startswith(got):
            raise UpstreamProtocolError("chunk not followed by CRLF")
        self._crlf -= len(got)
        return pos + len(got)

    def _keep_partial_line(self, rest: bytes) -> None:
        if len(rest) > MAX_HEAD:
            raise UpstreamProtocolError("chunk size line too long")
        self._pending = rest

    def _line(self, line: bytes) -> None:
        if self._trailers:
            self.done = not line  # trailers end at an empty line
            return
        try:
            size = int(line.split(b";", 1)[0], 16)
        except ValueError:
            raise UpstreamProtocolError(f"bad chunk size line {line[:40]!r}") from None
        if size < 0:
            raise UpstreamProtocolError(f"bad chunk size line {line[:40]!r}")
        self._left = size
        self._trailers = size == 0


class LengthBody:
    """A body of a known length, with ChunkedBody's interface."""

    def __init__(self, length: int) -> None:
        self._left = length
        self.done = length <= 0
        self.extra = b""

    def feed(self, data: bytes) -> bytes:
        if self.done:
            self.extra += data
            return b""
        if len(data) <= self._left:
            self._left -= len(data)
            self.done = self._left == 0
            return data
        payload, self.extra = data[: self._left], data[self._left :]
        self._left, self.done = 0, True
        return payload


class UntilClose:
    """A body without a length: all that comes until the server closes the connection."""

    done = False
    extra = b""

    def feed(self, data: bytes) -> bytes:
        return data


Framing = Union[ChunkedBody, LengthBody, UntilClose]


def framing_of(headers: dict[str, str]) -> Framing:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return ChunkedBody()
    if "content-length" in headers:
        value = headers["content-length"]
        if not value.isdigit():
            raise UpstreamProtocolError(f"bad content-length {value[:40]!r}")
        return LengthBody(int(value))
    return UntilClose()


# What a relayed body's pieces go to: `write(piece, last)` returns None once written, or an
# awaitable while its receiver cannot take more (reading pauses until it completes).
PieceWriter = Callable[[bytes, bool], Optional[Awaitable[None]]]


class Response:
    """Status and headers are read; the body is read through aiter_raw() or aread(), or
    relayed as it arrives with relay()."""

    def __init__(
        self, pool: "Http1Pool", key: _Key, conn: Wire, status: int, headers: dict[str, str]
    ) -> None:
        self._pool, self._key = pool, key
        self._conn: Optional[Wire] = conn  # None once closed or back in the pool
        self.status_code = status
        self.headers = headers
        self._framing = framing_of(headers)
        self._done = self._framing.done
        self._keep_alive = headers.get("connection", "").lower() != "close"

    @property
    def complete(self) -> bool:
        """The whole body was read: set before the last piece is handed out, so that a
        relay can end its own answer with that piece."""
        return self._done

    def _open_conn(self) -> Wire:
        if self._conn is None:
            raise RuntimeError("the response was closed before its body was read")
        return self._conn

    def _feed(self, data: bytes) -> bytes:
        """The payload `data` carries; marks the body complete with its last piece."""
        framing = self._framing
        payload = framing.feed(data)
        if framing.done:
            self._done = True
            self._keep_alive = self._keep_alive and not framing.extra
        return payload

    def _ended_by_close(self) -> None:
        """The server closed the connection: the end of a body without a length, else a
        broken one."""
        self._keep_alive = False
        if not isinstance(self._framing, UntilClose):
            raise UpstreamProtocolError("connection closed mid-body")
        self._done = True

    async def aiter_raw(self) -> AsyncGenerator[bytes, None]:
        """The body, as it arrives: every piece holds all that one network read brought."""
        if self._done:
            return
        conn = self._open_conn()
        try:
            while not self._done:
                data = await conn.read(READ_SIZE)
                if not data:
                    self._ended_by_close()
                    return
                payload = self._feed(data)
                if payload:
                    yield payload
        except (ValueError, OSError) as exc:
            self._keep_alive = False
            raise UpstreamProtocolError(f"broken response body: {exc!r}") from None

    async def relay(self, write: PieceWriter) -> None:
        """Hands the rest of the body to `write(piece, last)` from the connection's own
        callback as it arrives, `last` set with the piece that completes it (b"" when the
        server's close ends it). Returns once the last piece was written. Raises
        UpstreamProtocolError when the server breaks the body, and what `write` raised."""
        if self._done:
            return
        conn = self._open_conn()
        relay = _BodyRelay(self, conn, write)
        conn.relay_to(relay)
        try:
            await relay.finished
        finally:
            conn.stop_relay()
            relay.stop()

    async def aread(self) -> bytes:
        parts = [chunk async for chunk in self.aiter_raw()]
        return b"".join(parts)

    async def aclose(self) -> None:
        """Returns the connection to the pool when the body was read to its end;
        otherwise closes it (which is how an unfinished stream is cancelled upstream)."""
        if self._conn is None:
            return
        conn, self._conn = self._conn, None
        if self._done and self._keep_alive:
            self._pool._release(self._key, conn)
        else:
            conn.close()


class _BodyRelay:
    """The receiver of a relayed body (wire.Receiver): decodes each piece in the
    connection's data callback and writes it on; while a write waits, reading pauses."""

    def __init__(self, response: Response, conn: Wire, write: PieceWriter) -> None:
        self._response, self._conn, self._write = response, conn, write
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting: Optional[asyncio.Task[None]] = None
        # the connection closed while a write waited: seen once the write is done
        self._closed_while_waiting = False
        self._close_error: Optional[BaseException] = None

    def data(self, data: bytes) -> None:
        if self.finished.done():  # bytes past the body (or a broken one): no reuse
            self._response._keep_alive = False
            return
        try:
            payload = self._response._feed(data)
            last = self._response._done
            if payload or last:
                self._after_write(self._write(payload, last), last)
        except Exception as exc:  # broken framing, or the writer's own error
            self._fail(exc)

    def closed(self, exc: Optional[BaseException]) -> None:
        if self.finished.done():
            return
        if self._waiting is not None:  # seen once the pending write is done
            self._closed_while_waiting, self._close_error = True, exc
            return
        try:
            self._response._ended_by_close()
        except UpstreamProtocolError as error:
            reason = f" ({exc!r})" if exc is not None else ""
            self._fail(UpstreamProtocolError(f"{error}{reason}"))
            return
        try:
            self._after_write(self._write(b"", True), True)
        except Exception as error:
            self._fail(error)

    def stop(self) -> None:
        if self._waiting is not None:
            self._waiting.cancel()
            self._waiting = None

    def _after_write(self, waiting: Optional[Awaitable[None]], last: bool) -> None:
        if waiting is None:
            if last and not self.finished.done():
                self.finished.set_result(None)
            return
        self._conn.pause_reading()
        self._waiting = asyncio.ensure_future(self._finish_write(waiting, last))

    async def _finish_write(self, waiting: Awaitable[None], last: bool) -> None:
        try:
            await waiting
        except Exception as exc:
            self._waiting = None
            self._fail(exc)
            return
        self._waiting = None
        if last:
            if not self.finished.done():
                self.finished.set_result(None)
            return
        if self._closed_while_waiting:
            self._closed_while_waiting = False
            self.closed(self._close_error)
        else:
            self._conn.resume_reading()

    def _fail(self, exc: BaseException) -> None:
        self._response._keep_alive = False
        if not self.finished.done():
            self.finished.set_exception(exc)


@functools.lru_cache(maxsize=1024)
def _parse_url(url: str) -> tuple[_Key, str, str]:
    """(pool key, request target, Host header) of a URL: parsed once per URL, not per
    request."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UpstreamProtocolError(f"unsupported url {url!r}")
    tls = parts.scheme == "https"
    key: _Key = (parts.hostname, parts.port or (443 if tls else 80), tls)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return key, target, parts.netloc


# Request headers the pool writes itself.
_OWN_HEADERS = frozenset(("host", "content-length", "transfer-encoding", "connection"))


class Http1Pool:
    def __init__(
        self,
        connect_timeout: float = 2.0,
        max_idle_per_host: int = 256,
        ssl_context: Optional[ssl.SSLContext] = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.ssl_context = ssl_context  # for https:// (None: the system's trust store)
        self.max_idle_per_host = max_idle_per_host
        self._idle: dict[_Key, list[Wire]] = {}
        self.resolver = Resolver()

    async def _connect(self, key: _Key) -> Wire:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.usable():
                conn.reused = True
                return conn
            conn.close()
        try:
            return await asyncio.wait_for(self._open(key), self.connect_timeout or None)
        except (OSError, asyncio.TimeoutError) as exc:
            self.resolver.forget(key[0])  # the name may point elsewhere by now
            raise UpstreamConnectError(f"cannot connect to {key[0]}:{key[1]}: {exc!r}") from None

    async def _open(self, key: _Key) -> Wire:
        """A new connection to the host's first address that accepts one."""
        host, port, _ = key
        error: Optional[OSError] = None
        loop = asyncio.get_running_loop()
        for address in await self.resolver.addresses(host, port):
            try:
                _, conn = await loop.create_connection(Wire, address, port, **self._tls(key))
                return conn
            except OSError as exc:
                error = exc
        raise error or OSError(f"{host} has no address")

    def _tls(self, key: _Key) -> dict[str, Any]:
        if not key[2]:
            return {}
        if self.ssl_context is None:  # made once: loading the trust store takes milliseconds
            self.ssl_context = ssl.create_default_context()
        return {"ssl": self.ssl_context, "server_hostname": key[0]}

    def _release(self, key: _Key, conn: Wire) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) < self.max_idle_per_host:
            idle.append(conn)
        else:
            conn.close()

    async def send(
        self, method: str, url: str, body: bytes, headers: Optional[dict[str, str]] = None
    ) -> Response:
        """Sends a request and reads the response head. A reused keep-alive connection
        that the server closed meanwhile is replaced once, transparently."""
        key, target, host = _parse_url(url)
        head = [f"{method} {target} HTTP/1.1\r\nhost: {host}\r\ncontent-length: {len(body)}"]
        for name, value in (headers or {}).items():
            if name.lower() not in _OWN_HEADERS:
                head.append(f"{name}: {value}")
        payload = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        for attempt in (0, 1):
            conn = await self._connect(key)
            try:
                conn.write(payload)
                status, resp_headers = await self._read_head(conn)
                return Response(self, key, conn, status, resp_headers)
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                conn.close()
                if conn.reused and attempt == 0:
                    continue  # stale keep-alive connection: one fresh try
                raise UpstreamProtocolError(
                    f"no response from {key[0]}:{key[1]}: {exc!r}"
                ) from None
            except (asyncio.LimitOverrunError, ValueError, UpstreamProtocolError) as exc:
                conn.close()
                raise UpstreamProtocolError(f"bad response head: {exc!r}") from None
            except BaseException:
                conn.close()  # cancelled while waiting for the head
                raise
        raise AssertionError("unreachable")

    @staticmethod
    async def _read_head(conn: Wire) -> tuple[int, dict[str, str]]:
        while True:
            raw = await conn.read_until(b"\r\n\r\n", MAX_HEAD)
            lines = raw.decode("latin-1").split("\r\n")
            status_line = lines[0].split(" ", 2)
            if len(status_line) < 2 or not status_line[0].startswith("HTTP/1."):
                raise UpstreamProtocolError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
            status = int(status_line[1])
            if 100 <= status < 200:
                continue  # interim responses (100 Continue)
            headers: dict[str, str] = {}
            for line in lines[1:]:
                if line:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
            return status, headers

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
