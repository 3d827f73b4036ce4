"""send_now: an ASGI send from a plain callback, finished later only when the server waits."""

from __future__ import annotations

import asyncio

import pytest

from pdpool.sidecar.net.asgi import send_now


async def test_a_send_that_does_not_wait_is_done_before_send_now_returns():
    sent = []

    async def send(message):
        sent.append(message)

    assert send_now(send, {"type": "http.response.body", "body": b"x"}) is None
    assert sent == [{"type": "http.response.body", "body": b"x"}]


async def test_a_send_that_waits_is_finished_by_the_returned_awaitable():
    drained = asyncio.get_running_loop().create_future()
    sent = []

    async def send(message):
        await asyncio.sleep(0)  # a bare yield first
        await drained  # then a future, as uvicorn's drain while the client is not reading
        sent.append(message)

    waiting = send_now(send, {"body": b"x"})
    assert waiting is not None and sent == []
    task = asyncio.ensure_future(waiting)
    await asyncio.sleep(0.01)
    assert sent == [] and not task.done()
    drained.set_result(None)
    await asyncio.wait_for(task, 1)
    assert sent == [{"body": b"x"}]


async def test_a_failed_wait_raises_from_the_send_and_a_cancelled_one_closes_it():
    loop = asyncio.get_running_loop()
    failing = loop.create_future()
    closed = []

    async def send(message):
        try:
            await message["wait_on"]
        finally:
            closed.append(message["name"])

    waiting = send_now(send, {"wait_on": failing, "name": "failing"})
    assert waiting is not None
    failing.set_exception(ConnectionResetError("client gone"))
    with pytest.raises(ConnectionResetError, match="client gone"):
        await waiting
    waiting = send_now(send, {"wait_on": loop.create_future(), "name": "cancelled"})
    assert waiting is not None
    task = asyncio.ensure_future(waiting)
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert closed == ["failing", "cancelled"]  # the send's own cleanup ran both times
