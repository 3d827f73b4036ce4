"""The transport between the engine server and its engine core: one duplex local socket
whose blocking semantics this module owns.

Each end has a writer thread and a reader thread, and the socket is never handed to an event
loop (an event loop's reader would make it non-blocking, and then a large message sent while
the peer is busy fails half-written instead of waiting). So:
- a send never blocks and never fails while the peer lives. When nothing is waiting to go
  out, the sender writes the message itself, without blocking (one syscall: waking the
  writer thread for every engine step cost the engine core more than the write). What the
  socket does not take at once, and every message behind it, goes to the writer thread,
  which waits for the peer to read. What waits is bounded: `wait_room` holds a sender back
  (backpressure) while more than `max_pending_bytes` wait.
- the reader hands whole messages over, several at a time when several are waiting.
- only the peer's end closing (its exit) or a broken socket ends the channel, once, with
  `on_closed(why)`.
Messages are the typed dataclasses of core_messages.py, pickled (both ends are this
program, spawned together).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import pickle
import socket
import struct
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

log = logging.getLogger("pdpool.engine")

DEFAULT_MAX_PENDING_BYTES = 64 << 20
# Messages handed over in one call at most: one event-loop wake-up for a burst of outputs.
READ_BATCH = 256


def encode(msg: Any) -> bytes:
    """A message as it crosses the socket (here and in the start-up hand-shake)."""
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Any:
    return pickle.loads(data)


def frame(data: bytes) -> bytes:
    """`data` behind the length prefix that `Connection.recv_bytes` reads: 4 bytes, signed,
    big-endian; past 2**31 - 1 bytes, -1 and then 8 bytes."""
    n = len(data)
    header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    return header + data


class ChannelClosed(RuntimeError):
    """The peer is gone (or the channel was closed here)."""


class CoreChannel:
    def __init__(
        self,
        conn: Connection,
        on_messages: Callable[[list[Any]], None],
        on_closed: Callable[[str], None],
        name: str,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
    ):
        self.conn, self.name = conn, name
        self._on_messages, self._on_closed = on_messages, on_closed
        self.max_pending_bytes = max_pending_bytes
        # Writes go through a socket object on a duplicate of the descriptor: it shares the
        # connection's (blocking) file, and MSG_DONTWAIT makes one write non-blocking.
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        lock = threading.RLock()
        self._backlog: collections.deque[memoryview] = collections.deque()  # the writer's
        self._writer_busy = False  # the writer holds a frame it has not finished writing
        self._stopping = False  # flush_and_close: the writer ends once the backlog is empty
        self._pending = 0  # bytes in the backlog and in the writer's hands
        self._room = threading.Condition(lock)
        self._work = threading.Condition(lock)
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._closed_why: Optional[str] = None
        self._closing = False
        os.set_blocking(conn.fileno(), True)
        self._writer = threading.Thread(target=self._write_loop, name=f"{name}-send", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name=f"{name}-recv", daemon=True)

    def start(self) -> "CoreChannel":
        self._writer.start()
        self._reader.start()
        return self

    # --- sending ------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed_why is not None

    def send(self, msg: Any) -> None:
        """Sends `msg` to the peer, or queues what the socket does not take at once (never
        blocks; see `wait_room`). Raises ChannelClosed when the peer is gone, and whatever
        pickling raises for a message that cannot be encoded (before anything is sent)."""
        if self._closed_why is not None:
            raise ChannelClosed(self._closed_why)
        data = memoryview(frame(encode(msg)))
        with self._room:
            if not self._backlog and not self._writer_busy and not self._stopping:
                data = data[self._write_now(data) :]
                if not data:
                    return
            self._backlog.append(data)
            self._pending += len(data)
            self._work.notify()

    def _write_now(self, data: memoryview) -> int:
        """Bytes of `data` the socket took without waiting. A failed write takes none: the
        writer thread meets the same failure and closes the channel from its own thread."""
        try:
            return self._sock.send(data, socket.MSG_DONTWAIT)
        except OSError:  # BlockingIOError (a full socket buffer) among them
            return 0

    def has_room(self) -> bool:
        return self._pending < self.max_pending_bytes or self._closed_why is not None

    def wait_room(self, timeout: Optional[float] = None) -> bool:
        """Blocks while too much waits to be sent; False on timeout."""
        with self._room:
            return self._room.wait_for(self.has_room, timeout)

    async def wait_room_async(self) -> None:
        """As `wait_room`, for a coroutine on an event loop."""
        while not self.has_room():
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            with self._room:
                if self.has_room():
                    return
                self._async_waiters.append((asyncio.get_running_loop(), fut))
            await fut

    def _write_loop(self) -> None:
        while True:
            with self._room:
                self._writer_busy = False
                while not self._backlog:
                    if self._stopping or self._closed_why is not None:
                        return
                    self._work.wait()
                data = self._backlog.popleft()
                self._writer_busy = True
            try:
                self._sock.sendall(data)
            except (OSError, ValueError) as exc:
                self._close(f"sending failed: {exc}")
                return
            with self._room:
                self._pending -= len(data)
                if self.has_room():
                    self._room.notify_all()
                    self._wake_async_waiters()

    def _wake_async_waiters(self) -> None:
        waiters, self._async_waiters = self._async_waiters, []
        for loop, fut in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_resolve, fut)

    # --- receiving ----------------------------------------------------------------------
    def _read_loop(self) -> None:
        try:
            while True:
                batch = [decode(self.conn.recv_bytes())]
                while len(batch) < READ_BATCH and self.conn.poll(0):
                    batch.append(decode(self.conn.recv_bytes()))
                self._on_messages(batch)
        except EOFError:
            self._close("the peer closed the channel")
        except (OSError, ValueError) as exc:
            self._close(f"receiving failed: {exc}")

    # --- ending -------------------------------------------------------------------------
    def _close(self, why: str) -> None:
        with self._room:
            if self._closed_why is not None:
                return
            self._closed_why = why
            self._room.notify_all()
            self._work.notify_all()
            self._wake_async_waiters()
        if not self._closing:
            self._on_closed(why)

    def flush_and_close(self, timeout: float = 10.0) -> None:
        """Sends what is queued (within `timeout`), then closes this end; `on_closed` is not
        called for a close asked for here."""
        self._closing = True
        with self._room:
            self._stopping = True
            self._work.notify_all()
        if self._writer.is_alive() and threading.current_thread() is not self._writer:
            self._writer.join(timeout)
        # Wake the reader out of its blocking read before the descriptor goes away.
        try:
            with socket.socket(fileno=os.dup(self.conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self._reader.is_alive() and threading.current_thread() is not self._reader:
            self._reader.join(2.0)
        self._close("closed")
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(OSError):
            self.conn.close()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
