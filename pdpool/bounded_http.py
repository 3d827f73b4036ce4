"""uvicorn's httptools protocol with the request head bounded in size and in time, and a
request body's silences bounded in time.

uvicorn puts no limit on a request's line and headers: the parser holds a header until it
is complete, so one 100 MB header was read whole by each server in turn (the gateway passed
it on to the sidecar and the engine) and took 9-27 s of a core in each. Here every byte
that arrives while a head is being read counts, partial headers included, and a head past
MAX_HEAD_BYTES is answered 431 and its connection closed. The bound is Go's net/http
default (DefaultMaxHeaderBytes); a read is at most 256 KiB, so a head up to 768 KiB is never
refused because the start of its body came in the same read.

Nor does uvicorn time a head out: a connection that sends nothing, or half a head, is held
for ever (its keep-alive timer runs only between requests). A head not complete within
HEAD_TIMEOUT_S of the connection's start, or of its first bytes on a kept-alive
connection, is answered 408 and its connection closed. A head that completes in the read
that started it (every ordinary request) arms no timer.

Nor a body: a client that announces a body and then sends nothing more held its
connection, and the share of the large-body budget charged for its Content-Length
(body_budget.py), for ever. A body that sends nothing for BODY_IDLE_TIMEOUT_S (nginx's
client_body_timeout) is answered 408, or its connection closed if an answer has started.
Time while the server itself has stopped reading (the application has not taken what
came) does not count. A body that completes in the read that started it arms no timer.

A response's head is held until its first body bytes (or the end of the loop's turn), so
that the two leave in one write: a relayed stream's first token, or a whole answer, costs
the client one wake-up and the server one system call fewer.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 1 << 20
HEAD_TIMEOUT_S = 30.0
BODY_IDLE_TIMEOUT_S = 60.0


def _answer(status: int, reason: str, message: str) -> bytes:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": status}
    body = json.dumps({"error": error}).encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


_TOO_LARGE = _answer(
    431,
    "Request Header Fields Too Large",
    f"the request line and headers exceed {MAX_HEAD_BYTES} bytes",
)
_TOO_SLOW = _answer(
    408, "Request Timeout", f"the request line and headers took more than {HEAD_TIMEOUT_S:g} s"
)
_BODY_STALLED = _answer(
    408, "Request Timeout", f"the request body sent nothing for {BODY_IDLE_TIMEOUT_S:g} s"
)


def _cancelled(timer: Optional[asyncio.TimerHandle]) -> None:
    """Cancels `timer` if there is one; None, to put in its place."""
    if timer is not None:
        timer.cancel()


class _HeadHeld:
    """A response's transport whose first write (the head, or a 100 Continue) waits for
    the next write or the end of the current turn of the loop, whichever is first."""

    __slots__ = ("_first", "_held", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: Optional[bytes] = None
        self._first = True

    def write(self, data: bytes) -> None:
        if self._first:
            self._first, self._held = False, data
            asyncio.get_running_loop().call_soon(self._flush)
        elif self._held is not None:
            held, self._held = self._held, None
            self._transport.write(held + data)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()


class BoundedRequestHttp(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0  # of the head being read
        self._in_body = False  # its headers are complete, its message is not
        self._head_deadline: Optional[asyncio.TimerHandle] = None
        self._body_heard = 0.0  # loop time of the body's latest bytes
        self._body_deadline: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm_head_deadline()
        self._disarm_body_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._in_body:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                return self._refuse(_TOO_LARGE, "a request head over %d bytes", MAX_HEAD_BYTES)
        super().data_received(data)
        if self._in_body:  # a body still incomplete after this read
            self._body_heard = self.loop.time()
            if self._body_deadline is None:
                self._arm_body_deadline(BODY_IDLE_TIMEOUT_S)
        elif self._head_bytes and self._head_deadline is None:
            self._arm_head_deadline()  # a head still incomplete after the read it began in

    def on_headers_complete(self) -> None:
        self._in_body, self._head_bytes = True, 0
        self._disarm_head_deadline()
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not None and self.cycle is not before:
            # The cycle just made (its task has not run yet) writes through the holder.
            self.cycle.transport = _HeadHeld(self.transport)  # type: ignore[assignment]

    def on_message_complete(self) -> None:
        self._in_body = False
        self._disarm_body_deadline()
        super().on_message_complete()

    def _arm_head_deadline(self) -> None:
        self._head_deadline = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _disarm_head_deadline(self) -> None:
        self._head_deadline = _cancelled(self._head_deadline)

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_head_deadline()  # a pipelined head waits for the answer before it
            return
        self._refuse(_TOO_SLOW, "a request head slower than %g s", HEAD_TIMEOUT_S)

    def _arm_body_deadline(self, after: float) -> None:
        self._body_deadline = self.loop.call_later(after, self._body_maybe_stalled)

    def _disarm_body_deadline(self) -> None:
        self._body_deadline = _cancelled(self._body_deadline)

    def _body_maybe_stalled(self) -> None:
        self._body_deadline = None
        if self.flow is not None and self.flow.read_paused:
            self._body_heard = self.loop.time()  # the server stopped reading, not the client
        silent = self.loop.time() - self._body_heard
        if silent < BODY_IDLE_TIMEOUT_S:
            return self._arm_body_deadline(BODY_IDLE_TIMEOUT_S - silent)
        if self.cycle is not None and self.cycle.response_started:
            self.logger.warning("closed a connection whose request body stalled")
            return self.transport.close()
        self._refuse(_BODY_STALLED, "a request body silent for %g s", BODY_IDLE_TIMEOUT_S)

    def _refuse(self, answer: bytes, why: str, bound: float) -> None:
        self.logger.warning("refused " + why, bound)
        self._disarm_head_deadline()
        self._disarm_body_deadline()
        if not self.transport.is_closing():
            self.transport.write(answer)
            self.transport.close()
