"""Where the prefill engines are: a fixed list, the DNS of a headless Service, or a file.

A headless Service resolves to one A record per ready pod, so resolving it again every
few seconds follows scale-ups, scale-downs and restarts without a Kubernetes client.
`file:PATH` in place of a Service names a file of HOST:PORT lines, re-read every half
second: how `pdpool up --autoscale` tells the gateway and the sidecars which local
processes serve now (it rewrites the file atomically on each change)."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Iterable, Optional

from .periodic import Periodic
from .security import ForbiddenTarget, normalize_host_port

log = logging.getLogger("pdpool.sidecar.discovery")
FILE_PREFIX = "file:"
FILE_REFRESH_S = 0.5  # a local file is cheap to read, and a removed endpoint must go fast


def parse_service(value: str) -> tuple[str, int]:
    """'HOST:PORT' of a Service -> (host, port); ValueError when malformed."""
    host, sep, port = value.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"service must be HOST:PORT, got {value!r}")
    return host, int(port)


class EndpointSet:
    """The current set of endpoints (prefill engines, or sidecars for the gateway) as
    normalized 'HOST:PORT' strings."""

    def __init__(
        self, static: Iterable[str] = (), service: Optional[str] = None, refresh_s: float = 5.0
    ) -> None:
        self._static = [normalize_host_port(s) for s in static]
        self._file = (
            service[len(FILE_PREFIX) :] if service and service.startswith(FILE_PREFIX) else None
        )
        if self._file == "":
            raise ValueError("file: needs a path (file:/path/to/endpoints)")
        self._service = parse_service(service) if service and self._file is None else None
        self._refresh_s = min(refresh_s, FILE_REFRESH_S) if self._file else refresh_s
        self._resolved: list[str] = []
        self._refresh = Periodic(self.resolve_once, lambda: self._refresh_s, "endpoint discovery")

    @property
    def current(self) -> list[str]:
        return self._static + [e for e in self._resolved if e not in self._static]

    def _read_file(self, path: str) -> None:
        try:
            with open(path, encoding="utf-8") as fh:
                lines = [line.strip() for line in fh]
            self._resolved = sorted(
                {normalize_host_port(x) for x in lines if x and not x.startswith("#")}
            )
        except (OSError, ValueError, ForbiddenTarget) as exc:
            log.warning("cannot read endpoints file %s: %s", path, exc)  # keep the last set

    async def resolve_once(self) -> None:
        if self._file:
            self._read_file(self._file)
            return
        if not self._service:
            return
        host, port = self._service
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            # Keep the last good set: a DNS hiccup must not empty the pool.
            log.warning("cannot resolve service %s: %s", host, exc)
            return
        found = set()
        for family, _, _, _, addr in infos:
            ip = addr[0]
            found.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
        self._resolved = sorted(found)

    async def start(self) -> None:
        if self._service or self._file:
            await self.resolve_once()
            self._refresh.start()

    async def stop(self) -> None:
        await self._refresh.stop()
