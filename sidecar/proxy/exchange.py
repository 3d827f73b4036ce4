"""One client request as it moves through the legs, and what the legs hand back."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from ..net.asgi import Send

PATH_HEADER = "x-pdpool-path"


@dataclass
class Exchange:
    """One client request as it moves through the legs."""

    route: str
    body: dict[str, Any]
    headers: dict[str, str]
    request_id: str
    send: Send
    targets: list[str] = field(default_factory=list)  # trusted x-prefiller-host-port
    stream: bool = False
    path_taken: str = "decode"
    prefill_usage: Any = None  # the prefill leg's usage (JSON), after a P/D run
    reply_headers: dict[str, str] = field(default_factory=dict)
    # Tracing (pdpool.tracing): the request's span, parent of every leg's; None when off.
    span: Any = None
    read_at: float = field(default_factory=time.perf_counter)
    first_byte_at: float = 0.0  # when the answer's first bytes went to the client

    def out_headers(self, content_type: str) -> dict[str, str]:
        return {
            "content-type": content_type,
            "x-request-id": self.request_id,
            PATH_HEADER: self.path_taken,
            **self.reply_headers,
        }


@dataclass
class Buffered:
    """A fully read upstream answer."""

    status_code: int
    headers: dict[str, str]
    content: bytes


@dataclass
class PrefillResult:
    kv: Optional[dict[str, Any]] = None  # usable params for the decode leg
    usage: Any = None  # the prefill answer's usage (JSON)
    client_error: Optional[tuple[int, bytes]] = None


def json_or_none(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return None
