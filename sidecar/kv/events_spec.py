"""Where an engine's KV events come from, as flags and settings name it.

`TARGET=ENDPOINT[|REPLAY]`: the engine (a sidecar URL for the gateway, a prefill engine's
HOST:PORT for a sidecar), its ZeroMQ PUB endpoint and, optionally, its replay endpoint;
the same endpoints vLLM's --kv-events-config binds (`tcp://*:5557` there, the engine's
address here).
"""

from __future__ import annotations

from typing import Iterable, Optional


def parse_kv_events(items: Iterable[str], flag: str) -> dict[str, str]:
    """{target: "ENDPOINT[|REPLAY]"}; ValueError naming `flag` for a malformed item."""
    out = {}
    for item in items:
        target, sep, spec = item.rpartition("=")
        if not sep or not target or not spec.startswith(("tcp://", "ipc://")):
            raise ValueError(f"{flag} wants TARGET=tcp://HOST:PORT[|tcp://HOST:PORT], got {item!r}")
        out[target.rstrip("/")] = spec
    return out


def split_spec(spec: str) -> tuple[str, Optional[str]]:
    """(PUB endpoint, replay endpoint or None)."""
    endpoint, _, replay = spec.partition("|")
    return endpoint, replay or None
