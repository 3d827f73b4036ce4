"""Flow control through the real gateway, in front of a real sidecar and a vLLM stand-in
(tests/support/vllm_standin.py, a fake of that third party): 429 with Retry-After and an
OpenAI error body, a client that leaves its queue, the engine's metrics passed through the
sidecar; and without a tenants file, the gateway as before (no key, no pdpool_flow_*)."""

from __future__ import annotations

import asyncio

import httpx

from pdpool.sidecar.gateway.app import Gateway, GatewaySettings
from pdpool.sidecar.proxy.app import Sidecar
from pdpool.sidecar.proxy.settings import SidecarSettings

from tests.support.vllm_standin import VllmStandIn

KEY_A, KEY_B = "tenant-a-key-0123456789", "tenant-b-key-0123456789"
TENANTS = f"""
tenants:
  - name: a
    keys: ["{KEY_A}"]
    maxQueued: 1
    queueTimeoutSeconds: 0.5
  - name: b
    keys: ["{KEY_B}"]
    priority: 1
pool: {{maxInFlightPerBackend: 1}}
"""
BODY = {"prompt": "hello there " * 4, "max_tokens": 2}


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def metric_lines(c: httpx.AsyncClient, url: str, prefix: str) -> list[str]:
    text = (await c.get(url + "/metrics")).text
    return [line for line in text.splitlines() if line.startswith(prefix)]


async def test_gateway_sheds_with_429_and_retry_after(servers, tmp_path):
    engine = VllmStandIn("decode-0")
    e = await servers(engine)
    side = await servers(Sidecar(SidecarSettings(decode_url=e.url, mode="aggregated")))
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    gw = await servers(
        Gateway(GatewaySettings(decode_urls=[side.host_port], tenants_file=str(path)))
    )
    url = gw.url + "/v1/completions"
    async with httpx.AsyncClient(timeout=30) as c:
        assert (await c.post(url, json=BODY)).json()["error"]["code"] == "invalid_api_key"
        ok = await c.post(url, json=BODY, headers=auth(KEY_A))
        assert ok.status_code == 200 and ok.json()["choices"]
        engine.state.hang = True  # the one slot stays taken
        holder = asyncio.ensure_future(c.post(url, json=BODY, headers=auth(KEY_A)))
        while not engine.state.received or len(engine.state.received) < 2:
            await asyncio.sleep(0.01)
        waiting = asyncio.ensure_future(c.post(url, json=BODY, headers=auth(KEY_A)))
        await asyncio.sleep(0.1)
        full = await c.post(url, json=BODY, headers=auth(KEY_A))  # a's queue holds one
        timed_out = await waiting
        # a client that leaves while queued is gone from its queue at once
        leaving = asyncio.ensure_future(c.post(url, json=BODY, headers=auth(KEY_A)))
        await asyncio.sleep(0.2)
        assert gw.app.flow.controller.queue_length("a") == 1
        leaving.cancel()
        for _ in range(100):
            if gw.app.flow.controller.queue_length("a") == 0:
                break
            await asyncio.sleep(0.02)
        assert gw.app.flow.controller.queue_length("a") == 0
        holder.cancel()
        engine.state.hang = False
        for _ in range(100):  # the holder's slot comes back when its client is gone
            if gw.app.flow.controller.admitted == 0:
                break
            await asyncio.sleep(0.02)
        after = await c.post(url, json=BODY, headers=auth(KEY_B))
        flow = await metric_lines(c, gw.url, "pdpool_flow_")
        engine_metrics = await c.get(side.url + "/metrics/engine")
    for shed, code in ((full, "queue_full"), (timed_out, "queue_timeout")):
        assert shed.status_code == 429, shed.text
        assert int(shed.headers["retry-after"]) >= 1
        error = shed.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == code
        assert error["message"]
    assert after.status_code == 200
    assert 'pdpool_flow_shed_total{band="0",reason="queue_full",tenant="a"} 1.0' in flow
    assert 'pdpool_flow_shed_total{band="0",reason="queue_timeout",tenant="a"} 1.0' in flow
    assert 'pdpool_flow_abandoned_total{band="0",tenant="a"} 1.0' in flow
    assert 'pdpool_flow_admitted_total{band="1",tenant="b"} 1.0' in flow
    assert any(line.startswith("pdpool_flow_queue_wait_seconds_count") for line in flow)
    assert engine_metrics.status_code == 200  # the engine's own, through the sidecar
    assert "vllm:num_requests_waiting" in engine_metrics.text
    sent = [r for r in engine.state.received if r[0] == "/v1/completions"]
    assert len(sent) == 3  # the shed and the abandoned requests never reached the engine


async def test_without_a_tenants_file_nothing_changes(servers):
    engine = VllmStandIn("decode-0")
    e = await servers(engine)
    side = await servers(Sidecar(SidecarSettings(decode_url=e.url, mode="aggregated")))
    gw = await servers(Gateway(GatewaySettings(decode_urls=[side.host_port])))
    assert gw.app.flow is None
    async with httpx.AsyncClient(timeout=30) as c:
        answers = await asyncio.gather(
            *(c.post(gw.url + "/v1/completions", json=BODY) for _ in range(8))
        )
        flow = await metric_lines(c, gw.url, "pdpool_flow_")
    assert [a.status_code for a in answers] == [200] * 8 and flow == []


async def test_the_engines_own_metrics_saturate_the_pool(servers, tmp_path):
    """No in-flight bound: an engine reporting a deep queue (vllm:num_requests_waiting,
    read through the sidecar) holds requests at the gateway until it drains."""
    engine = VllmStandIn("decode-0")
    e = await servers(engine)
    side = await servers(Sidecar(SidecarSettings(decode_url=e.url, mode="aggregated")))
    path = tmp_path / "tenants.yaml"
    path.write_text(
        f"tenants: [{{name: a, keys: ['{KEY_A}']}}]\npool: {{queueDepthThreshold: 4}}\n"
    )
    gw = await servers(
        Gateway(GatewaySettings(decode_urls=[side.host_port], tenants_file=str(path)))
    )
    flow = gw.app.flow
    engine.state.waiting_reported = 9
    async with httpx.AsyncClient(timeout=30) as c:
        for _ in range(100):
            if any(load.waiting == 9 for load in flow.saturation.loads.values()):
                break
            await asyncio.sleep(0.05)
        held = asyncio.ensure_future(
            c.post(gw.url + "/v1/completions", json=BODY, headers=auth(KEY_A))
        )
        await asyncio.sleep(0.6)
        assert not held.done() and flow.controller.queue_length("a") == 1
        engine.state.waiting_reported = 0  # drained: the next scrape releases it
        answer = await asyncio.wait_for(held, 10)
    assert answer.status_code == 200 and flow.controller.queue_length("a") == 0


async def test_tokens_per_minute_counts_the_real_usage_of_whole_answers(servers, tmp_path):
    """The estimate (4 characters a token + max_tokens) is charged at admission, then
    replaced by the answer's usage: the stand-in counts a word a token, so a one-word
    80-character prompt estimated at 22 tokens uses 3, and a second one fits in 30."""
    engine = VllmStandIn("decode-0")
    e = await servers(engine)
    side = await servers(Sidecar(SidecarSettings(decode_url=e.url, mode="aggregated")))
    path = tmp_path / "tenants.yaml"
    path.write_text(f"tenants: [{{name: a, keys: ['{KEY_A}'], tokensPerMinute: 30}}]\n")
    gw = await servers(
        Gateway(GatewaySettings(decode_urls=[side.host_port], tenants_file=str(path)))
    )
    body = {"prompt": "x" * 80, "max_tokens": 2}
    async with httpx.AsyncClient(timeout=30) as c:
        url = gw.url + "/v1/completions"
        first = await c.post(url, json=body, headers=auth(KEY_A))
        second = await c.post(url, json=body, headers=auth(KEY_A))
        streamed = await c.post(url, json={**body, "stream": True}, headers=auth(KEY_A))
        over = await c.post(url, json={**body, "stream": True}, headers=auth(KEY_A))
    assert first.json()["usage"]["total_tokens"] == 3
    assert first.status_code == second.status_code == streamed.status_code == 200
    assert over.status_code == 429 and over.json()["error"]["code"] == "tokens_per_minute"
    assert 1 <= int(over.headers["retry-after"]) <= 60


async def test_unknown_and_huge_tenant_keys_are_refused_and_leave_no_state(servers, tmp_path):
    """Keys are untrusted: a thousand distinct unknown keys, and keys of 8 KiB, are each a
    401, and none of them creates scheduler state or a metric series (a tenant exists only
    in the tenants file, so an attacker cannot grow the gateway's memory or its /metrics)."""
    e = await servers(VllmStandIn("decode-0"))
    side = await servers(Sidecar(SidecarSettings(decode_url=e.url, mode="aggregated")))
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    gw = await servers(
        Gateway(GatewaySettings(decode_urls=[side.host_port], tenants_file=str(path)))
    )
    url = gw.url + "/v1/completions"
    async with httpx.AsyncClient(timeout=30) as c:
        assert (await c.post(url, json=BODY, headers=auth(KEY_A))).status_code == 200
        before = await metric_lines(c, gw.url, "pdpool_flow_")
        keys = [f"unknown-key-{n:08d}-{'x' * 16}" for n in range(1000)]
        keys += ["k" * 8192, KEY_A + "x" * 8000]
        statuses = []
        for chunk in range(0, len(keys), 100):
            answers = await asyncio.gather(
                *(c.post(url, json=BODY, headers=auth(k)) for k in keys[chunk : chunk + 100])
            )
            statuses += [r.status_code for r in answers]
        after = await metric_lines(c, gw.url, "pdpool_flow_")
    assert set(statuses) <= {401, 431} and statuses.count(401) >= 1000
    controller = gw.app.flow.controller
    assert set(controller._tenants) <= {"a", "b"}
    assert controller.admitted == controller.queued == controller.starting == 0
    series = {line.rsplit(" ", 1)[0] for line in after}
    assert series == {line.rsplit(" ", 1)[0] for line in before}  # no new label sets
