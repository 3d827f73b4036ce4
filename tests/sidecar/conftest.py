"""Fixtures: serve ASGI apps on real sockets (ephemeral ports) inside the test's loop."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import uvicorn


class Served:
    def __init__(self, app, server: uvicorn.Server, task: asyncio.Task):
        self.app, self.server, self.task = app, server, task
        sock = server.servers[0].sockets[0]
        self.port = sock.getsockname()[1]
        self.host_port = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.host_port}"

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(self.task, 5)


async def serve(app, port: int = 0) -> Served:
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="on",
        access_log=False,
        timeout_graceful_shutdown=1,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    return Served(app, server, task)


@pytest.fixture
async def servers():
    """Call `await servers(app)` to serve an app; all are stopped after the test."""
    started: list[Served] = []

    async def start(app, port: int = 0) -> Served:
        s = await serve(app, port)
        started.append(s)
        return s

    yield start
    for s in reversed(started):
        await s.stop()
