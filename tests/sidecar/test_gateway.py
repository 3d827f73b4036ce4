"""The gateway in front of real sidecars (which front stand-in vLLM engines, a labelled fake)."""

from __future__ import annotations

import asyncio

import httpx

from pdpool.ports import free_port
from pdpool.sidecar.gateway.app import Gateway, GatewaySettings
from pdpool.sidecar.proxy.app import Sidecar
from pdpool.sidecar.proxy.settings import SidecarSettings

from tests.support.vllm_standin import VllmStandIn


async def backends(servers, n):
    out = []
    for i in range(n):
        engine = VllmStandIn(f"decode-{i}")
        e = await servers(engine)
        side = await servers(
            Sidecar(SidecarSettings(decode_url=e.url, mode="aggregated", decode_retry_s=0.2))
        )
        out.append((engine, side))
    return out


def conversation(i, turns):
    msgs = [{"role": "system", "content": f"conversation {i} " + "context " * 60}]
    for t in range(turns):
        msgs += [
            {"role": "user", "content": f"question {t}"},
            {"role": "assistant", "content": f"answer {t}"},
        ]
    return [*msgs, {"role": "user", "content": "next"}]


async def test_conversations_stick_to_one_sidecar_and_spread_across_them(servers):
    pool = await backends(servers, 3)
    gw = await servers(Gateway(GatewaySettings(decode_urls=[s.host_port for _, s in pool])))
    async with httpx.AsyncClient() as c:
        for i in range(12):
            for turn in range(3):
                r = await c.post(
                    gw.url + "/v1/chat/completions",
                    json={"messages": conversation(i, turn), "max_tokens": 2},
                )
                assert r.status_code == 200
        stream = await c.post(
            gw.url + "/v1/chat/completions",
            json={"messages": conversation(0, 3), "max_tokens": 3, "stream": True},
        )
        metrics = (await c.get(gw.url + "/metrics")).text
    homes = {}
    for engine, _ in pool:
        for _, body, _ in engine.state.received:
            conv = body["messages"][0]["content"].split()[1]
            homes.setdefault(conv, set()).add(engine.state.name)
    assert all(len(h) == 1 for h in homes.values())
    assert len({next(iter(h)) for h in homes.values()}) >= 2
    assert stream.text.rstrip().endswith("data: [DONE]")
    assert 'pdpool_gateway_affinity_total{decision="preferred"} 37.0' in metrics


async def test_dead_sidecar_is_retried_elsewhere_and_marked_unhealthy(servers):
    pool = await backends(servers, 1)
    dead = f"127.0.0.1:{free_port()}"
    gateway = Gateway(
        GatewaySettings(decode_urls=[dead, pool[0][1].host_port], health_interval_s=60)
    )
    gw = await servers(gateway)
    assert dead in gateway.routing.unhealthy  # the first health check already saw it
    gateway.routing.unhealthy.clear()  # pretend it just died after the check
    # Prompts go where their prefix hashes (the dead port is random): send distinct ones
    # until one was routed to the dead sidecar first (about every other one).
    rs = []
    async with httpx.AsyncClient() as c:
        while dead not in gateway.routing.unhealthy and len(rs) < 40:
            body = {"prompt": f"p{len(rs)} " * 80, "max_tokens": 1}
            rs.append(await c.post(gw.url + "/v1/completions", json=body))
        health = await c.get(gw.url + "/health")
        metrics = (await c.get(gw.url + "/metrics")).text
    assert dead in gateway.routing.unhealthy and health.status_code == 200
    assert all(r.status_code == 200 for r in rs)
    assert len(pool[0][0].state.received) == len(rs)
    assert "pdpool_gateway_retries_total" in metrics


async def test_sidecar_whose_engine_is_down_is_skipped(servers):
    pool = await backends(servers, 2)
    gateway = Gateway(
        GatewaySettings(decode_urls=[s.host_port for _, s in pool], health_interval_s=60)
    )
    gw = await servers(gateway)
    # stop engine 0: its sidecar answers 503 and the gateway tries the other one
    down_engine_url = pool[0][1].app.settings.decode_url
    pool[0][1].app.settings.decode_url = "http://127.0.0.1:9"
    async with httpx.AsyncClient() as c:
        rs = await asyncio.gather(
            *(
                c.post(gw.url + "/v1/completions", json={"prompt": f"q{i} " * 80, "max_tokens": 1})
                for i in range(8)
            )
        )
        await gateway.check_health()
        pool[0][1].app.settings.decode_url = down_engine_url
    assert all(r.status_code == 200 for r in rs)
    assert len(pool[1][0].state.received) == 8
    assert pool[0][1].host_port in gateway.routing.unhealthy


async def test_no_backend_reachable_is_an_openai_503(servers):
    dead = f"127.0.0.1:{free_port()}"
    gw = await servers(Gateway(GatewaySettings(decode_urls=[dead])))
    async with httpx.AsyncClient() as c:
        r = await c.post(gw.url + "/v1/completions", json={"prompt": "x"})
        h = await c.get(gw.url + "/health")
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
    assert h.status_code == 503
