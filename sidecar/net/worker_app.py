"""The ASGI wrapper of one worker of several (workers.py): GET /metrics answers the sum
over every worker, and a Unix socket in the workers' private folder hands this worker's
own metrics to the others. Everything else goes to the app untouched."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Callable, Optional

from .asgi import Message, Receive, Scope, Send, send_bytes
from .metrics import CONTENT_TYPE_LATEST
from .metrics_merge import merge_expositions
from .workers import Worker

SIBLING_TIMEOUT_S = 2.0


class WorkerApp:
    def __init__(self, app: Any, worker: Worker, render: Callable[[], bytes]) -> None:
        self.app = app
        self.worker = worker
        self.render = render
        self._server: Optional[asyncio.AbstractServer] = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, self._lifespan_send(send))
        elif scope["type"] == "http" and scope["path"] == "/metrics" and scope["method"] == "GET":
            await send_bytes(send, 200, await self.all_metrics(), content_type=CONTENT_TYPE_LATEST)
        else:
            await self.app(scope, receive, send)

    def _lifespan_send(self, send: Send) -> Send:
        """The app's lifespan messages, with this worker's metrics socket opened once the
        app has started and closed before it reports having stopped."""

        async def lifespan_send(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                await self._open()
            elif message["type"] == "lifespan.shutdown.complete":
                await self._close()
            await send(message)

        return lifespan_send

    async def _open(self) -> None:
        self._server = await asyncio.start_unix_server(
            self._hand_over, self.worker.metrics_socket(self.worker.index)
        )

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _hand_over(self, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            writer.write(self.render())
            await writer.drain()
        writer.close()

    async def all_metrics(self) -> bytes:
        """This worker's metrics plus every sibling's that answers (one still starting has
        counted nothing yet)."""
        siblings = await asyncio.gather(
            *(self._sibling(self.worker.metrics_socket(i)) for i in self.worker.siblings)
        )
        texts = [self.render().decode()] + [t for t in siblings if t is not None]
        return merge_expositions(texts)

    @staticmethod
    async def _sibling(path: str) -> Optional[str]:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(path), SIBLING_TIMEOUT_S
            )
        except (OSError, asyncio.TimeoutError):
            return None
        try:
            return (await asyncio.wait_for(reader.read(), SIBLING_TIMEOUT_S)).decode()
        except (OSError, asyncio.TimeoutError):
            return None
        finally:
            writer.close()
