"""The one admission point of flow control, for every front-end (the HTTP gateway, the
ext_proc endpoint picker): who the tenant is, and `admit`, which holds the request's slot
in the pool for as long as it runs.

    flow = FlowControl(tenants_file, tenant_header, routing.healthy_backends, registry)
    await flow.start(fetch_engine_metrics)        # fetch(backend) -> Prometheus text or None
    tenant = flow.tenant(headers)                 # None: 401 (no valid key / unknown tenant)
    try:
        async with flow.admit(tenant, headers, body):
            body["priority"] = flow.engine_priority(tenant, headers)   # the engines' order
            ...route and serve the request...
    except Shed as shed:                          # 429, Retry-After: shed.retry_after_s
        ...

Without a tenants file there is no FlowControl at all: the front-end's path is as before.
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator, Callable, Optional

from prometheus_client import CollectorRegistry

from ..net.apikeys import presented_key
from .queues import FlowController, FlowRequest, Shed, Slot, estimate_tokens
from .metrics import FlowMetrics
from .saturation import Fetch, Saturation
from .tenants import PoolLimits, Tenant, TenantsFile, engine_priority

__all__ = ["FlowControl", "Shed", "Slot", "shed_body"]


class FlowControl:
    def __init__(
        self,
        tenants_file: str,
        tenant_header: Optional[str],
        healthy_backends: Callable[[], list[str]],
        registry: Optional[CollectorRegistry] = None,
        default_max_tokens: int = 16,
        scrape_interval_s: float = 0.25,
    ) -> None:
        self.tenants = TenantsFile(tenants_file)  # raises TenantsError for a bad file
        self.tenant_header = tenant_header.lower() if tenant_header else None
        self.default_max_tokens = default_max_tokens
        self.metrics = FlowMetrics(registry)
        self.saturation = Saturation(
            healthy_backends,
            interval_s=scrape_interval_s,
            on_change=self._on_engines_read,
            pool=lambda: self.tenants.current().pool,
        )
        self.controller = FlowController(self.tenants.current, self, self.metrics)

    async def start(self, fetch: Optional[Fetch] = None) -> None:
        """Starts reading the engines' metrics through `fetch` (None: the router's pending
        view alone)."""
        self.saturation.fetch = fetch
        await self.saturation.start()

    async def stop(self) -> None:
        await self.saturation.stop()

    # The controller's view of saturation (flow_control.SaturationView), metered.
    def level(self, admitted: int, pool: PoolLimits) -> int:
        level = self.saturation.level(admitted, pool)
        self.metrics.saturated.set(level)
        return level

    def bound(self, pool: PoolLimits) -> int:
        return self.saturation.bound(pool)

    def starting_bound(self, pool: PoolLimits) -> int:
        return self.saturation.starting_bound(pool)

    def _on_engines_read(self) -> None:
        self.metrics.concurrency_limit.set(self.saturation.bound(self.tenants.current().pool))
        self.controller.dispatch()  # a drained engine or a grown limit frees queued requests

    def tenant(self, headers: dict[str, str]) -> Optional[Tenant]:
        """The request's tenant (header names lower-case): by the operator's tenant header
        when one is named, else by its API key; None when there is none."""
        config = self.tenants.current()
        if self.tenant_header is not None:
            name = headers.get(self.tenant_header)
            return config.tenants.get(name.strip()) if name else None
        return config.tenant_for_key(presented_key(headers))

    def request(self, tenant: Tenant, headers: dict[str, str], body: Any) -> FlowRequest:
        priority = self.tenants.current().priority_of(tenant, headers)
        return FlowRequest(tenant, priority, estimate_tokens(body, self.default_max_tokens))

    def engine_priority(self, tenant: Tenant, headers: dict[str, str]) -> int:
        """The request's band as the `priority` the front-end writes into its body, for the
        engines of both legs to schedule by (tenants.engine_priority)."""
        return engine_priority(self.tenants.current().priority_of(tenant, headers))

    async def acquire(self, tenant: Tenant, headers: dict[str, str], body: Any) -> Slot:
        """`admit` without the block: the slot, to `release()` when the request is over."""
        return await self.controller.acquire(self.request(tenant, headers, body))

    @contextlib.asynccontextmanager
    async def admit(
        self, tenant: Tenant, headers: dict[str, str], body: Any
    ) -> AsyncIterator[Slot]:
        """Waits for the request's turn (Shed when it cannot have one) and holds its slot
        until the block ends; a cancelled wait (the client left) leaves the queue at once.
        `slot.release(used_tokens)` inside the block corrects the token estimate;
        `slot.started()` when the answer's first byte comes (the starting bound)."""
        slot = await self.acquire(tenant, headers, body)
        try:
            yield slot
        finally:
            slot.release()


def shed_body(shed: Shed) -> tuple[str, str, dict[str, str]]:
    """(message, code, headers) of the 429 a front-end answers for `shed`."""
    return shed.message, shed.reason, {"retry-after": str(shed.retry_after_s)}
