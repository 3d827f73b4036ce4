"""The sidecar's /ready reflects its engine's readiness and the gateway routes by it.

The engine here is a stand-in for *our* engine's probe routes only (a labelled fake: /health
answers 200, /ready answers what the test sets), so that a wedged engine, alive but not
ready, can be shown; the sidecar and gateway are the real ones."""

from __future__ import annotations

import httpx

from pdpool.sidecar.gateway.app import Gateway, GatewaySettings
from pdpool.sidecar.proxy.app import Sidecar
from pdpool.sidecar.proxy.settings import SidecarSettings
from tests.support.vllm_standin import answer_lifespan, send_json


class ProbeStandIn:
    def __init__(self) -> None:
        self.ready = True

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await answer_lifespan(receive, send)
        status = {"/health": 200, "/ready": 200 if self.ready else 503}.get(scope["path"], 404)
        await send_json(send, status, {"status": status})


async def test_sidecar_ready_follows_engine_and_gateway_routes_by_it(servers):
    engine = ProbeStandIn()
    eng = await servers(engine)
    side = await servers(Sidecar(SidecarSettings(decode_url=eng.url, mode="aggregated")))
    gateway = Gateway(
        GatewaySettings(decode_urls=[side.host_port], health_interval_s=60, ejection_s=0.0)
    )
    gw = await servers(gateway)
    async with httpx.AsyncClient() as c:
        assert (await c.get(side.url + "/ready")).status_code == 200
        assert (await c.get(gw.url + "/ready")).status_code == 200
        engine.ready = False  # alive, but its loop is wedged
        assert (await c.get(side.url + "/health")).status_code == 200
        r = await c.get(side.url + "/ready")
        assert r.status_code == 503 and r.json()["error"]["code"] == "decode_unhealthy"
        await gateway.check_health()
        assert side.host_port in gateway.routing.unhealthy
        assert (await c.get(gw.url + "/ready")).status_code == 503
        engine.ready = True
        await gateway.check_health()
        assert side.host_port not in gateway.routing.unhealthy
        assert (await c.get(gw.url + "/ready")).status_code == 200
