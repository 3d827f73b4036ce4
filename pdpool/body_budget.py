"""How many bytes of large request bodies one server process holds at once.

--max-body-bytes refuses one body that is too large, but bodies under it add up: a proxy
holds each one several times over while it reads, parses and forwards it (the pieces read,
the joined bytes, the parsed prompt, the re-encoded leg), so a handful of 30 MB bodies at
once takes a gateway past its pod's memory limit. Every body past SMALL_BODY_BYTES draws on
one budget per process as it arrives (its announced length up front); a body that would
overdraw it is refused with 503 and Retry-After, before more of it is buffered, and what a
request held goes back when its request ends.

Small bodies (every ordinary completion or chat) are neither counted nor refused, so large
bodies in flight, an attacker's included, never turn ordinary requests away.
"""

from __future__ import annotations

from types import TracebackType
from typing import Optional

SMALL_BODY_BYTES = 64 * 1024
DEFAULT_MAX_BODY_BYTES_IN_FLIGHT = 128 * 1024 * 1024
RETRY_AFTER_S = "1"
IN_FLIGHT_HELP = (
    "request bodies over 64KiB one process holds at once (bytes, or e.g. 256MiB; default "
    "%(default)s): one that would pass it gets 503 with Retry-After; at least --max-body-bytes"
)


class BodiesBusy(Exception):
    """A body that would take the process past its budget of large bodies in flight."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"the server holds its limit of large request bodies ({limit} bytes in flight); "
            "retry shortly"
        )


class BodyBudget:
    """The budget of one process (its event loop is the only user: no lock)."""

    def __init__(self, limit: int = DEFAULT_MAX_BODY_BYTES_IN_FLIGHT) -> None:
        self.limit = limit
        self.held = 0

    def hold(self) -> BodyHold:
        """One request's share, empty until its body grows past SMALL_BODY_BYTES."""
        return BodyHold(self)


class BodyHold:
    """What one request's body holds of the budget; a context manager that gives it back
    (once, however often it is released)."""

    __slots__ = ("budget", "bytes")

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.bytes = 0

    def grow_to(self, size: int) -> None:
        """Holds `size` bytes in all once the body is past SMALL_BODY_BYTES; BodiesBusy
        when the budget has no room for the growth."""
        if size <= SMALL_BODY_BYTES or size <= self.bytes:
            return
        extra = size - self.bytes
        if self.budget.held + extra > self.budget.limit:
            raise BodiesBusy(self.budget.limit)
        self.budget.held += extra
        self.bytes = size

    def release(self) -> None:
        self.budget.held -= self.bytes
        self.bytes = 0

    def __enter__(self) -> BodyHold:
        return self

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.release()


def check_budget(in_flight: int, max_body: int) -> None:
    """ValueError unless the budget can take the largest body a request may send."""
    if in_flight < max_body:
        raise ValueError(
            f"max_body_bytes_in_flight ({in_flight}) must be at least max_body_bytes "
            f"({max_body}): a body under the one limit would always be refused by the other"
        )
