"""Choosing a prefill engine: least in-flight requests first, the others as retries."""

from __future__ import annotations

import contextlib
import itertools
from typing import Iterable, Iterator, Optional


class LoadPicker:
    """Tracks in-flight requests per endpoint ('HOST:PORT') and orders candidates.

    Ties are broken round-robin so that an idle pool spreads requests."""

    def __init__(self) -> None:
        self._in_flight: dict[str, int] = {}
        self._turn = itertools.count()

    def in_flight(self, endpoint: str) -> int:
        return self._in_flight.get(endpoint, 0)

    def order(self, endpoints: Iterable[str], preferred: Optional[str] = None) -> list[str]:
        """Endpoints to try, in order: `preferred` first (when given), then by load."""
        pool = sorted(set(endpoints))
        if not pool:
            return [preferred] if preferred else []
        start = next(self._turn) % len(pool)
        rotated = pool[start:] + pool[:start]
        ranked = sorted(rotated, key=self.in_flight)  # stable: rotation breaks ties
        if preferred:
            ranked = [preferred] + [e for e in ranked if e != preferred]
        return ranked

    @contextlib.contextmanager
    def track(self, endpoint: str) -> Iterator[None]:
        self._in_flight[endpoint] = self.in_flight(endpoint) + 1
        try:
            yield
        finally:
            left = self._in_flight[endpoint] - 1
            if left:
                self._in_flight[endpoint] = left
            else:
                del self._in_flight[endpoint]
