"""Free TCP ports on 127.0.0.1 for the processes this machine starts: `pdpool up`'s
children, the dev tools' clusters and engines, the tests' servers.

A port is free when it is asked for; another process may take it before it is bound, so
callers that can retry on "address already in use" do.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def free_ports(n: int) -> list[int]:
    """n distinct free ports (held together while chosen: never the same twice; not port+1,
    which another process may hold)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
