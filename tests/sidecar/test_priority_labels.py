"""Metric series stay as few as the configuration makes them, whatever clients send: a
request's priority band is one the tenants file names (flow/tenants.py), so distinct
x-pdpool-priority values (admitted or shed) add no series to the gateway's or the picker's
/metrics, and a malformed value is the tenant's own band at both."""

from __future__ import annotations

import asyncio
import json
import re

import httpx

from pdpool.sidecar.epp import protocol
from pdpool.sidecar.epp.exchange import Exchange
from pdpool.sidecar.epp.server import EndpointPicker, EppSettings
from pdpool.sidecar.gateway.app import Gateway, GatewaySettings
from pdpool.sidecar.proxy.app import Sidecar
from pdpool.sidecar.proxy.settings import SidecarSettings
from pdpool.sidecar.flow.tenants import PRIORITY_HEADER

from tests.support.vllm_standin import VllmStandIn

ext = protocol.ext
KEY = "tenant-a-key-0123456789"
# Bands 0 and 2; 40 prompt characters + 2 tokens: 12 a request, so most are shed.
TENANTS = f"tenants: [{{name: a, keys: ['{KEY}'], maxPriority: 2, tokensPerMinute: 60}}]\n"
BODY = {"prompt": "x" * 40, "max_tokens": 2}
# Distinct values a client might send: numbers off the bands, far off, malformed, long.
ASKED = [str(-n) for n in range(1, 41)] + [str(n) for n in range(3, 13)]
ASKED += ["1e3", "1_0", "\u0663", "high", "7" * 30, "z" * 2000]


def bands_in(metrics: str) -> set[str]:
    return set(re.findall(r'band="([^"]*)"', metrics))


async def test_the_gateway_s_series_stay_within_the_named_bands(servers, tmp_path):
    engine = VllmStandIn("decode-0")
    e = await servers(engine)
    side = await servers(Sidecar(SidecarSettings(decode_url=e.url, mode="aggregated")))
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS)
    gw = await servers(
        Gateway(GatewaySettings(decode_urls=[side.host_port], tenants_file=str(tenants)))
    )
    async with httpx.AsyncClient(timeout=30) as c:
        auth = {"authorization": f"Bearer {KEY}"}
        before = len((await c.get(gw.url + "/metrics")).text)
        answers = await asyncio.gather(
            *(
                c.post(
                    gw.url + "/v1/completions",
                    json=BODY,
                    headers={**auth, PRIORITY_HEADER: p.encode()},
                )
                for p in ASKED
            )
        )
        metrics = (await c.get(gw.url + "/metrics")).text
    statuses = {a.status_code for a in answers}
    assert statuses == {200, 429}  # admitted and shed alike
    assert bands_in(metrics) == {"0", "2"}
    assert len(metrics) < before + 20_000


async def test_the_picker_s_series_stay_within_the_named_bands(tmp_path):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS.replace("tokensPerMinute: 60", "tokensPerMinute: 0"))
    picker = EndpointPicker(EppSettings(decode_urls=["127.0.0.1:1"], tenants_file=str(tenants)))
    for asked in ASKED:
        ex = Exchange(picker)
        values = {
            ":path": "/v1/completions",
            ":method": "POST",
            "authorization": f"Bearer {KEY}",
            PRIORITY_HEADER: asked,
        }
        headers = [ext.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
        start = ext.HttpHeaders(headers=ext.HeaderMap(headers=headers))
        await ex.handle(ext.ProcessingRequest(request_headers=start))
        body = ext.HttpBody(body=json.dumps(BODY).encode(), end_of_stream=True)
        routed = await ex.handle(ext.ProcessingRequest(request_body=body))
        assert routed[0].WhichOneof("response") == "request_headers"
        ex.close()
    assert bands_in(picker.metrics.render().decode()) == {"0", "2"}
