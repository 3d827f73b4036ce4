"""A small OTLP/HTTP (protobuf) trace receiver: spans in, one JSON line per span out.

`pdpool up --otel FILE` runs one so that a single machine sees its traces without a
collector: every child (our servers and stock vLLM engines alike) exports to it over
OTLP/HTTP, and it appends each span to FILE as flat JSON (trace and span ids in hex, the
parent's id, name, service, start and end in nanoseconds, attributes, events). The tests
read the spans it keeps in memory.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

TRACES_PATH = "/v1/traces"
MAX_BODY = 64 << 20


def _value(v: Any) -> Any:
    """An OTLP AnyValue as plain JSON."""
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind)


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode_spans(body: bytes) -> list[dict[str, Any]]:
    """Flat spans of an ExportTraceServiceRequest (protobuf); ValueError when it is not one."""
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as exc:
        raise ValueError(f"not an OTLP ExportTraceServiceRequest: {exc}") from None
    spans = []
    for rs in request.resource_spans:
        resource = _attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(
                    {
                        "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(),
                        "parent_span_id": s.parent_span_id.hex() or None,
                        "name": s.name,
                        "kind": int(s.kind),
                        "service": resource.get("service.name"),
                        "start_ns": s.start_time_unix_nano,
                        "end_ns": s.end_time_unix_nano,
                        "attributes": _attributes(s.attributes),
                        "events": [
                            {"name": e.name, "attributes": _attributes(e.attributes)}
                            for e in s.events
                        ],
                        "status": int(s.status.code),
                    }
                )
    return spans


class OtlpReceiver:
    """OTLP/HTTP trace receiver on 127.0.0.1 (port 0: any free one), in a thread."""

    def __init__(
        self, path: Optional[str] = None, port: int = 0, echo: bool = False, keep: bool = True
    ) -> None:
        """`path`: append every span there as a JSON line; `echo`: print each to stdout;
        `keep`: hold them in `spans` too (tests; not for a long run)."""
        self.path, self.echo, self.keep = path, echo, keep
        self.spans: list[dict[str, Any]] = []
        self._cv = threading.Condition()
        self._file = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115
        handler = _handler(self._accept)
        self._server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}{TRACES_PATH}"

    def start(self) -> "OtlpReceiver":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._file:
            self._file.close()

    def _accept(self, spans: list[dict[str, Any]]) -> None:
        with self._cv:
            if self.keep:
                self.spans.extend(spans)
            lines = [json.dumps(s, separators=(",", ":")) for s in spans]
            if self._file:
                self._file.write("".join(line + "\n" for line in lines))
                self._file.flush()
            if self.echo:
                print("\n".join(lines), flush=True)
            self._cv.notify_all()

    def wait_for(
        self, ready: Callable[[list[dict[str, Any]]], bool], timeout_s: float = 20.0
    ) -> list[dict[str, Any]]:
        """The spans received once `ready(spans)` holds (or the timeout passed)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while not ready(self.spans) and time.monotonic() < deadline:
                self._cv.wait(max(deadline - time.monotonic(), 0.01))
            return list(self.spans)

    def __enter__(self) -> "OtlpReceiver":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _handler(accept: Callable[[list[dict[str, Any]]], None]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path.split("?")[0] != TRACES_PATH:
                return self._answer(404, b"not found")
            length = int(self.headers.get("content-length") or 0)
            if length > MAX_BODY:
                return self._answer(413, b"too large")
            body = self.rfile.read(length)
            try:
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                spans = decode_spans(body)
            except (ValueError, OSError) as exc:
                return self._answer(400, str(exc).encode())
            accept(spans)
            # An empty ExportTraceServiceResponse: full success.
            self._answer(200, b"", "application/x-protobuf")

        def _answer(self, status: int, body: bytes, ctype: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # quiet: one POST per batch
            pass

    return Handler
