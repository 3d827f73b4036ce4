"""The Gateway API Inference Extension's endpoint-picker protocol over Envoy ext_proc, as
pure functions: what the picker reads from Envoy's messages and the answers it builds.

GIE's contract (what every conformant gateway relies on): the picked endpoint ("ip:port")
goes in the `x-gateway-destination-endpoint` request header AND in the dynamic metadata
namespace `envoy.lb` under the same key; a gateway may restrict the choice with the filter
metadata `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset` (a list of
"ip:port"); refusals are ImmediateResponses. Bodies stream in FULL_DUPLEX_STREAMED mode:
every body chunk Envoy sends must be answered with a StreamedBodyResponse, and the request
body goes on byte for byte."""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping, Optional

from google.protobuf import struct_pb2

from ..net.asgi import error_body
from ..flow.admission import Shed, shed_body
from . import envoy_api as ext

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# GIE's conformance suite steers its test picker with this header (comma-separated
# "ip:port"); honoured only when the picker runs with --test-endpoint-selection.
TEST_SELECTION_HEADER = "test-epp-endpoint-selection"
# The endpoint Envoy reports it connected to (the ext_proc filter's response_attributes).
UPSTREAM_ATTRIBUTE = "upstream.address"
DETAILS_ATTRIBUTE = "response.code_details"  # "via_upstream" unless Envoy answered itself
ATTRIBUTES_NAMESPACE = "envoy.filters.http.ext_proc"
# The sidecar that answered, on the client's response (as our HTTP gateway sets it).
SERVED_HEADER = "x-pdpool-backend"
# Some Envoy builds refuse streamed chunks over 64 KiB: stay under it (as llm-d does).
BODY_CHUNK_BYTES = 62_000


def header_map(headers: Any) -> dict[str, str]:
    """Envoy's headers as a dict of lowercase names (pseudo-headers kept: ":path" etc.)."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        out[h.key.lower()] = value
    return out


def subset_hint(request: Any) -> Optional[list[str]]:
    """The endpoints the gateway allows for this request (None: no restriction)."""
    namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values if v.string_value]
    return [e.strip() for e in value.string_value.split(",") if e.strip()]


def test_selection(headers: Mapping[str, str]) -> Optional[list[str]]:
    """The endpoints GIE's conformance header names (None when absent)."""
    raw = headers.get(TEST_SELECTION_HEADER)
    if raw is None:
        return None
    return [e.strip() for e in raw.split(",") if e.strip()]


def restrict(order: list[str], allowed: Optional[Iterable[str]]) -> list[str]:
    """`order` kept to the allowed endpoints, in its own order (all of it without a limit)."""
    if allowed is None:
        return order
    keep = set(allowed)
    return [b for b in order if b in keep]


def upstream_address(request: Any) -> Optional[str]:
    """Where Envoy sent the request (from `upstream.address`), None when it never connected
    (its own local reply) or the attribute is not configured."""
    attrs = request.attributes.get(ATTRIBUTES_NAMESPACE)
    if attrs is None or UPSTREAM_ATTRIBUTE not in attrs.fields:
        return None
    return attrs.fields[UPSTREAM_ATTRIBUTE].string_value or None


def envoy_reply(request: Any) -> bool:
    """Whether the response is Envoy's own (it could not reach or lost the upstream), not
    the upstream's: `response.code_details` says "via_upstream" for the upstream's."""
    attrs = request.attributes.get(ATTRIBUTES_NAMESPACE)
    if attrs is None or DETAILS_ATTRIBUTE not in attrs.fields:
        return upstream_address(request) is None
    return str(attrs.fields[DETAILS_ATTRIBUTE].string_value) != "via_upstream"


def _header(key: str, value: str) -> Any:
    return ext.HeaderValueOption(
        header=ext.HeaderValue(key=key, raw_value=value.encode()),
        append_action=ext.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def endpoint_metadata(endpoint: str) -> struct_pb2.Struct:
    """`envoy.lb` dynamic metadata naming the picked endpoint."""
    meta = struct_pb2.Struct()
    meta.update({LB_NAMESPACE: {DESTINATION_HEADER: endpoint}})
    return meta


def routed_headers(
    endpoint: str,
    set_headers: Mapping[str, str],
    remove: Iterable[str] = (),
    body_bytes: Optional[int] = None,
) -> Any:
    """The answer to the request headers once an endpoint is picked: the destination header
    (and any of ours, e.g. the P/D path), headers only we may set removed, Content-Length
    restated for a streamed body (Envoy drops it in streamed mode), the route cache cleared
    (the destination changed), and the endpoint in `envoy.lb` metadata."""
    headers = {DESTINATION_HEADER: endpoint, **set_headers}
    if body_bytes is not None:
        headers["content-length"] = str(body_bytes)
    mutation = ext.HeaderMutation(
        set_headers=[_header(k, v) for k, v in headers.items()],
        remove_headers=[h for h in remove if h not in headers],
    )
    return ext.ProcessingResponse(
        request_headers=ext.HeadersResponse(
            response=ext.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        ),
        dynamic_metadata=endpoint_metadata(endpoint),
    )


def _chunks(raw: bytes) -> list[bytes]:
    if not raw:
        return [b""]
    return [raw[i : i + BODY_CHUNK_BYTES] for i in range(0, len(raw), BODY_CHUNK_BYTES)]


def request_body(raw: bytes, end_of_stream: bool = True) -> list[Any]:
    """The request body handed back unchanged, in chunks Envoy accepts; the last one ends
    the stream."""
    pieces = _chunks(raw)
    return [
        ext.ProcessingResponse(
            request_body=ext.BodyResponse(
                response=ext.CommonResponse(
                    body_mutation=ext.BodyMutation(
                        streamed_response=ext.StreamedBodyResponse(
                            body=piece, end_of_stream=end_of_stream and i == len(pieces) - 1
                        )
                    )
                )
            )
        )
        for i, piece in enumerate(pieces)
    ]


def response_body(chunk: bytes, end_of_stream: bool) -> Any:
    """One chunk of the response passed on as it came (one answer per chunk Envoy sent)."""
    return ext.ProcessingResponse(
        response_body=ext.BodyResponse(
            response=ext.CommonResponse(
                body_mutation=ext.BodyMutation(
                    streamed_response=ext.StreamedBodyResponse(
                        body=chunk, end_of_stream=end_of_stream
                    )
                )
            )
        )
    )


def response_headers(served: Optional[str]) -> Any:
    """The answer to the response headers: the sidecar that served, for the client."""
    mutation = ext.HeaderMutation(set_headers=[_header(SERVED_HEADER, served)] if served else [])
    return ext.ProcessingResponse(
        response_headers=ext.HeadersResponse(response=ext.CommonResponse(header_mutation=mutation))
    )


def trailers(request_side: bool) -> Any:
    if request_side:
        return ext.ProcessingResponse(request_trailers=ext.TrailersResponse())
    return ext.ProcessingResponse(response_trailers=ext.TrailersResponse())


def immediate(
    status: int,
    message: str,
    code: Optional[str] = None,
    param: Optional[str] = None,
    headers: Optional[Mapping[str, str]] = None,
) -> Any:
    """Answers the client now, without an upstream (400 bad body, 429 shed, 503 none fit)."""
    all_headers = {"content-type": "application/json", **(headers or {})}
    return ext.ProcessingResponse(
        immediate_response=ext.ImmediateResponse(
            status=ext.HttpStatus(code=status),
            headers=ext.HeaderMutation(set_headers=[_header(k, v) for k, v in all_headers.items()]),
            body=json.dumps(error_body(status, message, param, code)).encode(),
            details=message[:200],
        )
    )


def too_many_requests(shed: Shed) -> Any:
    """429 for a request shed by admission (flow control), with its Retry-After."""
    message, code, headers = shed_body(shed)
    return immediate(429, message, code=code, headers=headers)
