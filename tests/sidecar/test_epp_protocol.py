"""The endpoint picker's ext_proc message handling as pure functions (no Envoy, no sockets):
what it reads from Envoy's messages and the answers it builds; and the Envoy bootstrap
`pdpool up --gateway envoy` renders."""

from __future__ import annotations

import json

import pytest

from pdpool.sidecar.epp import protocol
from pdpool.sidecar.flow.admission import Shed
from pdpool.up.envoy_config import envoy_bootstrap

ext = protocol.ext


def _headers(**values: str):
    return ext.HttpHeaders(
        headers=ext.HeaderMap(
            headers=[ext.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
        )
    )


def _subset(value) -> object:
    request = ext.ProcessingRequest()
    request.metadata_context.filter_metadata[protocol.SUBSET_NAMESPACE].update(
        {protocol.SUBSET_KEY: value}
    )
    return request


def _set_headers(mutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def test_routed_headers_name_the_endpoint_in_the_header_and_envoy_lb_metadata():
    answer = protocol.routed_headers(
        "10.0.0.7:8000",
        {"x-pdpool-kv-path": "pd"},
        remove=["x-pdpool-kv-path", "x-other"],
        body_bytes=42,
    )
    common = answer.request_headers.response
    assert common.clear_route_cache
    assert _set_headers(common.header_mutation) == {
        "x-gateway-destination-endpoint": "10.0.0.7:8000",
        "x-pdpool-kv-path": "pd",
        "content-length": "42",
    }
    # A header we set is not also removed; a client's copy of one we own is.
    assert list(common.header_mutation.remove_headers) == ["x-other"]
    meta = answer.dynamic_metadata.fields["envoy.lb"].struct_value
    assert meta.fields["x-gateway-destination-endpoint"].string_value == "10.0.0.7:8000"


@pytest.mark.parametrize("size", [0, 10, protocol.BODY_CHUNK_BYTES, 150_001])
def test_the_request_body_goes_back_byte_for_byte_in_chunks_envoy_accepts(size):
    raw = bytes((i * 7) % 256 for i in range(size))
    answers = protocol.request_body(raw)
    pieces = [a.request_body.response.body_mutation.streamed_response for a in answers]
    assert b"".join(p.body for p in pieces) == raw
    assert all(len(p.body) <= protocol.BODY_CHUNK_BYTES for p in pieces)
    assert [p.end_of_stream for p in pieces] == [False] * (len(pieces) - 1) + [True]


def test_response_chunks_are_passed_on_as_they_came():
    answer = protocol.response_body(b"data: {}\n\n", end_of_stream=True)
    streamed = answer.response_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (b"data: {}\n\n", True)


def test_header_map_reads_raw_values_lowercased():
    headers = protocol.header_map(_headers(**{":path": "/v1/completions", "X-Test": "a"}))
    assert headers == {":path": "/v1/completions", "x-test": "a"}


def test_subset_hint_as_a_list_or_a_string_and_none_without_it():
    assert protocol.subset_hint(_subset(["10.0.0.1:80", "10.0.0.2:80"])) == [
        "10.0.0.1:80",
        "10.0.0.2:80",
    ]
    assert protocol.subset_hint(_subset("10.0.0.1:80, 10.0.0.3:80")) == [
        "10.0.0.1:80",
        "10.0.0.3:80",
    ]
    assert protocol.subset_hint(ext.ProcessingRequest()) is None


def test_restrict_keeps_the_routing_order_within_the_allowed_endpoints():
    order = ["b:1", "a:1", "c:1"]
    assert protocol.restrict(order, None) == order
    assert protocol.restrict(order, ["c:1", "a:1"]) == ["a:1", "c:1"]
    assert protocol.restrict(order, ["z:1"]) == []
    assert protocol.test_selection({protocol.TEST_SELECTION_HEADER: "a:1, b:1"}) == ["a:1", "b:1"]
    assert protocol.test_selection({}) is None


def test_upstream_address_from_envoy_attributes():
    request = ext.ProcessingRequest()
    request.attributes[protocol.ATTRIBUTES_NAMESPACE].update(
        {protocol.UPSTREAM_ATTRIBUTE: "10.0.0.9:8000"}
    )
    assert protocol.upstream_address(request) == "10.0.0.9:8000"
    assert protocol.upstream_address(ext.ProcessingRequest()) is None


def test_immediate_answers_are_openai_errors_and_429_says_when_to_retry():
    answer = protocol.immediate(503, "no healthy decode sidecar", code="no_backend")
    immediate = answer.immediate_response
    assert immediate.status.code == 503
    assert json.loads(immediate.body)["error"] == {
        "message": "no healthy decode sidecar",
        "type": "service_unavailable_error",
        "param": None,
        "code": "no_backend",
    }
    shed = protocol.too_many_requests(Shed("queue_full", "queue full", 2.4)).immediate_response
    assert shed.status.code == 429
    assert _set_headers(shed.headers)["retry-after"] == "3"  # whole seconds, rounded up
    assert json.loads(shed.body)["error"]["code"] == "queue_full"


def test_envoy_bootstrap_is_gie_s_filter_chain():
    config = envoy_bootstrap(8080, 19000, 9002, [("127.0.0.1", 8001)], failure_mode="open")
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = manager["typed_config"]["http_filters"]
    assert [f["name"] for f in filters] == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.router",
    ]
    ext_proc = filters[1]["typed_config"]
    assert ext_proc["failure_mode_allow"] is True
    modes = ext_proc["processing_mode"]
    assert modes["request_body_mode"] == modes["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    original = clusters["original_destination_cluster"]
    assert original["type"] == "ORIGINAL_DST"
    assert original["original_dst_lb_config"]["http_header_name"] == protocol.DESTINATION_HEADER
    closed = envoy_bootstrap(8080, 19000, 9002, [], failure_mode="close")
    closed_filters = closed["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]
    ext_closed = closed_filters[0]["typed_config"]["http_filters"][1]["typed_config"]
    assert ext_closed["failure_mode_allow"] is False
    with pytest.raises(ValueError, match="failure mode"):
        envoy_bootstrap(8080, 19000, 9002, [], failure_mode="sometimes")


# ---------------------------------------------------------------- one request's exchange
# The picker's real Exchange and routing core, fed Envoy's messages (no Envoy, no sockets:
# the decode set is static and never probed, so every sidecar counts as healthy).
SIDECARS = ["127.0.0.1:7001", "127.0.0.1:7002"]


def _request_headers(**extra: str):
    values = {":path": "/v1/completions", ":method": "POST", **extra}
    return ext.ProcessingRequest(request_headers=_headers(**values))


def _body(chunk: bytes, end: bool):
    return ext.ProcessingRequest(request_body=ext.HttpBody(body=chunk, end_of_stream=end))


def _picker(**settings):
    from pdpool.sidecar.epp.server import EndpointPicker, EppSettings

    return EndpointPicker(EppSettings(decode_urls=SIDECARS, **settings))


async def test_a_streamed_body_is_routed_once_whole_and_handed_back_unchanged():
    from pdpool.sidecar.epp.exchange import Exchange

    picker = _picker()
    ex = Exchange(picker)
    raw = b'{"prompt": [1, 2, 3], "max_tokens": 2}' + b" " * 70_000
    assert await ex.handle(_request_headers(**{"x-pdpool-kv-path": "pd"})) == []
    assert await ex.handle(_body(raw[:30_000], end=False)) == []  # held until whole
    answers = await ex.handle(_body(raw[30_000:], end=True))
    routed = answers[0].request_headers.response
    endpoint = _set_headers(routed.header_mutation)[protocol.DESTINATION_HEADER]
    assert endpoint in SIDECARS
    # the client's own P/D header is dropped: only the router sets it
    assert "x-pdpool-kv-path" in routed.header_mutation.remove_headers
    pieces = [a.request_body.response.body_mutation.streamed_response for a in answers[1:]]
    assert b"".join(p.body for p in pieces) == raw and pieces[-1].end_of_stream
    assert picker.routing.load(endpoint) == 1  # in flight until the response ends
    status = ext.ProcessingRequest(response_headers=_headers(**{":status": "200"}))
    status.attributes[protocol.ATTRIBUTES_NAMESPACE].update(
        {protocol.UPSTREAM_ATTRIBUTE: endpoint, protocol.DETAILS_ATTRIBUTE: "via_upstream"}
    )
    served = await ex.handle(status)
    assert _set_headers(served[0].response_headers.response.header_mutation) == {
        protocol.SERVED_HEADER: endpoint
    }
    end = ext.ProcessingRequest(response_body=ext.HttpBody(body=b"{}", end_of_stream=True))
    echoed = (await ex.handle(end))[0].response_body.response.body_mutation.streamed_response
    assert (echoed.body, echoed.end_of_stream) == (b"{}", True)
    assert picker.routing.load(endpoint) == 0
    ex.close()


async def test_bad_bodies_get_400_and_the_subset_hint_limits_the_choice():
    from pdpool.sidecar.epp.exchange import Exchange

    picker = _picker()
    bad = Exchange(picker)
    await bad.handle(_request_headers())
    refused = (await bad.handle(_body(b'{"prompt": "x", "max_tokens": -1}', end=True)))[0]
    assert refused.immediate_response.status.code == 400
    assert json.loads(refused.immediate_response.body)["error"]["param"] == "max_tokens"
    for only in SIDECARS:
        ex = Exchange(picker)
        await ex.handle(_request_headers())
        last = _body(b'{"prompt": "hello", "max_tokens": 2}', end=True)
        last.metadata_context.filter_metadata[protocol.SUBSET_NAMESPACE].update(
            {protocol.SUBSET_KEY: [only]}
        )
        routed = (await ex.handle(last))[0].request_headers.response.header_mutation
        assert _set_headers(routed)[protocol.DESTINATION_HEADER] == only
        ex.close()
    nowhere = Exchange(picker)
    await nowhere.handle(_request_headers())
    last = _body(b'{"prompt": "hello", "max_tokens": 2}', end=True)
    last.metadata_context.filter_metadata[protocol.SUBSET_NAMESPACE].update(
        {protocol.SUBSET_KEY: ["10.9.9.9:80"]}
    )
    assert (await nowhere.handle(last))[0].immediate_response.status.code == 503


async def test_envoy_s_own_5xx_for_the_picked_endpoint_becomes_a_clear_503_and_ejects_it():
    from pdpool.sidecar.epp.exchange import Exchange

    picker = _picker()
    ex = Exchange(picker)
    await ex.handle(_request_headers())
    answers = await ex.handle(_body(b'{"prompt": "hi", "max_tokens": 2}', end=True))
    endpoint = _set_headers(answers[0].request_headers.response.header_mutation)[
        protocol.DESTINATION_HEADER
    ]
    local = ext.ProcessingRequest(response_headers=_headers(**{":status": "503"}))
    local.attributes[protocol.ATTRIBUTES_NAMESPACE].update(
        {protocol.DETAILS_ATTRIBUTE: "upstream_reset_before_response_started{connection_failure}"}
    )
    reply = (await ex.handle(local))[0].immediate_response
    assert reply.status.code == 503 and endpoint in json.loads(reply.body)["error"]["message"]
    assert not picker.routing.healthy(endpoint)
    ex.close()


async def test_a_large_body_past_the_budget_gets_503_and_its_share_comes_back_at_the_end():
    from pdpool.sidecar.epp.exchange import Exchange

    picker = _picker(max_body_bytes=1 << 20, max_body_bytes_in_flight=2 << 20)
    piece = b" " * (900 << 10)
    holders = [Exchange(picker), Exchange(picker)]
    for ex in holders:  # two large bodies arriving: most of the budget
        assert await ex.handle(_request_headers()) == []
        assert await ex.handle(_body(piece, end=False)) == []
    third = Exchange(picker)
    assert await third.handle(_request_headers()) == []
    (refused,) = await third.handle(_body(piece, end=False))
    answer = refused.immediate_response
    assert answer.status.code == 503
    assert _set_headers(answer.headers)["retry-after"] == "1"
    assert json.loads(answer.body)["error"]["code"] == "bodies_busy"
    third.close()
    small = Exchange(picker)  # an ordinary body is never refused
    assert await small.handle(_request_headers()) == []
    answers = await small.handle(_body(b'{"prompt": "hi", "max_tokens": 2}', end=True))
    assert answers[0].WhichOneof("response") == "request_headers"
    small.close()
    holders[0].close()  # its stream ended: its share is free again
    again = Exchange(picker)
    assert await again.handle(_request_headers()) == []
    assert await again.handle(_body(piece, end=False)) == []
    assert picker.bodies.held == 2 * len(piece)
    for ex in (again, holders[1]):
        ex.close()
    assert picker.bodies.held == 0


async def test_only_a_known_sidecar_named_as_served_is_counted_there():
    """The served address is the stream's word: one the picker does not know would become a
    new series of metrics and routing state per request."""
    from prometheus_client import generate_latest

    from pdpool.sidecar.epp.exchange import Exchange

    picker = _picker()

    async def served_by(address: str) -> str:
        ex = Exchange(picker)
        await ex.handle(_request_headers())
        answers = await ex.handle(_body(b'{"prompt": "hi", "max_tokens": 2}', end=True))
        picked = _set_headers(answers[0].request_headers.response.header_mutation)
        status = ext.ProcessingRequest(response_headers=_headers(**{":status": "200"}))
        status.attributes[protocol.ATTRIBUTES_NAMESPACE].update(
            {protocol.UPSTREAM_ATTRIBUTE: address, protocol.DETAILS_ATTRIBUTE: "via_upstream"}
        )
        await ex.handle(status)
        ex.close()
        return picked[protocol.DESTINATION_HEADER]

    for i in range(50):
        await served_by(f"10.66.0.{i}:8000")
    text = generate_latest(picker.metrics.registry).decode()
    assert "10.66.0." not in text
    other = SIDECARS[1]

    def counted() -> float:
        sample = {"backend": other, "status": "200"}
        return picker.metrics.registry.get_sample_value("pdpool_gateway_requests_total", sample)

    before = counted() or 0.0
    await served_by(other)  # wherever it was picked: counted where it was served
    assert counted() == before + 1
