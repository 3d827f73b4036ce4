"""KV event subscriptions that follow discovery: one per engine an EndpointSet lists.

In Kubernetes the engines are found through a headless Service (discovery.py), so their
event endpoints cannot be listed up front. Every engine of a pool binds the same ports
(`--kv-events-config` with `tcp://*:PORT`), so a subscriber derives each engine's endpoint
from the address it already has for that pod: "IP:HTTPPORT" -> `tcp://IP:PORT`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING, Iterable, Optional

from ..net.security import normalize_host_port
from .events_spec import split_spec

if TYPE_CHECKING:
    from .costs import KVCosts

log = logging.getLogger(__name__)


def check_event_ports(
    port: Optional[int], replay_port: Optional[int], names: tuple[str, str]
) -> tuple[Optional[int], Optional[int]]:
    """(port, replay_port) as ints; ValueError using `names` (of the port, of the replay
    port) when they make no sense."""
    if port is None:
        if replay_port is not None:
            raise ValueError(f"{names[1]} needs {names[0]}")
        return None, None
    port = int(port)
    replay = None if replay_port is None else int(replay_port)
    for name, value in zip(names, (port, replay), strict=True):
        if value is not None and not 0 < value < 65536:
            raise ValueError(f"{name} must be in 1..65535, got {value}")
    if replay == port:
        raise ValueError(f"{names[0]} and {names[1]} must differ")
    return port, replay


def wanted_subscriptions(
    endpoints: Iterable[str], port: int, replay_port: Optional[int] = None
) -> dict[str, str]:
    """{endpoint "HOST:PORT": "tcp://HOST:port[|tcp://HOST:replay_port]"}: where the engine
    in the same pod as each endpoint publishes its KV events."""
    out = {}
    for backend in endpoints:
        host = backend.rpartition(":")[0]  # "[v6]" keeps its brackets, as ZeroMQ wants
        if not host:
            continue
        spec = f"tcp://{host}:{port}"
        if replay_port:
            spec += f"|tcp://{host}:{replay_port}"
        out[backend] = spec
    return out


class KVFeeds:
    """Keeps a router (KVCosts) subscribed to the engines of the current endpoint set: endpoints
    that appear are subscribed, those that vanish unsubscribed (and their blocks forgotten).
    Endpoints with a static subscription (--kv-events) are left to it."""

    def __init__(
        self,
        router: KVCosts,
        port: int,
        replay_port: Optional[int] = None,
        static: Iterable[str] = (),
        retry_s: float = 5.0,
    ) -> None:
        self.router = router
        self.port, self.replay_port = port, replay_port
        self._static = frozenset(static)
        # Replaced whole, never mutated: the event loop reads it while a thread syncs.
        self._current: dict[str, str] = {}
        self._lock = threading.Lock()
        # What the last sync wanted, and when a sync of that same set may run again: a
        # subscription that keeps failing is retried every retry_s, not on every request.
        self._tried: dict[str, str] = {}
        self._retry_at = 0.0
        self.retry_s = retry_s

    @property
    def subscribed(self) -> dict[str, str]:
        return dict(self._current)

    def wanted(self, endpoints: Iterable[str]) -> dict[str, str]:
        want = wanted_subscriptions(endpoints, self.port, self.replay_port)
        return {b: spec for b, spec in want.items() if b not in self._static}

    def sync(self, endpoints: Iterable[str]) -> None:
        """Reconciles the subscriptions with `endpoints`. Blocks while a vanished engine's
        thread stops (a fraction of a second); never raises: an engine that could not be
        subscribed is tried again on the next sync."""
        wanted = self.wanted(endpoints)
        with self._lock:
            current = dict(self._current)
            for backend, spec in list(current.items()):
                if wanted.get(backend) != spec:
                    self._unsubscribe(backend)
                    del current[backend]
            for backend, spec in wanted.items():
                if backend not in current and self._subscribe(backend, spec):
                    current[backend] = spec
            self._current = current
            self._tried, self._retry_at = wanted, time.monotonic() + self.retry_s

    def _subscribe(self, backend: str, spec: str) -> bool:
        try:
            self.router.subscribe(backend, *split_spec(spec))
        except Exception:  # a bad address must not stop the others
            log.exception("cannot subscribe to the KV events of %s at %s", backend, spec)
            return False
        log.info("subscribed to the KV events of %s at %s", backend, spec)
        return True

    def _unsubscribe(self, backend: str) -> None:
        try:
            self.router.unsubscribe(backend)
        except Exception:
            log.exception("stopping the KV events of %s failed", backend)
            return
        log.info("unsubscribed from the KV events of %s", backend)

    async def refresh(self, endpoints: Iterable[str]) -> None:
        """`sync` off the event loop, and only when the set changed: the usual call costs
        one comparison. Never raises."""
        endpoints = list(endpoints)
        try:
            wanted = self.wanted(endpoints)
            if wanted == self._current:
                return
            if wanted == self._tried and time.monotonic() < self._retry_at:
                return  # this very set was synced a moment ago: some engine failed
            await asyncio.to_thread(self.sync, endpoints)
        except Exception:
            log.exception("following the KV event endpoints failed")


def subscribe_all(
    router: KVCosts,
    events: dict[str, str],
    events_port: Optional[int] = None,
    events_replay_port: Optional[int] = None,
) -> Optional[KVFeeds]:
    """Subscribes `router` to the fixed endpoints of `events` (HOST:PORT -> its engine's
    events address) and, with `events_port`, returns the feeds that follow the endpoint set
    (their `refresh` keeps one subscription per engine listed; None without it)."""
    static = {normalize_host_port(target): spec for target, spec in events.items()}
    for target, spec in static.items():
        router.subscribe(target, *split_spec(spec))
    if not events_port:
        return None
    return KVFeeds(router, events_port, events_replay_port, static)
