"""Asking a decode engine (through its sidecar, which passes /tokenize through) for a
prompt's token ids, for the routing core's precise KV routing."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import httpx

from ..routing.engine_tokenize import token_ids_of, tokenize_body
from .metrics import GatewayMetrics

log = logging.getLogger("pdpool.routing")

# The client's headers an engine's /tokenize may see: never its credentials (Authorization,
# x-api-key), which go no further than the front-end whatever the request's own leg does.
PASSED_HEADERS = ("x-request-id",)


class EngineTokenizer:
    def __init__(
        self,
        client: Callable[[], Optional[httpx.AsyncClient]],
        scheme: str,
        timeout_s: float,
        healthy: Callable[[str], bool],
        metrics: GatewayMetrics,
    ) -> None:
        self.client, self.scheme, self.timeout_s = client, scheme, timeout_s
        self.healthy, self.metrics = healthy, metrics

    async def __call__(
        self, body: Any, order: list[str], headers: dict[str, str]
    ) -> Optional[list[int]]:
        """The prompt's ids from the first healthy backend's engine; None when that cannot
        be had in time."""
        ask = tokenize_body(body)
        backend = next((b for b in order if self.healthy(b)), None)
        client = self.client()
        if ask is None or backend is None or client is None:
            return None
        passed = {k: v for k, v in headers.items() if k in PASSED_HEADERS}
        try:
            resp = await client.post(
                f"{self.scheme}://{backend}/tokenize",
                json=ask,
                headers=passed,
                timeout=self.timeout_s,
            )
            ids = token_ids_of(resp.json()) if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("tokenize on %s failed: %s", backend, exc)
            ids = None
        self.metrics.kv_engine_tokenize.labels("ok" if ids is not None else "failed").inc()
        return ids
