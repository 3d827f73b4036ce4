"""One background job on the event loop: a step, then a pause, until stopped.

A failed step is logged and the next one runs on time: a scrape or a lookup that fails
once must not stop what depends on the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Awaitable, Callable, Optional

log = logging.getLogger("pdpool.sidecar")


class Periodic:
    def __init__(
        self, step: Callable[[], Awaitable[None]], pause_s: Callable[[], float], what: str
    ):
        self.step, self.pause_s, self.what = step, pause_s, what
        self._task: Optional[asyncio.Task[None]] = None

    @property
    def running(self) -> bool:
        return self._task is not None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _forever(self) -> None:
        while True:
            try:
                await self.step()
            except Exception:
                log.exception("%s failed", self.what)
            await asyncio.sleep(self.pause_s())
