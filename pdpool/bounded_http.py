"""uvicorn's httptools protocol with the request head bounded.

uvicorn puts no limit on a request's line and headers: the parser holds a header until it
is complete, so one 100 MB header was read whole by each server in turn (the gateway passed
it on to the sidecar and the engine) and took 9-27 s of a core in each. Here every byte
that arrives while a head is being read counts, partial headers included, and a head past
MAX_HEAD_BYTES is answered 431 and its connection closed. The bound is Go's net/http
default (DefaultMaxHeaderBytes); a read is at most 256 KiB, so a head up to 768 KiB is never
refused because the start of its body came in the same read.
"""

from __future__ import annotations

import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 1 << 20
_MESSAGE = f"the request line and headers exceed {MAX_HEAD_BYTES} bytes"
_BODY = json.dumps(
    {"error": {"message": _MESSAGE, "type": "invalid_request_error", "param": None, "code": 431}}
).encode()
_ANSWER = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: application/json\r\n"
    b"content-length: " + str(len(_BODY)).encode() + b"\r\n"
    b"connection: close\r\n\r\n" + _BODY
)


class BoundedHeadHttp(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0  # of the head being read
        self._in_body = False  # its headers are complete, its message is not

    def data_received(self, data: bytes) -> None:
        if not self._in_body:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self.logger.warning("refused a request head over %d bytes", MAX_HEAD_BYTES)
                self.transport.write(_ANSWER)
                self.transport.close()
                return
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._in_body, self._head_bytes = True, 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        super().on_message_complete()
