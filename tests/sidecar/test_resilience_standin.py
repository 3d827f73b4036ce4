"""Sick engines against stand-in vLLM engines (a labelled fake, see vllm_standin.py) and
real sidecars and gateway: a frozen prefill endpoint (accepts connections, never answers:
what a SIGSTOPped engine does) is ejected; a stream whose decode engine dies mid-way is
continued elsewhere by the gateway, exactly."""

from __future__ import annotations

import asyncio
import time

import json

import httpx
import pytest

from pdpool.sidecar.gateway.app import Gateway, GatewaySettings
from pdpool.sidecar.proxy.app import Sidecar
from pdpool.sidecar.proxy.settings import SidecarSettings

from tests.support.vllm_standin import VllmStandIn, greedy_output, prompt_words

HISTORY = " ".join(f"h{i}" for i in range(40))


async def frozen_endpoint():
    """A listening socket whose connections are accepted and never answered."""
    held = []

    async def hold(reader, writer):
        held.append(writer)
        await asyncio.sleep(3600)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_frozen_prefill_engine_is_ejected_and_its_request_moves_on(servers):
    server, frozen = await frozen_endpoint()
    decode, prefill = VllmStandIn("decode-0"), VllmStandIn("prefill-1")
    dec, pre = await servers(decode), await servers(prefill)
    decode.state.port, prefill.state.port = dec.port, pre.port
    sidecar = Sidecar(
        SidecarSettings(
            decode_url=dec.url,
            prefill_urls=[frozen, pre.host_port],
            cache_hit_threshold=0.5,
            prefill_timeout=30,
            probe_interval_s=0.2,
            probe_timeout_s=0.2,
            ejection_s=0.5,
        )
    )
    side = await servers(sidecar)
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            t0 = time.monotonic()
            r = await c.post(
                side.url + "/v1/completions",
                json={"prompt": HISTORY, "max_tokens": 2},
                headers={"x-prefiller-host-port": frozen},
            )
            took = time.monotonic() - t0
            assert r.status_code == 200 and r.headers["x-pdpool-path"] == "pd"
            assert r.headers["x-pdpool-prefill-endpoint"] == pre.host_port
            assert took < 3, took  # not the 30 s prefill timeout
            assert sidecar.outliers.is_ejected(frozen)
            t0 = time.monotonic()
            r = await c.post(
                side.url + "/v1/completions",
                json={"prompt": "again " + HISTORY, "max_tokens": 2},
                headers={"x-prefiller-host-port": frozen},
            )
            assert r.status_code == 200 and time.monotonic() - t0 < 1
            metrics = (await c.get(side.url + "/metrics")).text
        assert (
            f'pdpool_sidecar_prefill_ejections_total{{endpoint="{frozen}",reason="probe"}} 1.0'
            in metrics
        )
        assert f'pdpool_sidecar_prefill_ejected{{endpoint="{frozen}"}} 1.0' in metrics
        assert 'pdpool_sidecar_prefill_attempts_total{outcome="ejected"} 1.0' in metrics
    finally:
        server.close()


async def test_failing_prefill_engine_is_ejected_after_consecutive_failures(servers):
    decode, p0, p1 = VllmStandIn("decode-0"), VllmStandIn("prefill-0"), VllmStandIn("prefill-1")
    dec, s0, s1 = await servers(decode), await servers(p0), await servers(p1)
    for engine, served in ((decode, dec), (p0, s0), (p1, s1)):
        engine.state.port = served.port
    p0.state.fail_status = 500
    sidecar = Sidecar(
        SidecarSettings(
            decode_url=dec.url,
            prefill_urls=[s0.host_port, s1.host_port],
            cache_hit_threshold=0.5,
            probe_interval_s=0,
            outlier_failures=2,
            ejection_s=60,
        )
    )
    side = await servers(sidecar)
    async with httpx.AsyncClient(timeout=30) as c:
        for i in range(6):
            r = await c.post(
                side.url + "/v1/completions", json={"prompt": f"q{i} {HISTORY}", "max_tokens": 2}
            )
            assert r.status_code == 200 and r.headers["x-pdpool-path"] == "pd"
    assert sidecar.outliers.is_ejected(s0.host_port)
    assert len(p0.state.received) == 2  # then never tried again


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_stream_whose_decode_engine_dies_goes_on_elsewhere(servers, route):
    pool = []
    for i in range(2):
        engine = VllmStandIn(f"decode-{i}")
        e = await servers(engine)
        engine.state.token_delay_s = 0.005
        engine.state.die_after_tokens = 5  # each engine dies once, 5 tokens into a stream
        side = await servers(
            Sidecar(SidecarSettings(decode_url=e.url, mode="aggregated", decode_retry_s=0.2))
        )
        pool.append((engine, side))
    gateway = Gateway(
        GatewaySettings(decode_urls=[s.host_port for _, s in pool], health_interval_s=60)
    )
    gw = await servers(gateway)
    chat = route.endswith("chat/completions")
    body = {"max_tokens": 20, "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": "tell me " + HISTORY}]
    else:
        body["prompt"] = "tell me " + HISTORY
    words = prompt_words(route, body)
    text, ids, usage = [], set(), None
    async with httpx.AsyncClient(timeout=30) as c:
        async with c.stream("POST", gw.url + route, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                assert "error" not in data and "prompt_token_ids" not in data
                ids.add(data["id"])
                assert data["object"] == ("chat.completion.chunk" if chat else "text_completion")
                usage = data.get("usage") or usage
                for choice in data["choices"]:
                    assert "token_ids" not in choice
                    text.append(choice["delta"].get("content", "") if chat else choice["text"])
        metrics = (await c.get(gw.url + "/metrics")).text
    # Leg 1 died after 5 tokens, its continuation on the other engine after 5 more, the
    # last continuation (back on the first engine) finished: one stream, exact.
    assert "".join(text) == " ".join(greedy_output(words, 20))
    assert len(ids) == 1
    assert usage["prompt_tokens"] == len(words) and usage["completion_tokens"] == 20
    assert 'pdpool_gateway_migrations_total{outcome="ok"} 1.0' in metrics
    continued = [
        b for e, _ in pool for route_, b, _ in e.state.received if isinstance(b.get("prompt"), list)
    ]
    assert sorted(len(b["prompt"]) - len(words) for b in continued) == [5, 10]
    assert sorted(b["max_tokens"] for b in continued) == [10, 15]
