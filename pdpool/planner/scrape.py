"""Scraping: GET every endpoint's /metrics (in parallel threads) into one Snapshot.

An endpoint that does not answer is left out of the snapshot (and named in `failed`): a
starting or leaving engine must not stop the planner; its counters are diffed again from
its next answer (a restart is seen as counters going down)."""

from __future__ import annotations

import ssl
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

from .metrics import EndpointMetrics, Snapshot, parse_text


@dataclass(frozen=True)
class Target:
    role: str  # prefill, decode, sidecar
    endpoint: str  # identity (HOST:PORT or pod name)
    url: str  # its metrics URL, e.g. http://10.0.0.5:8000/metrics


def _context(ca_file: Optional[str], insecure: bool) -> Optional[ssl.SSLContext]:
    if insecure:  # metrics of pods whose CA the caller cannot read (a pool's own TLS)
        return ssl._create_unverified_context()
    return ssl.create_default_context(cafile=ca_file) if ca_file else None


def fetch_metrics(
    url: str, timeout_s: float = 2.0, ca_file: Optional[str] = None, insecure: bool = False
) -> str:
    context = _context(ca_file, insecure)
    with urllib.request.urlopen(url, timeout=timeout_s, context=context) as r:
        return str(r.read().decode("utf-8", "replace"))


def _one(
    target: Target, timeout_s: float, ca_file: Optional[str], insecure: bool
) -> Optional[EndpointMetrics]:
    try:
        text = fetch_metrics(target.url, timeout_s, ca_file, insecure)
        return EndpointMetrics(target.role, target.endpoint, parse_text(text))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def scrape(
    targets: Sequence[Target],
    timeout_s: float = 2.0,
    ca_file: Optional[str] = None,
    at: Optional[float] = None,
    insecure: bool = False,
) -> tuple[Snapshot, list[str]]:
    """(snapshot of those that answered, endpoints that did not)."""
    if not targets:
        return Snapshot(at if at is not None else time.monotonic()), []
    with ThreadPoolExecutor(max_workers=min(8, len(targets))) as pool:
        got = list(pool.map(lambda t: _one(t, timeout_s, ca_file, insecure), targets))
    now = at if at is not None else time.monotonic()
    failed = [t.endpoint for t, m in zip(targets, got, strict=True) if m is None]
    return Snapshot(now, tuple(m for m in got if m is not None)), failed
