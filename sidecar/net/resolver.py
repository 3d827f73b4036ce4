"""Host names of upstreams, resolved once and kept, for the lean HTTP/1.1 client.

asyncio resolves a name on every new connection, in a small thread pool shared by all of
them: under a burst of new connections (start-up, a scale-up, an engine that closed its
idle ones) each lookup queues behind the others, and behind a slow DNS server every
stream's first byte would wait for lookups that are not its own. Here a name is looked up
once (concurrent askers share that lookup), kept for `ttl_s`, and after that refreshed in
the background while the old answer is still used: after the first lookup no request
waits for DNS. Address literals (`127.0.0.1`, `::1`) are never looked up.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time

log = logging.getLogger("pdpool.sidecar")


def is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class Resolver:
    def __init__(self, ttl_s: float = 30.0) -> None:
        self.ttl_s = ttl_s
        self._known: dict[tuple[str, int], tuple[float, list[str]]] = {}  # -> (expiry, addrs)
        self._lookups: dict[tuple[str, int], asyncio.Future[list[str]]] = {}

    async def addresses(self, host: str, port: int) -> list[str]:
        """The host's addresses, first to try first. Raises OSError when the name does not
        resolve (and nothing was known of it)."""
        if is_address(host):
            return [host]
        name = (host, port)
        known = self._known.get(name)
        if known is None:
            return await asyncio.shield(self._lookup(name))
        expiry, addresses = known
        if time.monotonic() > expiry:
            self._lookup(name)  # refreshed in the background; the old answer serves now
        return addresses

    def forget(self, host: str) -> None:
        """Drops what is known of `host` (a connection to it failed: it may have moved)."""
        for name in [name for name in self._known if name[0] == host]:
            del self._known[name]

    def _lookup(self, name: tuple[str, int]) -> asyncio.Future[list[str]]:
        """The lookup of `name` in flight, started when there is none."""
        lookup = self._lookups.get(name)
        if lookup is None:
            lookup = self._lookups[name] = asyncio.ensure_future(self._resolve(name))
            lookup.add_done_callback(lambda done: self._finished(name, done))
        return lookup

    def _finished(self, name: tuple[str, int], lookup: asyncio.Future[list[str]]) -> None:
        self._lookups.pop(name, None)
        if not lookup.cancelled():
            lookup.exception()  # a background refresh's failure is not left unretrieved

    async def _resolve(self, name: tuple[str, int]) -> list[str]:
        host, port = name
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            )
        except OSError as exc:
            if name in self._known:  # keep the last good answer through a DNS hiccup
                log.warning("cannot resolve %s again (keeping its last address): %s", host, exc)
                return self._known[name][1]
            raise
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        if not addresses:
            raise OSError(f"{host} resolved to no address")
        self._known[name] = (time.monotonic() + self.ttl_s, addresses)
        return addresses
