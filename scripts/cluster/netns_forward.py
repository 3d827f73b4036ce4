"""Forwards TCP ports of the host (where it starts) to addresses inside another network
namespace: the single-node cluster runs in a private one (scripts/cluster/node.sh), so
that its bridge, firewall and net sysctls never touch the host's, and the host reaches its
API server (and anything else inside) only through these listeners.

    python3 netns_forward.py NETNS_PATH LISTEN_HOST:PORT=TARGET_HOST:PORT [...]

Listeners are opened in the host's namespace first; the process then enters NETNS_PATH,
so every outgoing connection starts inside it. Prints `ready` once it listens."""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import sys
import threading

CLONE_NEWNET = 0x40000000


def enter_netns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {path}")
    finally:
        os.close(fd)


def pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def serve(listener: socket.socket, target: tuple[str, int]) -> None:
    while True:
        client, _ = listener.accept()
        try:
            upstream = socket.create_connection(target, timeout=10)
            upstream.settimeout(None)
        except OSError:
            client.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=pipe, args=(a, b), daemon=True).start()


def split(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    return host, int(port)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    routes = []
    for spec in argv[1:]:
        listen, _, target = spec.partition("=")
        listener = socket.create_server(split(listen), reuse_port=False)
        routes.append((listener, split(target)))
    enter_netns(argv[0])
    threads = [threading.Thread(target=serve, args=r, daemon=True) for r in routes]
    for t in threads:
        t.start()
    print("ready", flush=True)
    for t in threads:
        t.join()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
