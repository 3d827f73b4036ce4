"""Trusting an external picker's choice of prefill engine (no SSRF).

An `x-prefiller-host-port` header names the prefill engine an external scheduler picked.
The sidecar would otherwise send requests wherever a client points it, so the header is
honoured only for an endpoint in the configured or discovered prefill set. The check is
on host AND port: allowing any port of a known host would let a client reach other
services on that host (the decode engine itself, when everything runs on one node).

As llm-d's sidecar, the header may name several endpoints, comma-separated (or the header
may be repeated, which HTTP folds into one comma-separated value): every entry must be
allowed, else the whole request is refused; the sidecar then picks among them.
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
            text = text[len(scheme) :]
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


MAX_TARGETS = 64


def allowed_targets(header_value: Optional[str], allowed: Iterable[str]) -> list[str]:
    """The normalized targets the header names (order kept, duplicates dropped); an empty
    list when the header is absent or blank.

    Raises ForbiddenTarget when any entry is malformed (an empty one too) or names an
    endpoint outside `allowed`."""
    if header_value is None or not header_value.strip():
        return []
    entries = header_value.split(",")
    if len(entries) > MAX_TARGETS:
        raise ForbiddenTarget(f"too many prefill targets (at most {MAX_TARGETS})")
    allowed_set = {normalize_host_port(a) for a in allowed}
    targets: list[str] = []
    for entry in entries:
        target = normalize_host_port(entry)
        if target not in allowed_set:
            raise ForbiddenTarget(f"prefill target {target} is not an allowed prefill endpoint")
        if target not in targets:
            targets.append(target)
    return targets


def allowed_target(header_value: Optional[str], allowed: Iterable[str]) -> Optional[str]:
    """The first target the header names (see `allowed_targets`), or None when absent."""
    targets = allowed_targets(header_value, allowed)
    return targets[0] if targets else None
