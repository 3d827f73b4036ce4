"""HTTP clients for the upstream legs.

httpx's connection pool scans all of its connections (checking each socket) on every
request, so one pool with many keep-alive connections costs O(connections) per request:
at 64 concurrent streams that scan was most of the sidecar's CPU. Several small pools,
used in turn, keep each scan short."""

from __future__ import annotations

import itertools
import ssl
from typing import Optional

import httpx


class ClientShards:
    def __init__(
        self,
        shards: int = 16,
        connect_timeout: float = 2.0,
        ssl_context: Optional[ssl.SSLContext] = None,
    ) -> None:
        timeout = httpx.Timeout(None, connect=connect_timeout)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        # One context for all shards: each made its own (the trust store loaded 16 times).
        verify = ssl_context if ssl_context is not None else ssl.create_default_context()
        self.clients = [
            httpx.AsyncClient(timeout=timeout, limits=limits, verify=verify) for _ in range(shards)
        ]
        self._turn = itertools.cycle(self.clients)

    def next(self) -> httpx.AsyncClient:
        return next(self._turn)

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()
