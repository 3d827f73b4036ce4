"""BoundedRequestHttp under a real uvicorn server: a head that is too slow, or a body that
goes silent, gets 408 and its connection is closed; heads and bodies that complete are
served as before (keep-alive, pipelining, a head or a body trickled in under the deadline,
a body the application takes late). The size bound is tried end to end in
tests/sidecar/test_hostile_bodies.py."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn

from pdpool import bounded_http
from pdpool.bounded_http import BoundedRequestHttp, _HeadHeld

DEADLINE_S = 0.6


async def app(scope, receive, send):
    """Answers its body's length; a path of /slow answers after a second, /late reads the
    body after two deadlines, /early answers without reading it."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/early":
        return await _answer_json(send, {"size": None})
    if scope["path"] == "/head-then-wait":  # a stream whose first bytes come much later
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.sleep(2 * DEADLINE_S)
        await send({"type": "http.response.body", "body": b"late", "more_body": False})
        return
    if scope["path"] == "/late":
        await asyncio.sleep(2 * DEADLINE_S)
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    if scope["path"] == "/slow":
        await asyncio.sleep(1.0)
    await _answer_json(send, {"size": size})


async def _answer_json(send, answer: dict) -> None:
    body = json.dumps(answer).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def port():
    saved = bounded_http.HEAD_TIMEOUT_S, bounded_http.BODY_IDLE_TIMEOUT_S
    bounded_http.HEAD_TIMEOUT_S = bounded_http.BODY_IDLE_TIMEOUT_S = DEADLINE_S
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=BoundedRequestHttp, log_level="error", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        bounded_http.HEAD_TIMEOUT_S, bounded_http.BODY_IDLE_TIMEOUT_S = saved


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _request(path: str = "/", body: bytes = b"abc") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


def _read_answer(sock: socket.socket) -> tuple[int, bytes]:
    """(status, body) of the next answer; status 0 when the connection closed first."""
    reader = sock.makefile("rb")
    status_line = reader.readline()
    if not status_line:
        return 0, b""
    length = 0
    while (line := reader.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return int(status_line.split()[1]), reader.read(length)


def _closed(sock: socket.socket) -> bool:
    return sock.recv(1) == b""


def test_a_connection_that_sends_nothing_gets_408_and_is_closed(port):
    with _connect(port) as sock:
        started = time.monotonic()
        status, body = _read_answer(sock)
        assert status == 408 and json.loads(body)["error"]["code"] == 408
        assert DEADLINE_S * 0.8 < time.monotonic() - started < DEADLINE_S + 5
        assert _closed(sock)


def test_half_a_head_gets_408_on_a_new_and_on_a_kept_alive_connection(port):
    with _connect(port) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\nx-slow: ")
        assert _read_answer(sock)[0] == 408
        assert _closed(sock)
    with _connect(port) as sock:
        sock.sendall(_request())
        assert _read_answer(sock) == (200, b'{"size": 3}')
        time.sleep(DEADLINE_S * 1.5)  # idle between requests: more than a head may take
        sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\n")
        assert _read_answer(sock)[0] == 408


def test_heads_that_complete_are_served_even_when_trickled_in(port):
    with _connect(port) as sock:
        for _ in range(3):  # keep-alive: each head timed on its own
            for piece in (b"POST / HTTP/1.1\r\n", b"host: x\r\n", b"content-length: 2\r\n\r\nab"):
                sock.sendall(piece)
                time.sleep(DEADLINE_S / 5)
            assert _read_answer(sock) == (200, b'{"size": 2}')


def test_a_pipelined_head_waits_for_a_slow_answer_without_a_timeout(port):
    with _connect(port) as sock:
        # the second request's head is incomplete while the first takes longer than a deadline
        sock.sendall(_request("/slow") + b"POST / HTTP/1.1\r\nhost: x\r\n")
        time.sleep(0.1)
        sock.sendall(b"content-length: 1\r\n")
        assert _read_answer(sock) == (200, b'{"size": 3}')
        sock.sendall(b"\r\nz")
        assert _read_answer(sock) == (200, b'{"size": 1}')


def test_a_body_that_goes_silent_gets_408_and_is_closed(port):
    with _connect(port) as sock:
        sock.sendall(_request(body=b"0123456789")[:-7])  # 3 of its 10 bytes
        started = time.monotonic()
        status, body = _read_answer(sock)
        assert status == 408 and "request body sent nothing" in json.loads(body)["error"]["message"]
        assert DEADLINE_S * 0.8 < time.monotonic() - started < DEADLINE_S + 5
        assert _closed(sock)


def test_a_body_trickled_in_under_the_deadline_is_served(port):
    with _connect(port) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 8\r\n\r\n")
        for piece in (b"ab", b"cd", b"ef", b"gh"):  # two deadlines in all, a fifth between
            time.sleep(DEADLINE_S / 2)
            sock.sendall(piece)
        assert _read_answer(sock) == (200, b'{"size": 8}')


def test_a_body_the_application_takes_late_is_not_timed_out(port):
    # past uvicorn's 64 KiB buffer the server stops reading until the application asks, so
    # the client cannot send: that silence is the server's
    body = b"x" * (4 << 20)
    with _connect(port) as sock:
        sock.sendall(_request("/late", body))
        assert _read_answer(sock) == (200, json.dumps({"size": len(body)}).encode())


def test_a_body_left_unfinished_after_its_answer_closes_the_connection(port):
    with _connect(port) as sock:
        sock.sendall(_request("/early", b"0123456789")[:-5])
        assert _read_answer(sock) == (200, b'{"size": null}')
        started = time.monotonic()
        assert _closed(sock)
        # (sooner than uvicorn's 5 s keep-alive timer, which closed it before)
        assert DEADLINE_S * 0.5 < time.monotonic() - started < DEADLINE_S * 3


class _RecordingTransport:
    """Records what is written, in place of the socket's transport."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def test_a_head_leaves_with_the_first_body_bytes_in_one_write():
    async def main():
        transport = _RecordingTransport()
        held = _HeadHeld(transport)  # type: ignore[arg-type]
        held.write(b"HEAD")
        assert transport.writes == []
        held.write(b"body1")
        held.write(b"body2")
        await asyncio.sleep(0)  # the turn's end finds nothing held
        return transport.writes

    assert asyncio.run(main()) == [b"HEADbody1", b"body2"]


def test_a_head_alone_leaves_at_the_end_of_the_turn_and_before_a_close():
    async def main():
        transport = _RecordingTransport()
        held = _HeadHeld(transport)  # type: ignore[arg-type]
        held.write(b"HEAD")
        await asyncio.sleep(0)
        after_turn = list(transport.writes)
        held.write(b"body")
        closing = _RecordingTransport()
        held_then_closed = _HeadHeld(closing)  # type: ignore[arg-type]
        held_then_closed.write(b"HEAD")
        held_then_closed.close()
        await asyncio.sleep(0)
        return after_turn, transport.writes, closing.writes, closing.closed

    after_turn, writes, closing_writes, closed = asyncio.run(main())
    assert after_turn == [b"HEAD"] and writes == [b"HEAD", b"body"]
    assert closing_writes == [b"HEAD"] and closed


def test_a_stream_head_reaches_the_client_before_its_late_body(port):
    with _connect(port) as sock:
        sock.sendall(_request("/head-then-wait"))
        started = time.monotonic()
        reader = sock.makefile("rb")
        assert reader.readline().startswith(b"HTTP/1.1 200")
        while reader.readline() not in (b"\r\n", b""):
            pass
        assert time.monotonic() - started < DEADLINE_S  # not held until the body
        assert b"late" in reader.readline() + reader.readline()
