"""A burst of new requests starts a couple per event-loop turn, in arrival order, and what
the loop has to do for the streams already running goes between them."""

from __future__ import annotations

import asyncio

import pytest

from pdpool.sidecar.net.turns import StartsPerTurn


class Turns:
    """Counts the loop's turns: a callback that schedules itself again runs once a turn."""

    def __init__(self) -> None:
        self.count = 0
        self._on = True

    def start(self) -> None:
        asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        self.count += 1
        if self._on:
            asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self._on = False


async def _burst(gate: StartsPerTurn, n: int, turns: Turns) -> list[tuple[int, int]]:
    started: list[tuple[int, int]] = []  # (request, turn)

    async def request(i: int) -> None:
        await gate.wait()
        started.append((i, turns.count))

    turns.start()
    await asyncio.gather(*(request(i) for i in range(n)))
    turns.stop()
    return started


@pytest.mark.parametrize("per_turn", [1, 2, 4])
def test_a_burst_starts_in_arrival_order_a_few_per_turn(per_turn):
    turns = Turns()
    started = asyncio.run(_burst(StartsPerTurn(per_turn), 12, turns))
    assert [i for i, _ in started] == list(range(12))
    per = {}
    for _, turn in started:
        per[turn] = per.get(turn, 0) + 1
    assert max(per.values()) == per_turn
    assert len(per) >= 12 // per_turn


def test_work_that_comes_in_between_runs_before_the_next_starts():
    async def main() -> list[str]:
        gate, order = StartsPerTurn(1), []
        loop = asyncio.get_running_loop()

        async def request(i: int) -> None:
            await gate.wait()
            order.append(f"start {i}")
            # the first token of this request comes back at once: relayed in the next turn
            loop.call_soon(order.append, f"relay {i}")

        await asyncio.gather(*(request(i) for i in range(4)))
        await asyncio.sleep(0)
        return order

    order = asyncio.run(main())
    assert order.index("relay 0") < order.index("start 2")
    assert order.index("relay 1") < order.index("start 3")


def test_a_cancelled_waiter_does_not_hold_up_those_behind_it():
    async def main() -> list[int]:
        gate, done = StartsPerTurn(1), []

        async def request(i: int) -> None:
            await gate.wait()
            done.append(i)

        tasks = [asyncio.ensure_future(request(i)) for i in range(5)]
        await asyncio.sleep(0)  # all five wait now (the first has started)
        tasks[2].cancel()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
        return done

    assert asyncio.run(main()) == [0, 1, 3, 4]


def test_the_gate_works_on_a_new_loop_after_its_old_one_closed_mid_turn():
    gate = StartsPerTurn(1)

    left: list[asyncio.Future] = []

    async def many() -> int:
        done = []

        async def request(i: int) -> None:
            await gate.wait()
            done.append(i)

        for i in range(3):  # waiters left behind, a turn scheduled on this loop
            left.append(asyncio.ensure_future(request(i)))
        return len(done)

    loop = asyncio.new_event_loop()
    loop.run_until_complete(many())
    loop.close()

    async def one_more() -> None:
        await asyncio.wait_for(gate.wait(), 2)
        await asyncio.wait_for(gate.wait(), 2)

    asyncio.run(one_more())
