"""Outlier detection for a set of upstream endpoints, in the manner of Envoy's.

An endpoint is *ejected* (taken out of the candidates) when
- it fails `consecutive_failures` requests in a row (connect errors, timeouts, answers
  that are its own fault (`endpoint_fault`), a stream that broke or stalled): passive
  detection, driven by real traffic; or
- `probe_failures` health probes in a row fail (short timeouts): active detection, which
  notices a wedged engine (SIGSTOP: connections are accepted, nothing is answered) without
  sacrificing requests to it.

An ejected endpoint comes back when a probe succeeds and its ejection time has passed:
`base_ejection_s` times the number of recent ejections (capped at `max_ejection_s`), so a
flapping endpoint stays out longer. The count of recent ejections resets once it has
stayed in for `max_ejection_s`.

Callers that wait on an endpoint race their work against its ejection (`EjectionRace`)
and give up on it (and try elsewhere) as soon as it is ejected, instead of waiting out
their own timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import TracebackType
from typing import Any, Awaitable, Callable, Generic, Iterable, Literal, Optional, TypeVar

T = TypeVar("T")

# Answers that are the endpoint's fault, as Envoy's gateway-failure detection counts them:
# its engine unreachable or dead (502, 503) or too slow (504). A 4xx or a 500 may be the
# request's own doing (a body its engine chokes on): were they counted, a few such requests
# would eject every endpoint and innocent requests would find none.
ENDPOINT_FAULTS = frozenset({502, 503, 504})


def endpoint_fault(status: int) -> bool:
    """Whether an answer with `status` counts against the endpoint that gave it."""
    return status in ENDPOINT_FAULTS


class OutlierDetector:
    def __init__(
        self,
        consecutive_failures: int = 3,
        probe_failures: int = 2,
        base_ejection_s: float = 2.0,
        max_ejection_s: float = 30.0,
        on_eject: Optional[Callable[[str, str], None]] = None,
        on_readmit: Optional[Callable[[str], None]] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.consecutive_failures = max(int(consecutive_failures), 1)
        self.probe_failures = max(int(probe_failures), 1)
        self.base_ejection_s = base_ejection_s
        self.max_ejection_s = max_ejection_s
        self._on_eject, self._on_readmit, self._clock = on_eject, on_readmit, clock
        self._failures: dict[str, int] = {}
        self._probe_failures: dict[str, int] = {}
        self._ejected_until: dict[str, float] = {}
        self._ejections: dict[str, int] = {}  # recent ejections (sets the duration)
        self._admitted_at: dict[str, float] = {}
        self._events: dict[str, asyncio.Event] = {}

    # ------------------------------------------------------------------ queries
    def is_ejected(self, endpoint: str) -> bool:
        return endpoint in self._ejected_until

    def available(self, endpoints: Iterable[str]) -> list[str]:
        return [e for e in endpoints if e not in self._ejected_until]

    def due(self, endpoints: Iterable[str]) -> list[str]:
        """Ejected endpoints whose ejection time has passed: one good probe readmits them."""
        now = self._clock()
        return [e for e in endpoints if self._ejected_until.get(e, now + 1) <= now]

    @property
    def ejected(self) -> list[str]:
        return sorted(self._ejected_until)

    def ejected_event(self, endpoint: str) -> asyncio.Event:
        """An event that is set while `endpoint` is ejected."""
        event = self._events.get(endpoint)
        if event is None:
            event = self._events[endpoint] = asyncio.Event()
            if self.is_ejected(endpoint):
                event.set()
        return event

    # ------------------------------------------------------------------ outcomes
    def success(self, endpoint: str) -> None:
        """A request went well: the failure streak ends (it does not readmit)."""
        self._failures.pop(endpoint, None)

    def failure(self, endpoint: str, reason: str) -> bool:
        """A request failed; returns True when this ejected the endpoint."""
        n = self._failures.get(endpoint, 0) + 1
        self._failures[endpoint] = n
        if n >= self.consecutive_failures:
            return self.eject(endpoint, reason)
        return False

    def probe(self, endpoint: str, ok: bool) -> None:
        """The result of one health probe."""
        if not ok:
            n = self._probe_failures.get(endpoint, 0) + 1
            self._probe_failures[endpoint] = n
            if n >= self.probe_failures:
                self.eject(endpoint, "probe")
            return
        self._probe_failures.pop(endpoint, None)
        until = self._ejected_until.get(endpoint)
        if until is not None and self._clock() >= until:
            self.readmit(endpoint)

    def eject(self, endpoint: str, reason: str) -> bool:
        if endpoint in self._ejected_until:
            return False
        now = self._clock()
        if now - self._admitted_at.get(endpoint, now) > self.max_ejection_s:
            self._ejections.pop(endpoint, None)  # it behaved for a long while
        n = self._ejections.get(endpoint, 0) + 1
        self._ejections[endpoint] = n
        self._ejected_until[endpoint] = now + min(self.base_ejection_s * n, self.max_ejection_s)
        self._failures.pop(endpoint, None)
        if endpoint in self._events:
            self._events[endpoint].set()
        if self._on_eject:
            self._on_eject(endpoint, reason)
        return True

    def readmit(self, endpoint: str) -> None:
        if self._ejected_until.pop(endpoint, None) is None:
            return
        self._admitted_at[endpoint] = self._clock()
        self._failures.pop(endpoint, None)
        event = self._events.get(endpoint)
        if event is not None:
            event.clear()
        if self._on_readmit:
            self._on_readmit(endpoint)

    def forget(self, keep: Iterable[str]) -> None:
        """Drops state of endpoints no longer in the set (DNS changes)."""
        keep = set(keep)
        for table in (
            self._failures,
            self._probe_failures,
            self._ejected_until,
            self._ejections,
            self._admitted_at,
            self._events,
        ):
            for endpoint in [e for e in table if e not in keep]:
                del table[endpoint]


class EjectionRace(Generic[T]):
    """Work on an endpoint, raced against the endpoint's ejection:

        async with EjectionRace(outliers, endpoint, work, httpx.HTTPError) as race:
            if await race.wait(timeout) == "done":
                ...race.result()...

    Leaving the block cancels work still running, which closes its upstream connection
    (the engine aborts the request), and waits for it, ignoring `errors` it ends with.
    `past_ejection`: an endpoint already ejected when the race starts counts as ejected at
    once; else only an ejection while the work runs does."""

    def __init__(
        self,
        outliers: OutlierDetector,
        endpoint: str,
        work: Awaitable[T],
        *errors: type[BaseException],
        past_ejection: bool = True,
    ) -> None:
        self.task: asyncio.Future[T] = asyncio.ensure_future(work)
        self._errors = errors
        event = outliers.ejected_event(endpoint)
        self._ejected: Optional[asyncio.Future[Literal[True]]] = (
            None if event.is_set() and not past_ejection else asyncio.ensure_future(event.wait())
        )

    async def __aenter__(self) -> "EjectionRace[T]":
        return self

    async def __aexit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.stop_watching()
        if not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, *self._errors):
                await self.task

    async def wait(self, timeout: Optional[float]) -> Literal["done", "ejected", "timeout"]:
        """Until the work is done (its outcome first when both happened), the endpoint is
        ejected, or `timeout` has passed."""
        waits: set[asyncio.Future[Any]] = {self.task}
        if self._ejected is not None:
            waits.add(self._ejected)
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if self.task in done:
            return "done"
        return "ejected" if self._ejected in done else "timeout"

    def stop_watching(self) -> None:
        """Ejection no longer ends the race (the work has nowhere else to go)."""
        if self._ejected is not None:
            self._ejected.cancel()
            self._ejected = None

    def result(self) -> T:
        return self.task.result()
