"""What the server calls to run requests, wherever the engine core runs (as vLLM's
v1/engine/core_client.py): EngineClient, the one interface, and InProcessClient, the core's
step loop on a thread of the server's own process (`--no-engine-process`);
core_process_client.CoreProcessClient drives a core process of its own.

The asyncio side is shared: one queue per request, filled once per step (the sink wakes the
event loop once, not once per output). A reader that falls behind the engine gets everything
waiting for it at once: one output per step would make a slow reader slower (one SSE event,
one send per token).
"""

from __future__ import annotations

import abc
import asyncio
import functools
from typing import TYPE_CHECKING, Any, AsyncGenerator, Iterable, Optional, Union

from pdpool.engine.core_loop import EngineLoop, NewRequest, add_to_engine, admit
from pdpool.engine.engine_state import EngineView, LiveEngineView
from pdpool.engine.outputs import RequestOutput

if TYPE_CHECKING:  # for annotations only: the server process never imports torch
    from pdpool.engine.engine_core import LLMEngine


# What a request's queue carries: its outputs, or the exception that ended it.
StreamItem = Union[RequestOutput, BaseException]


class EngineClient(abc.ABC):
    """What the server calls, wherever the engine runs: InProcessClient (the core's loop on a
    thread of this process) or core_process_client.CoreProcessClient (a core process of its
    own). The asyncio side of requests in flight is shared: one queue per request, read by
    `generate`."""

    if TYPE_CHECKING:  # a subclass's attribute or cached property

        @property
        def view(self) -> EngineView:
            """The facts and state the server reads (LiveEngineView or EngineMirror)."""

    def __init__(self) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[StreamItem]]] = {}

    async def attach(self, loop: asyncio.AbstractEventLoop) -> None:  # noqa: B027
        """Called once the server's event loop runs, before it serves. A hook: an engine
        with nothing to start there keeps this one, which does nothing."""

    @abc.abstractmethod
    async def _send_add(self, spec: NewRequest) -> None:
        """Hands the request to the engine; a refusal comes back as an exception in its
        queue (`_put`)."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Ends the request in the engine, if it is still there."""

    @abc.abstractmethod
    async def release_lease(self, params: dict[str, Any]) -> bool:
        """Ends a KV lease this engine granted; False when it was not live."""

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """Liveness: the engine (thread or core process) runs."""

    @abc.abstractmethod
    def readiness(self, max_stall_s: float) -> Optional[str]:
        """None when ready; else why not."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stops the engine (once; later calls do nothing)."""

    async def generate(self, spec: NewRequest) -> AsyncGenerator[list[RequestOutput], None]:
        """Adds the request to the engine and yields its outputs, as lists of all those that
        are waiting (one or more, in order; see `mergeable_runs`). A refusal
        (validation) is raised. Leaving the iterator early aborts the request."""
        queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._streams[spec.request_id] = (asyncio.get_running_loop(), queue)
        await self._send_add(spec)
        finished = False
        try:
            while True:
                # Every output waiting, up to a finished one or an exception.
                batch: list[RequestOutput] = []
                item = await queue.get()
                while isinstance(item, RequestOutput):
                    batch.append(item)
                    if item.finished or queue.empty():
                        break
                    item = queue.get_nowait()
                if isinstance(item, BaseException):
                    if batch:
                        yield batch
                    finished = True  # refused or failed: the engine holds it no more
                    raise item
                yield batch
                if batch[-1].finished:
                    finished = True
                    return
        finally:
            self._streams.pop(spec.request_id, None)
            if not finished:
                self.abort(spec.request_id)

    def _by_loop(
        self, items: Iterable[tuple[str, StreamItem]]
    ) -> dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[StreamItem], StreamItem]]]:
        """(request id, output or exception) pairs grouped by the event loop of their reader."""
        by_loop: dict[
            asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[StreamItem], StreamItem]]
        ] = {}
        for rid, item in items:
            stream = self._streams.get(rid)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], item))
        return by_loop

    def _put(self, items: Iterable[tuple[str, StreamItem]]) -> None:
        """Delivers (request id, output or exception) pairs; on the readers' event loop."""
        for queues in self._by_loop(items).values():
            _put_all(queues)

    def _put_threadsafe(self, items: Iterable[tuple[str, StreamItem]]) -> None:
        # One wake-up of each event loop per step, not one per output: every
        # call_soon_threadsafe writes to the loop's self-pipe.
        for loop, queues in self._by_loop(items).items():
            loop.call_soon_threadsafe(_put_all, queues)


class InProcessClient(EngineClient):
    """The engine on a thread of this process."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__()
        self.engine = engine
        self.loop = EngineLoop(engine, self)

    @functools.cached_property
    def view(self) -> LiveEngineView:
        return LiveEngineView(self.engine)

    async def _send_add(self, spec: NewRequest) -> None:
        def add(compiled: Any) -> None:
            try:
                add_to_engine(self.engine, spec, compiled)
            except Exception as exc:  # validation errors surface to the caller
                self._put_threadsafe([(spec.request_id, exc)])

        def refuse(exc: Exception) -> None:
            self._put_threadsafe([(spec.request_id, exc)])

        admit(self.engine, spec, lambda compiled: self.loop.submit(lambda: add(compiled)), refuse)

    def abort(self, request_id: str) -> None:
        self.engine.grammar_jobs.cancel(request_id)
        self.loop.submit(lambda: self.engine.abort_request(request_id))

    async def release_lease(self, params: dict[str, Any]) -> bool:
        # Thread-safe: it only marks the lease; the engine thread gives the blocks back.
        return self.engine.connector.release_lease(params)

    @property
    def alive(self) -> bool:
        return self.loop.alive

    def readiness(self, max_stall_s: float) -> Optional[str]:
        return self.loop.readiness(max_stall_s)

    def shutdown(self) -> None:
        self.loop.shutdown()

    # --- the sink, on the engine thread -------------------------------------------------
    def outputs(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._put_threadsafe([(out.request_id, out) for out in outputs])

    def failed(self, request_ids: list[str], message: str) -> None:
        self._put_threadsafe([(rid, RuntimeError(message)) for rid in request_ids])

    def idle(self) -> None:
        pass


def _put_all(items: list[tuple[asyncio.Queue[StreamItem], StreamItem]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
