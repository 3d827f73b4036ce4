"""A tenant's priority band reaches the engines of both legs of a P/D request as their
`priority` field (engine priority = -band: tenants.engine_priority), whatever the client
wrote there: through our gateway and the sidecar's prefill and decode legs (recording
stand-in engines), and through the endpoint picker's body mutation. Without flow control
the client's own `priority` goes on untouched."""

from __future__ import annotations

import json

import httpx
import pytest

from pdpool.sidecar.epp import protocol
from pdpool.sidecar.epp.exchange import Exchange
from pdpool.sidecar.epp.server import EndpointPicker, EppSettings
from pdpool.sidecar.gateway.app import Gateway, GatewaySettings
from pdpool.sidecar.proxy.app import Sidecar
from pdpool.sidecar.proxy.settings import SidecarSettings
from pdpool.sidecar.flow.tenants import engine_priority

from tests.support.vllm_standin import VllmStandIn

ext = protocol.ext
GOLD, BATCH = "gold-key-0123456789abcdef", "batch-key-0123456789abcdef"
TENANTS = f"""
tenants:
  - {{name: gold, keys: ['{GOLD}'], priority: 10}}
  - {{name: batch, keys: ['{BATCH}'], priority: -1}}
"""
LONG = " ".join(f"w{i}" for i in range(200))


def test_engine_priority_is_the_negated_band():
    assert [engine_priority(b) for b in (10, 0, -1)] == [-10, 0, 1]


async def pd_stack(servers, tmp_path, tenants: bool = True):
    decode, prefill = VllmStandIn("decode-0"), VllmStandIn("prefill-0")
    dec = await servers(decode)
    pre = await servers(prefill)
    prefill.state.port = pre.port
    side = await servers(
        Sidecar(
            SidecarSettings(decode_url=dec.url, prefill_urls=[pre.host_port], mode="prefill-first")
        )
    )
    extra = {}
    if tenants:
        (tmp_path / "tenants.yaml").write_text(TENANTS)
        extra["tenants_file"] = str(tmp_path / "tenants.yaml")
    gw = await servers(Gateway(GatewaySettings(decode_urls=[side.host_port], **extra)))
    return gw, decode, prefill


@pytest.mark.parametrize("stream", [False, True])
async def test_the_band_reaches_the_prefill_and_the_decode_leg(servers, tmp_path, stream):
    gw, decode, prefill = await pd_stack(servers, tmp_path)
    async with httpx.AsyncClient(timeout=30) as c:
        for key, asked in ((GOLD, None), (BATCH, -100)):  # batch cannot jump the line
            body = {"prompt": LONG, "max_tokens": 3, "stream": stream}
            if asked is not None:
                body["priority"] = asked
            r = await c.post(
                gw.url + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}
            )
            assert r.status_code == 200, r.text
            assert r.headers["x-pdpool-path"] == "pd"
    prefill_legs = [b for _, b, _ in prefill.state.received]
    decode_legs = [b for _, b, _ in decode.state.received]
    assert [b["kv_transfer_params"]["do_remote_decode"] for b in prefill_legs] == [True, True]
    assert all(b.get("kv_transfer_params") for b in decode_legs)
    assert [b["priority"] for b in prefill_legs] == [-10, 1]
    assert [b["priority"] for b in decode_legs] == [-10, 1]


async def test_without_flow_control_the_clients_priority_goes_on(servers, tmp_path):
    gw, decode, prefill = await pd_stack(servers, tmp_path, tenants=False)
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(
            gw.url + "/v1/completions", json={"prompt": LONG, "max_tokens": 3, "priority": 3}
        )
    assert r.status_code == 200, r.text
    assert [b["priority"] for _, b, _ in prefill.state.received] == [3]
    assert [b["priority"] for _, b, _ in decode.state.received] == [3]


def _headers(**values: str) -> object:
    return ext.HttpHeaders(
        headers=ext.HeaderMap(
            headers=[ext.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
        )
    )


async def test_the_picker_writes_the_band_into_the_body(tmp_path):
    (tmp_path / "tenants.yaml").write_text(TENANTS)
    picker = EndpointPicker(
        EppSettings(decode_urls=["127.0.0.1:1"], tenants_file=str(tmp_path / "tenants.yaml"))
    )
    sent = []
    for key in (GOLD, BATCH):
        ex = Exchange(picker)
        start = {":path": "/v1/completions", ":method": "POST", "authorization": f"Bearer {key}"}
        await ex.handle(ext.ProcessingRequest(request_headers=_headers(**start)))
        raw = json.dumps({"prompt": "hello", "max_tokens": 2, "priority": -100}).encode()
        answers = await ex.handle(
            ext.ProcessingRequest(request_body=ext.HttpBody(body=raw, end_of_stream=True))
        )
        assert answers[0].WhichOneof("response") == "request_headers"
        body = b"".join(
            a.request_body.response.body_mutation.streamed_response.body for a in answers[1:]
        )
        mutation = answers[0].request_headers.response.header_mutation
        length = [
            h.header.raw_value for h in mutation.set_headers if h.header.key == "content-length"
        ]
        assert length == [str(len(body)).encode()]  # Envoy sends the rewritten body's length
        sent.append(json.loads(body)["priority"])
        ex.close()
    assert sent == [-10, 1]
