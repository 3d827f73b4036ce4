"""run_until_disconnect: the flow runs in the request's own task, from the turn of the loop
that called it (its upstream write is not put off by a turn); a client's disconnect cancels
it and is reported, and leaves the task usable; any other cancellation and the flow's own
errors go on up; the disconnect that receive() reports once an answer is complete does not
cancel a flow that is ending."""

from __future__ import annotations

import asyncio

import pytest

from pdpool.sidecar.net.asgi import run_until_disconnect


def _receive_disconnect_after(delay_s: float):
    async def receive():
        await asyncio.sleep(delay_s)
        return {"type": "http.disconnect"}

    return receive


async def _long_flow(seen: list[str]) -> None:
    """Waits long; records its cancellation."""
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        seen.append("cancelled")
        raise


def _receive_never():
    async def receive():
        await asyncio.Event().wait()

    return receive


def test_the_flow_starts_before_the_loop_turns():
    order: list[str] = []

    async def flow():
        order.append("flow")
        await asyncio.sleep(0)

    async def main():
        asyncio.get_running_loop().call_soon(order.append, "next turn")
        caller = asyncio.current_task()

        async def checked_flow():
            assert asyncio.current_task() is caller
            await flow()

        assert await run_until_disconnect(checked_flow(), _receive_never()) is False

    asyncio.run(main())
    assert order == ["flow", "next turn"]


def test_a_disconnect_cancels_the_flow_and_leaves_the_task_usable():
    seen: list[str] = []

    async def main():
        gone = await run_until_disconnect(_long_flow(seen), _receive_disconnect_after(0.05))
        task = asyncio.current_task()
        if hasattr(task, "cancelling"):
            assert task.cancelling() == 0
        await asyncio.sleep(0.01)  # the task is not cancelled again
        return gone

    assert asyncio.run(asyncio.wait_for(main(), 5)) is True
    assert seen == ["cancelled"]


def test_a_flow_that_ends_returns_false_and_leaves_no_watcher():
    async def flow():
        await asyncio.sleep(0.01)

    async def main():
        gone = await run_until_disconnect(flow(), _receive_never())
        await asyncio.sleep(0)
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return gone, others

    gone, others = asyncio.run(main())
    assert gone is False and others == []


def test_a_cancellation_from_outside_goes_on_up():
    seen: list[str] = []

    async def main():
        task = asyncio.ensure_future(run_until_disconnect(_long_flow(seen), _receive_never()))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert seen == ["cancelled"]


def test_the_flows_own_error_goes_on_up():
    async def flow():
        await asyncio.sleep(0)
        raise RuntimeError("upstream broke")

    async def main():
        await run_until_disconnect(flow(), _receive_never())

    with pytest.raises(RuntimeError, match="upstream broke"):
        asyncio.run(main())


def test_a_flow_ending_after_its_answer_is_not_cancelled():
    """receive() reports a disconnect as soon as the answer is complete; the flow that sent
    it may still close its upstream leg (a turn of the loop) before it ends."""
    done: list[str] = []

    async def receive():
        return {"type": "http.disconnect"}

    async def flow():
        await asyncio.sleep(0)  # the answer went out; the watcher starts now
        await asyncio.sleep(0)  # closing the upstream leg
        done.append("ended")

    async def main():
        return await run_until_disconnect(flow(), receive)

    assert asyncio.run(main()) is False
    assert done == ["ended"]
