"""A routing front-end's HTTP side toward the decode sidecars: their health, their engines'
metrics and prompt tokenization, as the routing core and flow control ask for them.

The HTTP gateway and the ext_proc endpoint picker both start the routing core this way, so
a backend is judged fit, tokenized for and read for saturation alike behind either door."""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import httpx

from pdpool.tlsutil import client_context

from ..flow.admission import FlowControl
from .core import Routing
from ..flow.saturation import ENGINE_METRICS_PATH
from ..kv.engine_tokenize import EngineTokenizer
from ..net.metrics import GatewayMetrics
from ..net.upstream import readiness

# An engine's /metrics page larger than this is not read (a vLLM page is tens of KiB).
MAX_METRICS_BYTES = 8 * 1024 * 1024

log = logging.getLogger("pdpool.routing")


class Backends:
    def __init__(
        self, tls_ca_file: Optional[str], tls_any_name: bool, probe_timeout_s: float
    ) -> None:
        self.scheme = "https" if tls_ca_file else "http"
        self.tls = client_context(tls_ca_file, tls_any_name) if tls_ca_file else None
        self.probe_timeout_s = probe_timeout_s
        self.client: Optional[httpx.AsyncClient] = None  # health checks, /tokenize, metrics

    async def start(
        self,
        routing: Routing,
        flow: Optional[FlowControl],
        metrics: GatewayMetrics,
        connect_timeout: float,
        tokenize_timeout_s: float,
    ) -> None:
        """Opens the client, then starts the routing core (probing, engine tokenization) and
        flow control (engine metrics) over it."""
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024),
            verify=self.tls if self.tls is not None else True,
        )
        tokenizer = EngineTokenizer(
            lambda: self.client, self.scheme, tokenize_timeout_s, routing.healthy, metrics
        )
        await routing.start(self.probe, tokenizer, self.engine_metrics)
        if flow is not None:
            await flow.start(self.engine_metrics)

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    def url(self, backend: str, path: str = "") -> str:
        return f"{self.scheme}://{backend}{path}"

    async def probe(self, backend: str) -> bool:
        """A sidecar's readiness (one older than /ready answers it 404: its /health then)."""
        assert self.client is not None, "start() makes the client"
        try:
            r = await readiness(
                self.client,
                self.url(backend),
                self.probe_timeout_s,
                no_ready=lambda status: status == 404,
            )
        except httpx.HTTPError as exc:
            log.warning("probe of decode sidecar %s failed: %r", backend, exc)
            return False
        if r.status_code != 200:
            log.warning("probe of decode sidecar %s: answered %d", backend, r.status_code)
        return r.status_code == 200

    async def engine_metrics(self, backend: str) -> Optional[str]:
        """The sidecar's passthrough of its engine's /metrics; None when it cannot be had
        (or is larger than MAX_METRICS_BYTES: another process's answer, read bounded)."""
        assert self.client is not None, "start() makes the client"
        try:
            return await asyncio.wait_for(
                self._read_bounded(self.url(backend, ENGINE_METRICS_PATH)), self.probe_timeout_s
            )
        except (httpx.HTTPError, asyncio.TimeoutError):
            return None

    async def _read_bounded(self, url: str) -> Optional[str]:
        assert self.client is not None
        async with self.client.stream("GET", url) as r:
            if r.status_code != 200:
                return None
            chunks, size = [], 0
            async for chunk in r.aiter_bytes():
                size += len(chunk)
                if size > MAX_METRICS_BYTES:
                    return None
                chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", "replace")
