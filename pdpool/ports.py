"""Free TCP ports on 127.0.0.1 for the processes this machine starts: `pdpool up`'s
children, the dev tools' clusters and engines, the tests' servers.

Ports are chosen outside the kernel's ephemeral range (ip_local_port_range). A port the
kernel hands out for an outgoing connection, or to a library that binds port 0 (UCX under
NIXL, ZeroMQ, Envoy), comes from that range, so it can never take a port chosen here
between the choice and the child binding it. Choices are random and never repeated within
a process; another process may still take one, so callers that can retry on "address
already in use" do.
"""

from __future__ import annotations

import random
import socket
from typing import Optional

LOWEST = 10000  # below: well-known and registered services' usual homes
DEFAULT_EPHEMERAL = (32768, 60999)
_handed_out: set[int] = set()


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    try:
        with open(path) as fh:
            lo, hi = (int(x) for x in fh.read().split()[:2])
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return lo, hi


def candidate_ports(ephemeral: tuple[int, int]) -> list[int]:
    """Ports from LOWEST up that the kernel never hands out on its own."""
    lo, hi = ephemeral
    return [p for p in range(LOWEST, 65536) if not lo <= p <= hi]


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free ports (held together while chosen: never the same twice)."""
    candidates = candidate_ports(ephemeral_range())
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        for port in random.sample(candidates, min(len(candidates), 50 * n + 100)):
            if len(ports) == n:
                break
            if port in _handed_out:
                continue
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(port)
        while len(ports) < n:  # no room outside the ephemeral range: let the kernel choose
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    _handed_out.update(ports)
    return ports


def listen_error(host: str, port: int) -> Optional[str]:
    """Why a server could not listen on host:port now (another socket holds it), as one
    line; None when it could (port 0 always can). Bound as servers bind (SO_REUSEADDR), so a
    port left in TIME_WAIT by a server that just stopped counts as free."""
    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None
