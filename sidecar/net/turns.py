"""New generation requests start at most a couple per turn of the event loop.

A burst of arrivals is read in one turn of the loop. Run as they come, all of them are
forwarded (read, checked, written upstream) before the loop looks at its sockets again, so
the first tokens answering the earliest ones wait behind the whole burst's forwarding: in a
burst of 32, even the first request's first token waits for all 32 forwards. Held to
PER_TURN starts a turn, the loop polls its sockets between them and relays each first
token as soon as it is in, so a burst's requests get their first tokens in turn. What a
request waits for is the same work in another order (the streams already running go
first), plus one poll a turn. The sidecar and the gateway hold their generation routes to
it. Measured with benchmarks/sidecar_overhead.py (`--gateway` for the gateway):
docs/sidecar.md.

Requests that wait are released in turn by key (the gateway's key is the tenant): one of
each waiting key in rotation, first come first within a key. A tenant's burst of 40 then
holds another tenant's request back by one turn, not by the 20 turns its own starts take.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Hashable, Optional

PER_TURN = 2


class StartsPerTurn:
    """The gate of one app; it follows the event loop it is used on."""

    def __init__(self, per_turn: int = PER_TURN) -> None:
        self.per_turn = max(1, per_turn)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        # Waiting starts by key, in the order the keys take their turns (a key that was
        # served goes to the back).
        self._waiting: dict[Hashable, deque[asyncio.Future[None]]] = {}
        self._started = 0  # in the current turn
        self._turn_scheduled = False

    async def wait(self, key: Hashable = None) -> None:
        """Returns when the caller may start: at once while this turn has room and nobody
        waits; else in `key`'s turn."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop (tests run several): the old one's state goes
            self._loop, self._waiting, self._started = loop, {}, 0
            self._turn_scheduled = False
        if not self._waiting and self._started < self.per_turn:
            self._started += 1
            self._schedule_turn(loop)
            return
        fut: asyncio.Future[None] = loop.create_future()
        self._waiting.setdefault(key, deque()).append(fut)
        self._schedule_turn(loop)
        try:
            await fut
        except asyncio.CancelledError:
            queue = self._waiting.get(key)
            if queue is not None and fut in queue:  # cancelled before its turn came
                queue.remove(fut)
                if not queue:
                    del self._waiting[key]
            raise

    def _schedule_turn(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._turn_scheduled:
            self._turn_scheduled = True
            # A callback scheduled now runs in the loop's next turn, after it polls.
            loop.call_soon(self._next_turn, loop)

    def _next_turn(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self._loop:
            return
        self._turn_scheduled = False
        self._started = 0
        while self._waiting and self._started < self.per_turn:
            key = next(iter(self._waiting))
            queue = self._waiting.pop(key)
            fut = queue.popleft()
            if queue:
                self._waiting[key] = queue  # back of the rotation
            if not fut.done():
                fut.set_result(None)
                self._started += 1
        if self._waiting or self._started:
            self._schedule_turn(loop)
