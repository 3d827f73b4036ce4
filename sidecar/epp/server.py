"""`pdpool epp`: the Gateway API Inference Extension endpoint picker, an Envoy ext_proc gRPC
server over the same routing core as our HTTP gateway (sidecar/routing/core.py).

Any GIE gateway (Envoy Gateway, kgateway, Istio, GKE, or plain Envoy as `pdpool up
--gateway envoy` runs it) asks it, per request, which decode sidecar serves; the sidecar
then runs the P/D flow itself (decode-first, prefill legs, KV leases). The picker serves
gRPC on --port (ext_proc and the standard health service; the health service also on
--health-port) and HTTP /health and /metrics on --metrics-port, as GIE's pickers do."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Histogram

from pdpool.body_budget import BodyBudget

from ..net.asgi import Receive, Scope, Send, send_bytes, send_error, serve_lifespan
from ..routing.backends import Backends
from ..net.metrics import CONTENT_TYPE_LATEST, GatewayMetrics
from ..flow.admission import FlowControl, Shed, Slot
from ..routing.core import Routing
from ..routing.model_rewrite import ModelRewrites, counted_rewrites
from . import envoy_api as ext
from . import protocol
from .exchange import Exchange
from .settings import EppSettings

log = logging.getLogger("pdpool.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


@dataclass(frozen=True)
class Pick:
    """The endpoint for a request (None: nothing can serve it, `reason` says why) and the
    P/D path the decode sidecar is told (None: its own decode-first decision)."""

    endpoint: Optional[str]
    pd_path: Optional[str] = None
    reason: str = ""


class EndpointPicker:
    def __init__(self, settings: EppSettings) -> None:
        self.settings = settings
        self.metrics = GatewayMetrics()
        self.bodies = BodyBudget(settings.max_body_bytes_in_flight)
        self.routing = Routing(settings, self.metrics)
        self.decision_seconds = Histogram(
            "pdpool_epp_decision_seconds",
            "From a request's headers reaching the picker to its routed answer",
            buckets=(
                *(0.00025 * i for i in range(1, 9)),  # 0.25 ms steps up to 2 ms
                0.003,
                0.004,
                0.005,
                0.0075,
                0.01,
                0.015,
                0.02,
                0.03,
                0.05,
                0.1,
                0.25,
                1.0,
            ),
            registry=self.metrics.registry,
        )
        self.sidecars = Backends(
            settings.tls_ca_file, settings.tls_any_name, settings.probe_timeout_s
        )
        # GIE's InferenceModelRewrite rules: the model replaced before routing (None: off).
        self.rewrites: Optional[ModelRewrites] = (
            counted_rewrites(settings.model_rewrites_file, self.metrics.registry)
            if settings.model_rewrites_file
            else None
        )
        self.grpc_server: Optional[grpc.aio.Server] = None
        self.health = health.aio.HealthServicer()
        # Flow control (flow/admission.py, as in the gateway); None: off.
        self.flow = (
            FlowControl(
                settings.tenants_file,
                settings.tenant_header,
                self.routing.healthy_backends,
                self.metrics.registry,
            )
            if settings.tenants_file
            else None
        )
        # A client's API key names its tenant and goes no further than the picker (as in
        # the gateway); behind another gateway that names tenants by header, it is kept.
        self.client_key_headers: tuple[str, ...] = (
            ("authorization", "x-api-key")
            if self.flow is not None and self.flow.tenant_header is None
            else ()
        )

    # ------------------------------------------------------------------ lifecycle
    async def startup(self) -> None:
        s = self.settings
        await self.sidecars.start(
            self.routing, self.flow, self.metrics, s.connect_timeout, s.kv_tokenize_timeout_s
        )
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((ext.ext_proc_handler(_Servicer(self).Process),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        ports = {self.settings.grpc_port, self.settings.health_port} - {None}
        for port in ports:
            address = f"{self.settings.grpc_host}:{port}"
            if server.add_insecure_port(address) == 0:
                raise OSError(f"cannot listen for gRPC on {address}")
        await server.start()
        for service in ("", EXT_PROC_SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.grpc_server = server

    async def shutdown(self) -> None:
        if self.grpc_server is not None:
            await self.health.enter_graceful_shutdown()
            await self.grpc_server.stop(grace=2.0)
        if self.flow is not None:
            await self.flow.stop()
        await self.routing.stop()
        await self.sidecars.stop()

    # ------------------------------------------------------------------ decisions
    async def admit(self, body: Optional[Any], headers: dict[str, str]) -> Optional[Any]:
        """Admission, before routing: None admits the request, a flow-control `Slot` admits
        it and is held until its exchange ends, anything else is the answer that refuses
        it (401 without a tenant, 429 with Retry-After for one shed). Without a tenants file
        every request is admitted; a cancelled wait (the stream ended) leaves its queue."""
        if self.flow is None:
            return None
        tenant = self.flow.tenant(headers)
        if tenant is None:
            return protocol.immediate(
                401, "a valid API key is required (Authorization: Bearer <key>)", "invalid_api_key"
            )
        if body is None:  # not a generation: nothing to queue
            return None
        try:
            slot: Slot = await self.flow.acquire(tenant, headers, body)
        except Shed as shed:
            return protocol.too_many_requests(shed)
        return slot

    def engine_priority(self, headers: dict[str, str]) -> Optional[int]:
        """The admitted request's band as the engines' `priority` (None without flow
        control: the body goes on as the client sent it)."""
        tenant = self.flow.tenant(headers) if self.flow is not None else None
        if tenant is None:
            return None
        assert self.flow is not None
        return self.flow.engine_priority(tenant, headers)

    async def pick(
        self, body: Optional[Any], headers: dict[str, str], allowed: Optional[Iterable[str]]
    ) -> Pick:
        """The routing core's choice among the endpoints the gateway allows, healthy first."""
        route = await self.routing.route(body, headers)
        order = protocol.restrict(route.order, allowed)
        fit = [b for b in order if self.routing.healthy(b)]
        if fit:
            pd_path = route.pd_path if fit[0] == route.order[0] else None
            return Pick(fit[0], pd_path)
        if not route.order:
            return Pick(None, reason="no decode sidecar is known")
        if allowed is not None and not order:
            return Pick(None, reason="no decode sidecar in the gateway's subset is known")
        return Pick(None, reason="no healthy decode sidecar can take the request")

    def count(self, endpoint: str, status: int) -> None:
        self.metrics.requests.labels(endpoint, str(status)).inc()

    def observe_decision(self, seconds: float) -> None:
        self.decision_seconds.observe(seconds)

    # ------------------------------------------------------------------ HTTP (health, metrics)
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await serve_lifespan(receive, send, self.startup, self.shutdown)
        if scope["type"] != "http":
            return
        if scope["path"] == "/metrics":
            return await send_bytes(
                send, 200, self.metrics.render(), content_type=CONTENT_TYPE_LATEST
            )
        if scope["path"] in ("/health", "/ready"):
            healthy = self.routing.healthy_backends()
            if healthy:
                return await send_bytes(send, 200, json.dumps({"healthy": healthy}).encode())
            return await send_error(send, 503, "no healthy decode sidecar")
        await send_error(send, 404, f"no route {scope['path']} (ext_proc is served over gRPC)")


class _Servicer:
    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker

    async def Process(
        self, request_iterator: AsyncIterator[Any], context: Any
    ) -> AsyncIterator[Any]:
        exchange = Exchange(self.picker)
        try:
            async for request in request_iterator:
                for answer in await exchange.handle(request):
                    yield answer
                    if answer.HasField("immediate_response"):
                        return
        finally:
            exchange.close()
