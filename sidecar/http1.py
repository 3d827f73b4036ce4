"""A lean HTTP/1.1 client for the hot path: the legs that stream tokens through.

Every streamed token is one SSE event, so what a proxy spends per upstream chunk decides
its overhead. httpx passes each chunk through several layers of async generators and
checks every pooled socket on each request; this client reads a chunk with two awaits on
an asyncio stream and keeps idle keep-alive connections in a plain list per host.

Scope on purpose: http:// or https:// (TLS verified against the pool's SSL context, or
the system's), requests with a byte body, responses framed by
Content-Length or chunked encoding (what uvicorn and vLLM send), no redirects. Anything
else raises UpstreamProtocolError, which callers treat like a broken connection.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any, AsyncIterator, Optional
from urllib.parse import urlsplit


class UpstreamError(Exception):
    """Base: the upstream could not be reached or broke the exchange."""


class UpstreamConnectError(UpstreamError):
    pass


class UpstreamProtocolError(UpstreamError):
    pass


MAX_HEAD = 64 * 1024
# A pool key: (host, port, tls).
_Key = tuple[str, int, bool]


class _Conn:
    __slots__ = ("reader", "writer", "reused")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.reused = reader, writer, False

    def close(self) -> None:
        self.writer.close()


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

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        if self._done:
            return
        if self._conn is None:
            raise RuntimeError("the response was closed before its body was read")
        reader = self._conn.reader
        try:
            if "chunked" in self.headers.get("transfer-encoding", "").lower():
                while True:
                    line = await reader.readuntil(b"\r\n")
                    size = int(line.split(b";", 1)[0], 16)
                    if size == 0:
                        while (await reader.readuntil(b"\r\n")) != b"\r\n":
                            pass  # trailers
                        break
                    data = await reader.readexactly(size + 2)
                    yield data[:-2]
            elif "content-length" in self.headers:
                left = int(self.headers["content-length"])
                while left > 0:
                    data = await reader.read(min(left, 65536))
                    if not data:
                        raise UpstreamProtocolError("connection closed mid-body")
                    left -= len(data)
                    yield data
            else:  # body until the server closes the connection
                self._keep_alive = False
                while data := await reader.read(65536):
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

    async def _connect(self, key: _Key) -> _Conn:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.writer.is_closing() and not conn.reader.at_eof():
                conn.reused = True
                return conn
            conn.close()
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(key[0], key[1], limit=MAX_HEAD, **self._tls(key)),
                self.connect_timeout or None,
            )
        except (OSError, asyncio.TimeoutError) as exc:
            raise UpstreamConnectError(f"cannot connect to {key[0]}:{key[1]}: {exc!r}") from None
        return _Conn(reader, writer)

    def _tls(self, key: _Key) -> dict[str, Any]:
        if not key[2]:
            return {}
        return {"ssl": self.ssl_context or ssl.create_default_context(), "server_hostname": key[0]}

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
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamProtocolError(f"unsupported url {url!r}")
        tls = parts.scheme == "https"
        key: _Key = (parts.hostname, parts.port or (443 if tls else 80), tls)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = [
            f"{method} {target} HTTP/1.1",
            f"host: {parts.netloc}",
            f"content-length: {len(body)}",
        ]
        for name, value in (headers or {}).items():
            if name.lower() not in ("host", "content-length", "transfer-encoding", "connection"):
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
