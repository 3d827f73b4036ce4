"""One pool of endpoints, as every router of pdpool keeps it: the decode sidecars behind the
gateway and the EPP (core.py's `Routing`), the prefill engines behind a decode pod's sidecar
(proxy/prefill_legs.py).

    discovery    EndpointSet: fixed HOST:PORTs, a headless Service (DNS) or a file
    in flight    requests under way per endpoint (LoadPicker: least loaded first)
    outliers     OutlierDetector: ejection on failed legs and probes, readmission
    probes       one round of the owner's probe over the current set, fed to `mark`

The owner chooses its probe (a sidecar's /ready, an engine's) and its policies (how many
failed probes eject, what a refused connection does), and hooks its metrics in; what an
endpoint is (fit, loaded, ejected) is answered here, alike for every owner."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, Callable, Iterator, Optional, Sequence

from ..net.discovery import EndpointSet
from .outlier import OutlierDetector
from .picker import LoadPicker

Probe = Callable[[str], Awaitable[bool]]


class EndpointPool:
    def __init__(
        self,
        endpoints: EndpointSet,
        outliers: OutlierDetector,
        on_load: Optional[Callable[[str, int], None]] = None,
        on_mark: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.endpoints = endpoints
        self.outliers = outliers
        self.picker = LoadPicker()
        # Failing their last probe, or ejected (the owner's eject hook adds them).
        self.unhealthy: set[str] = set()
        self._on_load = on_load  # (endpoint, +1 or -1): a request began or ended there
        self._on_mark = on_mark  # after each probe's result (the owner's gauges)

    # ------------------------------------------------------------------ the set
    @property
    def current(self) -> list[str]:
        return self.endpoints.current

    async def start(self) -> None:
        await self.endpoints.start()

    async def stop(self) -> None:
        await self.endpoints.stop()

    # ------------------------------------------------------------------ load
    def load(self, endpoint: str) -> int:
        return self.picker.in_flight(endpoint)

    def by_load(self, endpoints: Sequence[str], preferred: Optional[str] = None) -> list[str]:
        """Least loaded first (ties round-robin), `preferred` before all."""
        return self.picker.order(endpoints, preferred=preferred)

    @contextlib.contextmanager
    def tracked(self, endpoint: str) -> Iterator[None]:
        """Counts a request in flight on `endpoint` for as long as the block runs."""
        with self.picker.track(endpoint):
            if self._on_load is not None:
                self._on_load(endpoint, 1)
            try:
                yield
            finally:
                if self._on_load is not None:
                    self._on_load(endpoint, -1)

    # ------------------------------------------------------------------ health
    def healthy(self, endpoint: str) -> bool:
        return endpoint not in self.unhealthy

    def healthy_endpoints(self) -> list[str]:
        return [e for e in self.current if e not in self.unhealthy]

    def available(self) -> list[str]:
        """The current endpoints that are not ejected."""
        return self.outliers.available(self.current)

    def mark(self, endpoint: str, ok: bool) -> None:
        """A probe's result: a failure makes the endpoint unhealthy at once (and counts
        towards its ejection); success makes it healthy again unless it is ejected (then
        the outlier detector readmits it once its ejection time has passed)."""
        self.outliers.probe(endpoint, ok)
        if not ok:
            self.unhealthy.add(endpoint)
        elif not self.outliers.is_ejected(endpoint):
            self.unhealthy.discard(endpoint)
        if self._on_mark is not None:
            self._on_mark(endpoint)

    async def probe_all(self, probe: Probe, endpoints: Optional[Sequence[str]] = None) -> None:
        """One probe of each endpoint (the current set by default), at once, each result
        marked as it comes."""

        async def one(endpoint: str) -> None:
            self.mark(endpoint, await probe(endpoint))

        await asyncio.gather(*(one(e) for e in (self.current if endpoints is None else endpoints)))
