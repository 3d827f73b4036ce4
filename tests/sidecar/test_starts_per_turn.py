"""A burst of new requests starts a couple per event-loop turn, in arrival order, and what
the loop has to do for the streams already running goes between them. Keyed starts (the
gateway's tenants) take turns: one key's burst holds another's request back by a turn."""

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


def _keyed(gate: StartsPerTurn, keys: list[str]) -> list[str]:
    """Every arrival waits at the gate at once under its key; the order they started in,
    named key + its number within the key."""

    async def main() -> list[str]:
        order: list[str] = []
        counts: dict[str, int] = {}

        async def request(key: str, name: str) -> None:
            await gate.wait(key)
            order.append(name)

        tasks = []
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
            tasks.append(request(key, f"{key}{counts[key]}"))
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        return order

    return asyncio.run(main())


def test_another_key_behind_a_burst_starts_in_the_next_turn_not_after_the_burst():
    # 40 of "noisy" wait when one of "quiet" comes: it starts in the first turn that lets
    # anyone through, beside one of the burst, instead of 20 turns later.
    order = _keyed(StartsPerTurn(2), ["noisy"] * 40 + ["quiet"])
    assert order.index("quiet1") <= 3
    assert [n for n in order if n != "quiet1"] == [f"noisy{i}" for i in range(1, 41)]


def test_waiting_keys_take_turns_first_come_first_within_each():
    order = _keyed(StartsPerTurn(2), ["a"] * 6 + ["b"] * 6 + ["c"] * 2)
    assert order[:2] == ["a1", "a2"]  # nobody waited: at once
    assert order[2:8] == ["a3", "b1", "c1", "a4", "b2", "c2"]
    assert order[8:] == ["a5", "b3", "a6", "b4", "b5", "b6"]


def test_a_cancelled_keyed_waiter_leaves_nothing_behind():
    async def main() -> StartsPerTurn:
        gate = StartsPerTurn(1)
        first = asyncio.ensure_future(gate.wait("a"))  # takes the turn's one start
        cancelled = asyncio.ensure_future(gate.wait("b"))
        other = asyncio.ensure_future(gate.wait("c"))
        await asyncio.sleep(0)  # "a" started; "b" and "c" wait
        assert first.done() and not cancelled.done() and not other.done()
        cancelled.cancel()
        await asyncio.wait_for(other, 5)
        assert cancelled.cancelled()
        return gate

    gate = asyncio.run(main())
    assert not gate._waiting
