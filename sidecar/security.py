"""Trusting an external picker's choice of prefill engine (no SSRF).

An `x-prefiller-host-port` header names the prefill engine an external scheduler picked.
The sidecar would otherwise send requests wherever a client points it, so the header is
honoured only for an endpoint in the configured or discovered prefill set. The check is
on host AND port: allowing any port of a known host would let a client reach other
services on that host (the decode engine itself, when everything runs on one node).
"""
from __future__ import annotations

from typing import Iterable, Optional

PREFILLER_HEADER = "x-prefiller-host-port"


class ForbiddenTarget(Exception):
    """The requested prefill target is not in the allowed set (answered with 403)."""


def normalize_host_port(value: str) -> str:
    """'HOST:PORT' or 'http://HOST:PORT[/]' -> 'HOST:PORT' (lower-cased host).

    Raises ForbiddenTarget for anything that is not a plain host and numeric port."""
    text = value.strip()
    for scheme in ("http://", "https://"):
        if text.lower().startswith(scheme):
            text = text[len(scheme):]
    text = text.rstrip("/")
    if not text or "/" in text or "@" in text or "?" in text or "#" in text:
        raise ForbiddenTarget(f"invalid prefill target {value!r}")
    if text.startswith("["):  # [IPv6]:port
        host, sep, port = text[1:].partition("]:")
        host = f"[{host}]"
    else:
        host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ForbiddenTarget(f"invalid prefill target {value!r} (want HOST:PORT)")
    return f"{host.lower()}:{int(port)}"


def allowed_target(header_value: Optional[str], allowed: Iterable[str]) -> Optional[str]:
    """The normalized target named by the header, or None when the header is absent.

    Raises ForbiddenTarget when the header names an endpoint outside `allowed`."""
    if header_value is None or not header_value.strip():
        return None
    target = normalize_host_port(header_value)
    if target not in {normalize_host_port(a) for a in allowed}:
        raise ForbiddenTarget(f"prefill target {target} is not an allowed prefill endpoint")
    return target
