"""The scheduler's waiting line, in the order of its scheduling policy (vLLM's
`--scheduling-policy`, with vLLM 0.32's semantics):

- fcfs: arrival order; a request that goes back (preempted, or its KV arrived) goes to the
  head. A request's `priority` is carried but plays no part (vLLM 0.32 accepts it and
  ignores it under fcfs).
- priority: by (priority, arrival time), lower first, as vLLM's PriorityRequestQueue; a
  request that goes back is placed by the same key (there is no head to go back to).

Both queues answer the same deque-like calls the scheduler makes: append (a new arrival),
appendleft (going back), popleft and [0] (the head), remove, iteration in order, reversed.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Iterator, Union

from pdpool.engine.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")


def priority_key(req: Request) -> tuple[int, float]:
    """The order of the priority policy: lower priority value first, then earlier arrival."""
    return (req.priority, req.arrival_time)


class PriorityQueue:
    """Waiting requests kept sorted by `priority_key` (equal keys stay in insertion order):
    the head is [0] and iteration is in scheduling order, as the FCFS deque's."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, float]] = []
        self._items: list[Request] = []

    def append(self, req: Request) -> None:
        key = priority_key(req)
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._items.insert(i, req)

    # Going back to the queue is placement by key too.
    appendleft = append

    def popleft(self) -> Request:
        self._keys.pop(0)
        return self._items.pop(0)

    def remove(self, req: Request) -> None:
        i = self._items.index(req)
        del self._keys[i], self._items[i]

    def __getitem__(self, i: int) -> Request:
        return self._items[i]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __reversed__(self) -> Iterator[Request]:
        return reversed(self._items)

    def __contains__(self, req: object) -> bool:
        return req in self._items


WaitingQueue = Union["deque[Request]", PriorityQueue]


def waiting_queue(policy: str) -> WaitingQueue:
    if policy == "priority":
        return PriorityQueue()
    if policy == "fcfs":
        return deque()
    raise ValueError(f"--scheduling-policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
