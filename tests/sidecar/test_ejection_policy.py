"""Ejection counts only what is the endpoint's fault (routing/outlier.py's endpoint_fault,
one policy under the endpoint picker and the gateway alike): a 500 a request's own body
caused, or a 4xx, never takes an endpoint out; 502/503/504 (an engine unreachable, dead or
too slow) do."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pdpool.sidecar.epp import protocol
from pdpool.sidecar.epp.exchange import Exchange
from pdpool.sidecar.epp.server import EndpointPicker, EppSettings
from pdpool.sidecar.gateway.app import Gateway, GatewaySettings
from pdpool.sidecar.proxy.app import Sidecar
from pdpool.sidecar.proxy.settings import SidecarSettings
from pdpool.sidecar.routing.outlier import endpoint_fault

from tests.support.vllm_standin import VllmStandIn

ext = protocol.ext
SIDECARS = ["127.0.0.1:7001", "127.0.0.1:7002"]
BODY = {"prompt": "hello", "max_tokens": 2}


@pytest.mark.parametrize(
    ("status", "fault"),
    [(s, False) for s in (200, 400, 404, 429, 500, 501)] + [(s, True) for s in (502, 503, 504)],
)
def test_only_the_endpoint_s_own_failures_count(status, fault):
    assert endpoint_fault(status) is fault


def _headers(**values: str) -> object:
    return ext.HttpHeaders(
        headers=ext.HeaderMap(
            headers=[ext.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
        )
    )


async def _answered(picker: EndpointPicker, status: int, only: str | None = None) -> str:
    """One request through the picker's exchange, answered `status` by the sidecar Envoy
    reached (not by Envoy itself); the endpoint it went to."""
    ex = Exchange(picker)
    first = _headers(**{":path": "/v1/completions", ":method": "POST"})
    await ex.handle(ext.ProcessingRequest(request_headers=first))
    last = ext.ProcessingRequest(
        request_body=ext.HttpBody(body=json.dumps(BODY).encode(), end_of_stream=True)
    )
    if only is not None:
        last.metadata_context.filter_metadata[protocol.SUBSET_NAMESPACE].update(
            {protocol.SUBSET_KEY: [only]}
        )
    routed = (await ex.handle(last))[0]
    assert routed.WhichOneof("response") == "request_headers", routed
    endpoint = ex.endpoint
    answer = ext.ProcessingRequest(response_headers=_headers(**{":status": str(status)}))
    answer.attributes[protocol.ATTRIBUTES_NAMESPACE].update(
        {protocol.UPSTREAM_ATTRIBUTE: endpoint, protocol.DETAILS_ATTRIBUTE: "via_upstream"}
    )
    await ex.handle(answer)
    body = b'{"error": {"message": "the request was bad"}}'
    await ex.handle(
        ext.ProcessingRequest(response_body=ext.HttpBody(body=body, end_of_stream=True))
    )
    ex.close()
    return endpoint


async def test_client_caused_500s_do_not_eject_the_pool_behind_envoy():
    picker = EndpointPicker(EppSettings(decode_urls=SIDECARS))
    for status in [500] * 8 + [400, 404] * 4:
        await _answered(picker, status)
    assert picker.routing.healthy_backends() == SIDECARS
    assert await _answered(picker, 200) in SIDECARS  # an innocent request is routed
    # an endpoint whose engine is gone (the sidecar's 503) is still ejected
    for _ in range(3):
        await _answered(picker, 503, only=SIDECARS[0])
    assert picker.routing.healthy_backends() == SIDECARS[1:]


async def test_the_gateway_keeps_a_sidecar_whose_engine_answers_500(servers):
    engines = [VllmStandIn(f"decode-{i}") for i in range(2)]
    sidecars = []
    for engine in engines:
        e = await servers(engine)
        engine.state.fail_status = 500
        sidecars.append(
            await servers(Sidecar(SidecarSettings(decode_url=e.url, mode="aggregated")))
        )
    gw = await servers(Gateway(GatewaySettings(decode_urls=[s.host_port for s in sidecars])))
    async with httpx.AsyncClient(timeout=30) as c:
        url = gw.url + "/v1/completions"
        bad = await asyncio.gather(*(c.post(url, json=BODY) for _ in range(8)))
        for engine in engines:
            engine.state.fail_status = 0
        good = await c.post(url, json=BODY)
    assert [r.status_code for r in bad] == [500] * 8
    assert good.status_code == 200
    assert sorted(gw.app.routing.healthy_backends()) == sorted(s.host_port for s in sidecars)
