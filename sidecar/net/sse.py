"""Splitting a Server-Sent-Events byte stream into events, and reading their JSON."""

from __future__ import annotations

import json
from typing import Any, Optional

DONE = object()  # the `data: [DONE]` sentinel


class EventSplitter:
    """Feeds arbitrary byte chunks, returns the complete events (each with its blank
    line) seen so far. Accepts '\\n\\n' and '\\r\\n\\r\\n' separators."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self._pending + chunk
        if b"\r\n" in data:
            data = data.replace(b"\r\n", b"\n")
        events = []
        start = 0
        while True:
            end = data.find(b"\n\n", start)
            if end < 0:
                break
            events.append(data[start : end + 2])
            start = end + 2
        self._pending = data[start:]
        return events

    def rest(self) -> bytes:
        return self._pending


def event_json(event: bytes) -> Any:
    """The JSON of an event's `data:` lines; DONE for [DONE]; None when not JSON."""
    lines = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    payload = b"\n".join(lines).strip()
    if payload == b"[DONE]":
        return DONE
    try:
        return json.loads(payload)
    except ValueError:
        return None


def json_event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def usage_of(chunk: Any) -> Optional[dict[str, Any]]:
    if isinstance(chunk, dict):
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            return usage
    return None
