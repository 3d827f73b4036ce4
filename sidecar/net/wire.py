"""One upstream connection of the lean HTTP/1.1 client (http1.py), as an asyncio protocol.

What arrives waits in a buffer for `read` and `read_until`, or, while a body is relayed,
goes to the relay's receiver from the connection's own callback: a streamed token then
reaches the client without a task switch and a turn of the event loop of its own.
"""

from __future__ import annotations

import asyncio
from typing import Optional, Protocol, cast

# Buffered bytes past this pause reading until a reader takes them.
BUFFER_LIMIT = 256 * 1024


class Receiver(Protocol):
    """Takes a relayed connection's bytes as they arrive."""

    def data(self, data: bytes) -> None: ...

    def closed(self, exc: Optional[BaseException]) -> None: ...


class Wire(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: Optional[asyncio.Transport] = None
        self.reused = False  # set by the pool when it hands out an idle connection
        self._buffer = bytearray()
        self._ended = False  # the peer closed its side, or the connection was lost
        self._error: Optional[BaseException] = None
        self._waiter: Optional[asyncio.Future[None]] = None
        self._receiver: Optional[Receiver] = None
        self._paused = False

    # ------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports have asyncio.Transport's methods without subclassing it
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._receiver is not None:
            self._receiver.data(data)
            return
        self._buffer += data
        if len(self._buffer) > BUFFER_LIMIT:
            self.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._end(None)
        return False  # the transport closes itself

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self._end(exc)

    def _end(self, exc: Optional[BaseException]) -> None:
        if self._ended:
            return
        self._ended, self._error = True, exc
        self._wake()
        if self._receiver is not None:
            self._receiver.closed(exc)

    # ------------------------------------------------------------ the client's side
    def write(self, data: bytes) -> None:
        """Raises ConnectionResetError when the connection has ended: it may end between
        its opening and the first write (the peer reset it as it accepted), and uvloop
        raises RuntimeError for a write to a closed transport where asyncio drops it."""
        transport = self.transport
        if transport is None or self._ended or transport.is_closing():
            raise ConnectionResetError(f"connection closed before the request: {self._error!r}")
        try:
            transport.write(data)
        except RuntimeError as exc:
            raise ConnectionResetError(f"connection closed before the request: {exc}") from None

    def usable(self) -> bool:
        """An idle keep-alive connection that can carry another request: open, and nothing
        unasked-for came in on it."""
        transport = self.transport
        return (
            not self._ended
            and not self._buffer
            and transport is not None
            and not transport.is_closing()
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def pause_reading(self) -> None:
        if not self._paused and self.transport is not None and not self.transport.is_closing():
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused:
            self._paused = False
            if self.transport is not None and not self.transport.is_closing():
                self.transport.resume_reading()

    async def read(self, size: int) -> bytes:
        """Up to `size` bytes, as soon as there are some; b"" once the peer has closed."""
        while not self._buffer:
            if self._ended:
                self._raise_error()
                return b""
            await self._wait()
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        self._taken()
        return data

    async def read_until(self, separator: bytes, limit: int) -> bytes:
        """The bytes up to and including `separator`. Raises asyncio.LimitOverrunError when
        more than `limit` bytes come first, asyncio.IncompleteReadError when the peer closes
        first."""
        searched = 0
        while True:
            at = self._buffer.find(separator, searched)
            if at >= 0:
                end = at + len(separator)
                if end > limit:
                    raise asyncio.LimitOverrunError("separator found past the limit", end)
                data = bytes(self._buffer[:end])
                del self._buffer[:end]
                self._taken()
                return data
            if len(self._buffer) > limit:
                raise asyncio.LimitOverrunError("separator not found within the limit", limit)
            if self._ended:
                self._raise_error()
                raise asyncio.IncompleteReadError(bytes(self._buffer), None)
            searched = max(0, len(self._buffer) - len(separator) + 1)
            await self._wait()

    def relay_to(self, receiver: Receiver) -> None:
        """From now on what arrives goes to `receiver` (what is buffered first)."""
        buffered = bytes(self._buffer)
        self._buffer.clear()
        self._receiver = receiver
        self.resume_reading()
        if buffered:
            receiver.data(buffered)
        if self._ended and self._receiver is receiver:
            receiver.closed(self._error)

    def stop_relay(self) -> None:
        """Back to buffering (reading resumes if the receiver had paused it)."""
        self._receiver = None
        self.resume_reading()

    # ------------------------------------------------------------ internals
    async def _wait(self) -> None:
        self.resume_reading()  # a reader waits: the buffer has room
        waiter = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _taken(self) -> None:
        if len(self._buffer) <= BUFFER_LIMIT // 2:
            self.resume_reading()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise ConnectionResetError(f"upstream connection lost: {self._error!r}")
