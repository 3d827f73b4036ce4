"""The engine's capability learned once for all the workers of a sidecar (net/workers.py):
worker 0 probes the engine as a single sidecar does; the others read its answer from a file
in the workers' private folder, so the engine gets one probe, not one per worker."""

from __future__ import annotations

import asyncio
import os
from typing import Any, Coroutine, Optional

from .capability import EngineCapability

READ_PAUSE_S = 0.2


class CapabilityShare:
    def __init__(self, path: str, prober: bool) -> None:
        self.path = path
        self.prober = prober

    async def learn(self, capability: EngineCapability, probe: Coroutine[Any, Any, None]) -> None:
        """The prober runs `probe` (EngineCapability.probe_until_known) and writes the
        answer; the others wait for that answer (requests meanwhile take plain
        decode-first, as they do while a single sidecar probes)."""
        if self.prober:
            await probe
            if capability.known is not None:
                self._write(capability.known)
            return
        probe.close()  # never run: not this worker's job
        while capability.known is None:
            answer = self._read()
            if answer is not None:
                capability.known = answer  # worker 0 logged it
                return
            await asyncio.sleep(READ_PAUSE_S)

    def _write(self, rejects: bool) -> None:
        part = self.path + ".part"
        with open(part, "w") as fh:
            fh.write("1" if rejects else "0")
        os.replace(part, self.path)  # the readers see all of it or nothing

    def _read(self) -> Optional[bool]:
        try:
            with open(self.path) as fh:
                value = fh.read().strip()
        except OSError:
            return None
        return {"1": True, "0": False}.get(value)
