"""HTTP clients for the upstream legs, and how an upstream's health is asked.

httpx's connection pool scans all of its connections (checking each socket) on every
request, so one pool with many keep-alive connections costs O(connections) per request:
at 64 concurrent streams that scan was most of the sidecar's CPU. Several small pools,
used in turn, keep each scan short."""

from __future__ import annotations

import itertools
import ssl
from typing import Callable, Optional

import httpx


def lacks_ready(status: int) -> bool:
    """An engine without /ready (stock vLLM) answers it with anything but 200 or 503."""
    return status not in (200, 503)


async def readiness(
    client: httpx.AsyncClient,
    base: str,
    timeout: Optional[float],
    no_ready: Callable[[int], bool] = lacks_ready,
) -> httpx.Response:
    """`base`/ready's answer: ready is what a wedged server (whose loop is stuck) is not,
    while its /health may still pass. A server without /ready (`no_ready` of the status it
    answered) is judged by its /health. httpx.HTTPError when it cannot be reached."""
    resp = await client.get(base + "/ready", timeout=timeout)
    if no_ready(resp.status_code):
        resp = await client.get(base + "/health", timeout=timeout)
    return resp


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
