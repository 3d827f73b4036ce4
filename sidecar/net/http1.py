"""A lean HTTP/1.1 client for the hot path: the legs that stream tokens through.

Every streamed token is one SSE event, so what a proxy spends per upstream chunk decides
its overhead. httpx passes each chunk through several layers of async generators and
checks every pooled socket on each request; this client reads a chunk with two awaits on
an asyncio stream and keeps idle keep-alive connections in a plain list per host.

A body is read as it arrives, whatever has come in one read: one await per network read,
not two per chunk, and events that arrived together leave together. Host names are
resolved once and kept (resolver.py), so that a new connection never queues behind other
requests' DNS lookups.

Scope on purpose: http:// or https:// (TLS verified against the pool's SSL context, or
the system's), requests with a byte body, responses framed by
Content-Length or chunked encoding (what uvicorn and vLLM send), no redirects. Anything
else raises UpstreamProtocolError, which callers treat like a broken connection.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from typing import Any, AsyncIterator, Optional
from urllib.parse import urlsplit

from .resolver import Resolver


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


class _Conn:
    __slots__ = ("reader", "reused", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.reused = reader, writer, False

    def close(self) -> None:
        self.writer.close()


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


class Response:
    """Status and headers are read; the body is read through aiter_raw() or aread()."""

    def __init__(
        self, pool: "Http1Pool", key: _Key, conn: _Conn, status: int, headers: dict[str, str]
    ) -> None:
        self._pool, self._key = pool, key
        self._conn: Optional[_Conn] = conn  # None once closed or back in the pool
        self.status_code = status
        self.headers = headers
        self._done = False
        self._keep_alive = headers.get("connection", "").lower() != "close"

    @property
    def complete(self) -> bool:
        """The whole body was read: set before the last piece is handed out, so that a
        relay can end its own answer with that piece."""
        return self._done

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body, as it arrives: every piece holds all that one network read brought."""
        if self._done:
            return
        if self._conn is None:
            raise RuntimeError("the response was closed before its body was read")
        reader = self._conn.reader
        try:
            if "chunked" in self.headers.get("transfer-encoding", "").lower():
                body = ChunkedBody()
                while not body.done:
                    payload = body.feed(await self._read(reader))
                    if body.done:
                        self._done = True
                        self._keep_alive = self._keep_alive and not body.extra
                    if payload:
                        yield payload
            else:
                async for data in self._unchunked(reader):
                    yield data
        except (
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ValueError,
            ConnectionError,
        ) as exc:
            self._keep_alive = False
            raise UpstreamProtocolError(f"broken response body: {exc!r}") from None
        self._done = True

    async def _unchunked(self, reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
        """A body of a known length (complete as its last piece is handed out) or, without
        one, all that comes until the server closes the connection."""
        if "content-length" in self.headers:
            left = int(self.headers["content-length"])
            while left > 0:
                data = await self._read(reader, min(left, READ_SIZE))
                left -= len(data)
                self._done = left <= 0
                yield data
        else:
            self._keep_alive = False
            while data := await reader.read(READ_SIZE):
                yield data

    @staticmethod
    async def _read(reader: asyncio.StreamReader, size: int = READ_SIZE) -> bytes:
        data = await reader.read(size)
        if not data:
            raise UpstreamProtocolError("connection closed mid-body")
        return data

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
        self._idle: dict[_Key, list[_Conn]] = {}
        self.resolver = Resolver()

    async def _connect(self, key: _Key) -> _Conn:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.writer.is_closing() and not conn.reader.at_eof():
                conn.reused = True
                return conn
            conn.close()
        try:
            return await asyncio.wait_for(self._open(key), self.connect_timeout or None)
        except (OSError, asyncio.TimeoutError) as exc:
            self.resolver.forget(key[0])  # the name may point elsewhere by now
            raise UpstreamConnectError(f"cannot connect to {key[0]}:{key[1]}: {exc!r}") from None

    async def _open(self, key: _Key) -> _Conn:
        """A new connection to the host's first address that accepts one."""
        host, port, _ = key
        error: Optional[OSError] = None
        for address in await self.resolver.addresses(host, port):
            try:
                reader, writer = await asyncio.open_connection(
                    address, port, limit=MAX_HEAD, **self._tls(key)
                )
                return _Conn(reader, writer)
            except OSError as exc:
                error = exc
        raise error or OSError(f"{host} has no address")

    def _tls(self, key: _Key) -> dict[str, Any]:
        if not key[2]:
            return {}
        if self.ssl_context is None:  # made once: loading the trust store takes milliseconds
            self.ssl_context = ssl.create_default_context()
        return {"ssl": self.ssl_context, "server_hostname": key[0]}

    def _release(self, key: _Key, conn: _Conn) -> None:
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
                conn.writer.write(payload)
                status, resp_headers = await self._read_head(conn.reader)
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
    async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
        while True:
            raw = await reader.readuntil(b"\r\n\r\n")
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
