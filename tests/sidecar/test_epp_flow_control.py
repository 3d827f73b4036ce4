"""Flow control in `pdpool epp`: the same admission as the gateway (flow/admission.py),
driven through the picker's real ext_proc exchange with Envoy's messages (no Envoy, no
sockets: the routed answers are checked, nothing is sent)."""

from __future__ import annotations

import asyncio

from pdpool.sidecar.epp import protocol
from pdpool.sidecar.epp.exchange import Exchange
from pdpool.sidecar.epp.server import EndpointPicker, EppSettings

ext = protocol.ext
KEY = "tenant-a-key-0123456789"


def request_headers(key: str) -> object:
    values = {":path": "/v1/completions", ":method": "POST", "authorization": f"Bearer {key}"}
    return ext.ProcessingRequest(
        request_headers=ext.HttpHeaders(
            headers=ext.HeaderMap(
                headers=[ext.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
            )
        )
    )


def request_body() -> object:
    body = b'{"prompt": "hello", "max_tokens": 2}'
    return ext.ProcessingRequest(request_body=ext.HttpBody(body=body, end_of_stream=True))


async def exchange(picker: EndpointPicker, key: str = KEY) -> list:
    ex = Exchange(picker)
    await ex.handle(request_headers(key))
    return [ex, await ex.handle(request_body())]


async def test_the_picker_queues_sheds_and_releases_like_the_gateway(tmp_path):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(
        f"tenants: [{{name: a, keys: ['{KEY}'], maxQueued: 1, queueTimeoutSeconds: 30}}]\n"
        "pool: {maxInFlightPerBackend: 1}\n"
    )
    picker = EndpointPicker(EppSettings(decode_urls=["127.0.0.1:1"], tenants_file=str(tenants)))
    flow = picker.flow
    first, answers = await exchange(picker)
    assert answers[0].WhichOneof("response") == "request_headers"  # routed: admitted
    # The client's key named its tenant; it goes no further (Envoy removes it).
    removed = answers[0].request_headers.response.header_mutation.remove_headers
    assert {"authorization", "x-api-key"} <= set(removed)
    assert flow.controller.admitted == 1
    second = Exchange(picker)
    await second.handle(request_headers(KEY))
    waiting = asyncio.ensure_future(second.handle(request_body()))
    await asyncio.sleep(0.05)
    assert not waiting.done() and flow.controller.queue_length("a") == 1
    _, shed = await exchange(picker)  # a's queue holds one: 429 with Retry-After
    reply = shed[0].immediate_response
    assert reply.status.code == 429
    assert any(h.header.key == "retry-after" for h in reply.headers.set_headers)
    _, refused = await exchange(picker, key="not-a-tenant-key-0000")
    assert refused[0].immediate_response.status.code == 401
    first.close()  # the first stream ends: its slot goes to the waiting one
    routed = await asyncio.wait_for(waiting, 5)
    assert routed[0].WhichOneof("response") == "request_headers"
    third = Exchange(picker)
    await third.handle(request_headers(KEY))
    leaving = asyncio.ensure_future(third.handle(request_body()))
    await asyncio.sleep(0.05)
    assert flow.controller.queue_length("a") == 1
    leaving.cancel()  # Envoy ended the stream (the client left) while it waited
    await asyncio.sleep(0.05)
    assert flow.controller.queue_length("a") == 0
    second.close()
    assert flow.controller.admitted == 0


async def test_without_flow_control_the_client_key_is_forwarded():
    picker = EndpointPicker(EppSettings(decode_urls=["127.0.0.1:1"]))
    _, answers = await exchange(picker)
    removed = answers[0].request_headers.response.header_mutation.remove_headers
    assert "authorization" not in removed


def response_headers(status: str) -> object:
    headers = ext.HeaderMap(headers=[ext.HeaderValue(key=":status", raw_value=status.encode())])
    return ext.ProcessingRequest(response_headers=ext.HttpHeaders(headers=headers))


async def test_messages_out_of_order_are_refused_and_take_no_slot(tmp_path):
    """A client of the picker's port is not always Envoy: headers again after the request
    was routed would route it again, and each routing took a slot nothing released."""
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(
        f"tenants: [{{name: a, keys: ['{KEY}']}}]\npool: {{maxInFlightPerBackend: 4}}\n"
    )
    picker = EndpointPicker(EppSettings(decode_urls=["127.0.0.1:1"], tenants_file=str(tenants)))
    admitted = picker.flow.controller
    ex, answers = await exchange(picker)
    assert answers[0].WhichOneof("response") == "request_headers" and admitted.admitted == 1
    again = request_headers(KEY)
    again.request_headers.end_of_stream = True
    for message in (again, request_body()):
        refused = (await ex.handle(message))[0].immediate_response
        assert refused.status.code == 400 and b"out of order" in refused.body
    assert admitted.admitted == 1
    # A status that is no number is no reason to fail the stream.
    for status in ("abc", "9" * 5000, "\u00b2\u00b2\u00b2"):
        assert (await ex.handle(response_headers(status)))[0].WhichOneof("response")
    ex.close()
    assert admitted.admitted == 0
    # A body before any headers names no route: refused, not routed as a request without one.
    early = Exchange(picker)
    refused = (await early.handle(request_body()))[0].immediate_response
    assert refused.status.code == 400
    early.close()
    assert admitted.admitted == 0
