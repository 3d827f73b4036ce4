"""The ext_proc messages the endpoint picker declares are Envoy's on the wire: the bytes
below were produced by Envoy's own generated API (the xds-protos package, v1.85) for the
same messages, and one request Envoy's API encoded is read back field for field."""

from __future__ import annotations

from google.protobuf import struct_pb2

from pdpool.sidecar.epp import envoy_api as api

ENDPOINT = "10.0.0.1:8080"
# Envoy's encodings (deterministic) of the four answers built in `answers()`.
ENVOY_BYTES = [
    "0a3b0a3912350a330a2f0a1e782d676174657761792d64657374696e6174696f6e2d656e64706f696e741a0d"
    "31302e302e302e313a383038301802280142430a410a08656e766f792e6c6212352a330a310a1e782d6761"
    "74657761792d64657374696e6174696f6e2d656e64706f696e74120f1a0d31302e302e302e313a38303830",
    "1a0c0a0a1a081a060a027b7d1001",
    "3a410a0308f70312260a240a200a0c636f6e74656e742d747970651a106170706c69636174696f6e2f6a73"
    "6f6e18021a0c7b226572726f72223a7b7d7d2a046e6f6e65",
    "3200",
]
# Envoy's encoding of request headers (:path), a subset hint and the upstream attribute.
ENVOY_REQUEST = (
    "121c0a1a0a180a053a706174681a0f2f76312f636f6d706c6574696f6e7342580a560a14656e766f792e6c"
    "622e7375627365745f68696e74123e0a3c0a25782d676174657761792d64657374696e6174696f6e2d656e"
    "64706f696e742d737562736574121332110a0f1a0d31302e302e302e323a383038304a440a1b656e766f79"
    "2e66696c746572732e687474702e6578745f70726f6312250a230a10757073747265616d2e616464726573"
    "73120f1a0d31302e302e302e333a38303830"
)


def _header(key: str, value: bytes):
    return api.HeaderValueOption(
        header=api.HeaderValue(key=key, raw_value=value),
        append_action=api.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def answers():
    meta = struct_pb2.Struct()
    meta.get_or_create_struct("envoy.lb")["x-gateway-destination-endpoint"] = ENDPOINT
    picked = api.ProcessingResponse(
        request_headers=api.HeadersResponse(
            response=api.CommonResponse(
                header_mutation=api.HeaderMutation(
                    set_headers=[_header("x-gateway-destination-endpoint", ENDPOINT.encode())]
                ),
                clear_route_cache=True,
            )
        ),
        dynamic_metadata=meta,
    )
    body = api.ProcessingResponse(
        request_body=api.BodyResponse(
            response=api.CommonResponse(
                body_mutation=api.BodyMutation(
                    streamed_response=api.StreamedBodyResponse(body=b"{}", end_of_stream=True)
                )
            )
        )
    )
    refused = api.ProcessingResponse(
        immediate_response=api.ImmediateResponse(
            status=api.HttpStatus(code=503),
            headers=api.HeaderMutation(set_headers=[_header("content-type", b"application/json")]),
            body=b'{"error":{}}',
            details="none",
        )
    )
    trailers = api.ProcessingResponse(response_trailers=api.TrailersResponse())
    return [picked, body, refused, trailers]


def test_answers_encode_as_envoys_api_does():
    for ours, envoys in zip(answers(), ENVOY_BYTES, strict=True):
        assert ours.SerializeToString(deterministic=True).hex() == envoys
        assert api.ProcessingResponse.FromString(bytes.fromhex(envoys)) == ours


def test_a_request_envoy_encoded_reads_back():
    request = api.ProcessingRequest.FromString(bytes.fromhex(ENVOY_REQUEST))
    assert request.WhichOneof("request") == "request_headers"
    (header,) = request.request_headers.headers.headers
    assert (header.key, header.raw_value) == (":path", b"/v1/completions")
    hint = request.metadata_context.filter_metadata["envoy.lb.subset_hint"]
    subset = hint.fields["x-gateway-destination-endpoint-subset"].list_value.values
    assert [v.string_value for v in subset] == ["10.0.0.2:8080"]
    attrs = request.attributes["envoy.filters.http.ext_proc"]
    assert attrs.fields["upstream.address"].string_value == "10.0.0.3:8080"


def test_fields_it_does_not_declare_survive_a_round_trip():
    # protocol_config (11) is Envoy's, not declared here: kept as an unknown field.
    raw = bytes.fromhex("5a020801")
    assert api.ProcessingRequest.FromString(raw).SerializeToString() == raw


def test_the_service_handler_names_envoys_method():
    handler = api.ext_proc_handler(lambda requests, context: requests)
    assert handler.service_name() == "envoy.service.ext_proc.v3.ExternalProcessor"


def test_a_body_ended_without_a_message_reads_back():
    # Envoy's HttpBody(end_of_stream=True, end_of_stream_without_message=True) as a
    # response body
    request = api.ProcessingRequest.FromString(bytes.fromhex("2a0410011801"))
    assert request.response_body.end_of_stream
    assert request.response_body.end_of_stream_without_message
