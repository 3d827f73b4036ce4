"""Large request bodies in flight are bounded per process: the budget itself, read_body's use
of it, and the engine, its sidecar and the gateway of a real `pdpool up` answering 503 with
Retry-After to a large body that would pass it, while small requests keep being served."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from pdpool.body_budget import SMALL_BODY_BYTES, BodiesBusy, BodyBudget, check_budget
from pdpool.sidecar.net.asgi import read_body
from tests.support.e2e_helpers import cleanup, start_topology

KIB = 1024
MIB = 1024 * KIB


# ----------------------------------------------------------------------------- the budget


def test_small_bodies_are_neither_counted_nor_refused():
    budget = BodyBudget(limit=MIB)
    with budget.hold() as big:
        big.grow_to(MIB)
        assert budget.held == MIB
        for _ in range(100):
            with budget.hold() as small:
                small.grow_to(SMALL_BODY_BYTES)
        assert budget.held == MIB
    assert budget.held == 0


def test_a_body_that_would_overdraw_the_budget_is_refused_and_takes_nothing():
    budget = BodyBudget(limit=MIB)
    first, second = budget.hold(), budget.hold()
    first.grow_to(600 * KIB)
    with pytest.raises(BodiesBusy, match="retry"):
        second.grow_to(600 * KIB)
    assert (budget.held, second.bytes) == (600 * KIB, 0)
    first.release()
    second.grow_to(600 * KIB)  # room again once the first request ended
    assert budget.held == 600 * KIB


def test_a_hold_grows_by_the_difference_and_is_released_once():
    budget = BodyBudget(limit=MIB)
    hold = budget.hold()
    for size in (100 * KIB, 300 * KIB, 200 * KIB, MIB):
        hold.grow_to(size)
    assert budget.held == MIB == hold.bytes
    hold.release()
    hold.release()
    assert budget.held == 0


def test_the_budget_must_take_the_largest_allowed_body():
    check_budget(2 * MIB, 2 * MIB)
    with pytest.raises(ValueError, match="at least max_body_bytes"):
        check_budget(MIB, 2 * MIB)


# ----------------------------------------------------------------------------- read_body


def _receive(pieces: list[bytes]):
    messages = [
        {"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
        for i, p in enumerate(pieces)
    ]

    async def receive():
        return messages.pop(0)

    return receive, messages


def test_an_announced_large_body_is_refused_before_a_byte_is_read():
    budget = BodyBudget(limit=MIB)
    budget.hold().grow_to(MIB)  # another request holds it all
    receive, left = _receive([b"x" * 100 * KIB])
    scope = {"headers": [(b"content-length", str(100 * KIB).encode())]}
    with pytest.raises(BodiesBusy):
        asyncio.run(read_body(receive, 4 * MIB, scope, budget.hold()))
    assert len(left) == 1


def test_a_chunked_body_is_counted_as_it_arrives():
    budget = BodyBudget(limit=MIB)
    budget.hold().grow_to(700 * KIB)
    receive, left = _receive([b"x" * 200 * KIB, b"x" * 200 * KIB, b"x" * 200 * KIB])
    with pytest.raises(BodiesBusy), budget.hold() as refused:
        asyncio.run(read_body(receive, 4 * MIB, {"headers": []}, refused))
    assert len(left) == 1  # refused on the piece that passed the budget
    assert budget.held == 700 * KIB  # and its request gave back what it held
    with budget.hold() as hold:
        receive, _ = _receive([b"x" * 100 * KIB, b"x" * 100 * KIB])
        assert len(asyncio.run(read_body(receive, 4 * MIB, {"headers": []}, hold))) == 200 * KIB
        assert budget.held == 900 * KIB
    assert budget.held == 700 * KIB


# ----------------------------------------------------------------------------- end to end

LIMIT = MIB  # --max-body-bytes
IN_FLIGHT = 2 * MIB  # --max-body-bytes-in-flight
LARGE = 900 * KIB  # two fit the budget, a third does not


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    flags = [f"--max-body-bytes={LIMIT}", f"--max-body-bytes-in-flight={IN_FLIGHT}"]
    topo = start_topology(
        tmp_path_factory,
        prefill=0,
        decode=1,
        mode="aggregated",
        extra_engine_args=tuple(flags),
        sidecar_args=[*flags, "--workers=1"],  # one process: one budget to fill
        gateway_args=flags,
    )
    try:
        yield {
            "engine": topo.by_role("decode")[0].url,
            "sidecar": topo.by_role("sidecar")[0].url,
            "gateway": topo.gateway.url,
        }
    finally:
        cleanup(topo)


def _large_body() -> bytes:
    body = json.dumps({"prompt": "a " * (LARGE // 2), "max_tokens": 2}).encode()
    return body + b" " * (LARGE - len(body))


def _start_upload(url: str, body: bytes, sent: int) -> socket.socket:
    """A POST that announces all of `body` and sends its first `sent` bytes."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body[:sent])
    return sock


def _answer(sock: socket.socket) -> tuple[int, str]:
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(65536)
        if not piece:
            break
        data += piece
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    lengths = [ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")]
    want = int(lengths[0].split(b":")[1]) if lengths else 0
    while len(rest) < want:
        piece = sock.recv(65536)
        if not piece:
            break
        rest += piece
    return status, head.decode("latin-1") + "\r\n\r\n" + rest.decode("utf-8", "replace")


@pytest.mark.slow
@pytest.mark.parametrize("server", ["engine", "sidecar", "gateway"])
def test_a_large_body_past_the_budget_gets_503_and_small_ones_are_served(targets, server):
    url = targets[server]
    body = _large_body()
    held = [_start_upload(url, body, len(body) // 2) for _ in range(2)]
    try:
        time.sleep(0.5)  # both halves read: the budget is full
        refused = _start_upload(url, body, 0)
        status, answer = _answer(refused)
        refused.close()
        assert status == 503, answer[:400]
        assert "retry-after: 1" in answer.lower(), answer[:400]
        error = json.loads(answer.split("\r\n\r\n", 1)[1])["error"]
        assert "large request bodies" in error["message"], error
        # ordinary requests are not held back by the large ones
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text[:300]
        # a client that leaves mid-body gives its share back; one that finishes does too
        held[0].close()
        held[1].sendall(body[len(body) // 2 :])
        status, answer = _answer(held[1])
        assert status == 400, answer[:400]  # its prompt is longer than the model's context
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while True:  # the server notices the closed upload within a moment
        statuses = []
        for _ in range(2):
            sock = _start_upload(url, body, len(body))
            statuses.append(_answer(sock)[0])
            sock.close()
        if statuses == [400, 400] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert statuses == [400, 400]
