"""The part of Envoy's API the endpoint picker speaks: ext_proc v3 messages and the core
types they carry, declared here field by field (same full names, numbers and types as
Envoy's published definitions, so the bytes on the wire are Envoy's).

Why not a generated package: the one on PyPI that ships Envoy's compiled API (xds-protos)
also ships old copies of `opentelemetry/proto/*`, which overwrite opentelemetry-proto's in
the same environment and break the OTLP exporters. The messages live in a pool of their
own, so they never clash with another copy of Envoy's API loaded in the same process.

Enums are declared as int32 (proto3 enums are varints on the wire); fields the picker
never reads or writes (processing-mode overrides, protocol configuration, ...) are left
out: protobuf keeps them as unknown fields."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, struct_pb2
from google.protobuf import wrappers_pb2

_F = descriptor_pb2.FieldDescriptorProto
SCALARS = {
    "bool": _F.TYPE_BOOL,
    "bytes": _F.TYPE_BYTES,
    "string": _F.TYPE_STRING,
    "int32": _F.TYPE_INT32,
    "uint32": _F.TYPE_UINT32,
}
STRUCT = ".google.protobuf.Struct"
BOOL_VALUE = ".google.protobuf.BoolValue"
CORE = "envoy.config.core.v3"
TYPE = "envoy.type.v3"
EXT_PROC = "envoy.service.ext_proc.v3"

# package -> {message: [(number, name, type, repeated?, oneof or None)]}; a type that starts
# with "." names a message (a map is "map<string,.Full.Name>").
SCHEMA: dict[str, dict[str, list[tuple[int, str, str, bool, str | None]]]] = {
    CORE: {
        "HeaderValue": [
            (1, "key", "string", False, None),
            (2, "value", "string", False, None),
            (3, "raw_value", "bytes", False, None),
        ],
        "HeaderValueOption": [
            (1, "header", f".{CORE}.HeaderValue", False, None),
            (2, "append", BOOL_VALUE, False, None),
            (3, "append_action", "int32", False, None),
            (4, "keep_empty_value", "bool", False, None),
        ],
        "HeaderMap": [(1, "headers", f".{CORE}.HeaderValue", True, None)],
        "Metadata": [(1, "filter_metadata", f"map<string,{STRUCT}>", True, None)],
    },
    TYPE: {
        "HttpStatus": [(1, "code", "int32", False, None)],
    },
    EXT_PROC: {
        "HttpHeaders": [
            (1, "headers", f".{CORE}.HeaderMap", False, None),
            (3, "end_of_stream", "bool", False, None),
        ],
        # end_of_stream_without_message: the body ended with no more bytes to send (streamed
        # modes); grpc_message_compressed only concerns gRPC bodies.
        "HttpBody": [
            (1, "body", "bytes", False, None),
            (2, "end_of_stream", "bool", False, None),
            (3, "end_of_stream_without_message", "bool", False, None),
            (4, "grpc_message_compressed", "bool", False, None),
        ],
        "HttpTrailers": [(1, "trailers", f".{CORE}.HeaderMap", False, None)],
        "ProcessingRequest": [
            (2, "request_headers", f".{EXT_PROC}.HttpHeaders", False, "request"),
            (3, "response_headers", f".{EXT_PROC}.HttpHeaders", False, "request"),
            (4, "request_body", f".{EXT_PROC}.HttpBody", False, "request"),
            (5, "response_body", f".{EXT_PROC}.HttpBody", False, "request"),
            (6, "request_trailers", f".{EXT_PROC}.HttpTrailers", False, "request"),
            (7, "response_trailers", f".{EXT_PROC}.HttpTrailers", False, "request"),
            (8, "metadata_context", f".{CORE}.Metadata", False, None),
            (9, "attributes", f"map<string,{STRUCT}>", True, None),
            (10, "observability_mode", "bool", False, None),
        ],
        "HeaderMutation": [
            (1, "set_headers", f".{CORE}.HeaderValueOption", True, None),
            (2, "remove_headers", "string", True, None),
        ],
        "StreamedBodyResponse": [
            (1, "body", "bytes", False, None),
            (2, "end_of_stream", "bool", False, None),
            (3, "end_of_stream_without_message", "bool", False, None),
            (4, "grpc_message_compressed", "bool", False, None),
        ],
        "BodyMutation": [
            (1, "body", "bytes", False, "mutation"),
            (2, "clear_body", "bool", False, "mutation"),
            (3, "streamed_response", f".{EXT_PROC}.StreamedBodyResponse", False, "mutation"),
        ],
        "CommonResponse": [
            (1, "status", "int32", False, None),
            (2, "header_mutation", f".{EXT_PROC}.HeaderMutation", False, None),
            (3, "body_mutation", f".{EXT_PROC}.BodyMutation", False, None),
            (4, "trailers", f".{CORE}.HeaderMap", False, None),
            (5, "clear_route_cache", "bool", False, None),
        ],
        "HeadersResponse": [(1, "response", f".{EXT_PROC}.CommonResponse", False, None)],
        "BodyResponse": [(1, "response", f".{EXT_PROC}.CommonResponse", False, None)],
        "TrailersResponse": [(1, "header_mutation", f".{EXT_PROC}.HeaderMutation", False, None)],
        "GrpcStatus": [(1, "status", "uint32", False, None)],
        "ImmediateResponse": [
            (1, "status", f".{TYPE}.HttpStatus", False, None),
            (2, "headers", f".{EXT_PROC}.HeaderMutation", False, None),
            (3, "body", "bytes", False, None),
            (4, "grpc_status", f".{EXT_PROC}.GrpcStatus", False, None),
            (5, "details", "string", False, None),
        ],
        "ProcessingResponse": [
            (1, "request_headers", f".{EXT_PROC}.HeadersResponse", False, "response"),
            (2, "response_headers", f".{EXT_PROC}.HeadersResponse", False, "response"),
            (3, "request_body", f".{EXT_PROC}.BodyResponse", False, "response"),
            (4, "response_body", f".{EXT_PROC}.BodyResponse", False, "response"),
            (5, "request_trailers", f".{EXT_PROC}.TrailersResponse", False, "response"),
            (6, "response_trailers", f".{EXT_PROC}.TrailersResponse", False, "response"),
            (7, "immediate_response", f".{EXT_PROC}.ImmediateResponse", False, "response"),
            (8, "dynamic_metadata", STRUCT, False, None),
        ],
    },
}
# HeaderValueOption.append_action, CommonResponse.status
OVERWRITE_IF_EXISTS_OR_ADD = 2
CONTINUE = 0
SERVICE = f"{EXT_PROC}.ExternalProcessor"
METHOD = "Process"


def _field(message: descriptor_pb2.DescriptorProto, spec: tuple[Any, ...]) -> None:
    number, name, kind, repeated, oneof = spec
    field = message.field.add(number=number, name=name, json_name=_camel(name))
    field.label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
    if kind.startswith("map<"):
        value_type = kind[len("map<string,") : -1]
        entry = message.nested_type.add(name=_camel(name, upper=True) + "Entry")
        entry.options.map_entry = True
        entry.field.add(
            number=1, name="key", json_name="key", type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL
        )
        entry.field.add(
            number=2,
            name="value",
            json_name="value",
            type=_F.TYPE_MESSAGE,
            type_name=value_type,
            label=_F.LABEL_OPTIONAL,
        )
        field.type, field.type_name = _F.TYPE_MESSAGE, f".{message.name}.{entry.name}"
    elif kind.startswith("."):
        field.type, field.type_name = _F.TYPE_MESSAGE, kind
    else:
        field.type = SCALARS[kind]
    if oneof is not None:
        names = [o.name for o in message.oneof_decl]
        if oneof not in names:
            message.oneof_decl.add(name=oneof)
            names.append(oneof)
        field.oneof_index = names.index(oneof)


def _camel(name: str, upper: bool = False) -> str:
    head, *rest = name.split("_")
    text = head + "".join(p.title() for p in rest)
    return text[0].upper() + text[1:] if upper else text


def _build_pool() -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    for dependency in (struct_pb2, wrappers_pb2):
        proto = descriptor_pb2.FileDescriptorProto()
        dependency.DESCRIPTOR.CopyToProto(proto)
        pool.Add(proto)
    for index, (package, messages) in enumerate(SCHEMA.items()):
        proto = descriptor_pb2.FileDescriptorProto(
            name=f"pdpool/{package.replace('.', '/')}.proto", package=package, syntax="proto3"
        )
        proto.dependency.extend(["google/protobuf/struct.proto", "google/protobuf/wrappers.proto"])
        # Each package may use the ones declared before it.
        proto.dependency.extend(f"pdpool/{p.replace('.', '/')}.proto" for p in list(SCHEMA)[:index])
        for name, fields in messages.items():
            message = proto.message_type.add(name=name)
            for spec in fields:
                _field(message, spec)
            # Map entries name their enclosing message relative to the package.
            for field in message.field:
                if field.type_name.startswith(f".{name}."):
                    field.type_name = f".{package}{field.type_name}"
        pool.Add(proto)
    return pool


POOL = _build_pool()


def _message(package: str, name: str) -> Any:
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(f"{package}.{name}"))


HeaderValue = _message(CORE, "HeaderValue")
HeaderValueOption = _message(CORE, "HeaderValueOption")
HeaderMap = _message(CORE, "HeaderMap")
Metadata = _message(CORE, "Metadata")
HttpStatus = _message(TYPE, "HttpStatus")
HttpHeaders = _message(EXT_PROC, "HttpHeaders")
HttpBody = _message(EXT_PROC, "HttpBody")
HttpTrailers = _message(EXT_PROC, "HttpTrailers")
ProcessingRequest = _message(EXT_PROC, "ProcessingRequest")
HeaderMutation = _message(EXT_PROC, "HeaderMutation")
StreamedBodyResponse = _message(EXT_PROC, "StreamedBodyResponse")
BodyMutation = _message(EXT_PROC, "BodyMutation")
CommonResponse = _message(EXT_PROC, "CommonResponse")
HeadersResponse = _message(EXT_PROC, "HeadersResponse")
BodyResponse = _message(EXT_PROC, "BodyResponse")
TrailersResponse = _message(EXT_PROC, "TrailersResponse")
GrpcStatus = _message(EXT_PROC, "GrpcStatus")
ImmediateResponse = _message(EXT_PROC, "ImmediateResponse")
ProcessingResponse = _message(EXT_PROC, "ProcessingResponse")


def ext_proc_handler(process: Any) -> grpc.GenericRpcHandler:
    """The ExternalProcessor service for a grpc(.aio) server: `process(requests, context)`
    is the bidirectional Process stream (an async iterator of ProcessingRequest in, of
    ProcessingResponse out)."""
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            METHOD: grpc.stream_stream_rpc_method_handler(
                process,
                request_deserializer=ProcessingRequest.FromString,
                response_serializer=ProcessingResponse.SerializeToString,
            )
        },
    )
