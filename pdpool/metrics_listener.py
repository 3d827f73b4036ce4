"""`--metrics-port`: Prometheus metrics on a port of their own, for `pdpool serve`, the
sidecar and the gateway (the EPP has its own HTTP port for them).

A NetworkPolicy admits peers per port, not per path: while /metrics shared the serving
port, every scraper it admitted could also call generation there, past the gateway's keys,
tenants and limits. With --metrics-port, the one server also listens there, and a request
arriving on that port gets only `GET /metrics`; anything else answers 404. The serving
port keeps /metrics too (the gateway's flow control polls the sidecars' there). Unset, the
server listens on its serving port alone, as before.

Imports no torch and no uvicorn at module level: the sidecar's image has no torch, and the
CLI builds its parsers without importing servers.
"""

from __future__ import annotations

import argparse
import json
import socket
from typing import Any, Awaitable, Callable, Optional

from pdpool.errors import CliError

METRICS_PATH = "/metrics"
_NOT_FOUND = json.dumps(
    {
        "error": {
            "message": f"the metrics port serves only GET {METRICS_PATH}",
            "type": "not_found_error",
            "code": 404,
        }
    }
).encode()


def add_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="also listen on this port for GET /metrics alone (anything else: 404), so "
        "that a NetworkPolicy can admit scrapers there and not to the serving port "
        "(default: metrics on the serving port only)",
    )


class MetricsOnly:
    """ASGI wrapper: requests that arrived on `port` may only GET /metrics."""

    def __init__(self, app: Any, port: int) -> None:
        self.app = app
        self.port = port

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Any
    ) -> None:
        if self._refused(scope):
            await _not_found(scope, send)
            return
        await self.app(scope, receive, send)

    def _refused(self, scope: dict[str, Any]) -> bool:
        if scope["type"] not in ("http", "websocket"):
            return False  # lifespan
        server = scope.get("server")
        if not server or server[1] != self.port:
            return False
        return scope["type"] != "http" or (scope["method"], scope["path"]) != ("GET", METRICS_PATH)


async def _not_found(scope: dict[str, Any], send: Any) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(_NOT_FOUND))]
    await send({"type": "http.response.start", "status": 404, "headers": headers})
    await send({"type": "http.response.body", "body": _NOT_FOUND})


def _bind(host: str, port: int) -> socket.socket:
    # What uvicorn.Config.bind_socket does, raising CliError where it would exit.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family=family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CliError(f"cannot listen on {host}:{port}: {exc}") from None
    sock.set_inheritable(True)
    return sock


class Listeners:
    """The serving port and, with a metrics port, that one too: bound here, served by one
    uvicorn server (same app, same TLS settings on both)."""

    def __init__(self, host: str, port: int, metrics_port: Optional[int]) -> None:
        self.metrics_port = metrics_port
        self.sockets: list[socket.socket] = []
        if metrics_port is None:
            return  # uvicorn binds the serving port itself, as before
        if metrics_port == port and port:
            raise CliError("--metrics-port must differ from --port")
        self.sockets = [_bind(host, port)]
        try:
            self.sockets.append(_bind(host, metrics_port))
        except CliError:
            self.close()
            raise
        self.metrics_port = self.sockets[1].getsockname()[1]  # the real one, for port 0

    def wrap(self, app: Any) -> Any:
        return app if self.metrics_port is None else MetricsOnly(app, self.metrics_port)

    def run(self, server: Any) -> None:
        """`server.run()` on the bound sockets (uvicorn.Server)."""
        try:
            server.run(sockets=self.sockets or None)
        finally:
            self.close()

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()
