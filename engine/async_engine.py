"""Runs the engine's step loop on a thread and streams its outputs to asyncio.

The step loop (EngineLoop) takes new requests and aborts through a lock-protected inbox and
hands each step's outputs to a sink. AsyncEngine runs it on a thread of the server's own
process: the sink wakes the event loop once per step and fills one asyncio queue per
request. engine_process.py runs the same loop in a process of its own; EngineClient is the one
interface the server calls either way.

A reader that falls behind the engine gets everything waiting for it at once: one output
per step would make a slow reader slower (one SSE event, one send per token).
"""

from __future__ import annotations

import abc
import asyncio
import functools
import logging
import threading
import time
import traceback
from dataclasses import replace
from typing import TYPE_CHECKING, Any, AsyncGenerator, Callable, Iterable, Optional, Protocol, Union

from pdpool.engine.lora.registry import LoRARef
from pdpool.engine.outputs import RequestOutput
from pdpool.engine.engine_state import (
    EngineView,
    LiveEngineView,
    admission_problem,
    compile_holdup,
)
from pdpool.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # for annotations only: the server process never imports torch
    from pdpool.engine.engine_core import LLMEngine

log = logging.getLogger("pdpool.engine")


class NewRequest(Protocol):
    """The arguments of one `LLMEngine.add_request` (the server's ChoiceRequest and the core's
    AddRequest are ones: frozen dataclasses, hence read-only members)."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_ids(self) -> list[int]: ...

    @property
    def params(self) -> SamplingParams: ...

    @property
    def cache_salt(self) -> Optional[str]: ...

    @property
    def cache_hit_threshold(self) -> Optional[float]: ...

    @property
    def kv_transfer_params(self) -> Optional[dict[str, Any]]: ...

    @property
    def priority(self) -> int: ...

    @property
    def lora(self) -> Optional[LoRARef]: ...


# What a request's queue carries: its outputs, or the exception that ended it.
StreamItem = Union[RequestOutput, BaseException]


def add_to_engine(engine: LLMEngine, spec: NewRequest, compiled_grammar: Any = None) -> None:
    engine.add_request(
        spec.request_id,
        spec.prompt_ids,
        spec.params,
        cache_salt=spec.cache_salt,
        cache_hit_threshold=spec.cache_hit_threshold,
        kv_transfer_params=spec.kv_transfer_params,
        compiled_grammar=compiled_grammar,
        priority=spec.priority,
        lora=spec.lora,
    )


def admit(
    engine: LLMEngine,
    spec: NewRequest,
    add: Callable[[Any], None],
    refuse: Callable[[Exception], None],
) -> None:
    """Hands `spec` to `add` (with its compiled grammar, or None when unguided) once it can
    join the engine; a guided spec compiles first, off the caller's thread (`refuse` gets
    why it cannot). Never blocks: the caller goes on reading aborts and other requests."""
    guided = spec.params.guided
    if guided is None:
        add(None)
    else:
        engine.grammar_jobs.submit(spec.request_id, guided, add, refuse)


class OutputSink(Protocol):
    def outputs(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs (possibly none); called on the engine thread after every step."""

    def failed(self, request_ids: list[str], message: str) -> None:
        """Requests ended by an engine-wide failure of a step."""

    def idle(self) -> None:
        """The loop is waiting for work (called about every 50 ms meanwhile)."""


class EngineLoop:
    """The engine's step loop on its own thread."""

    def __init__(self, engine: LLMEngine, sink: OutputSink):
        self.engine, self.sink = engine, sink
        self._cv = threading.Condition()
        self._inbox: list[Callable[[], None]] = []
        self._stopping = False
        self.last_tick = time.monotonic()  # the loop's last sign of life
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        with self._cv:
            self._inbox.append(fn)
            self._cv.notify()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def readiness(self, max_stall_s: float) -> Optional[str]:
        """None when ready; else why not: the loop's thread died, or it has work and has not
        ticked for `max_stall_s` (a step that hangs)."""
        if not self.alive:
            return "the engine loop has stopped"
        stalled = time.monotonic() - self.last_tick
        if stalled > max_stall_s and (self._inbox or self.engine.has_unfinished()):
            return f"the engine loop has not ticked for {stalled:.1f}s while it has work"
        return admission_problem(*compile_holdup(self.engine), max_stall_s)

    def shutdown(self) -> None:
        """Stops the loop and closes the engine (once; later calls do nothing)."""
        with self._cv:
            if self._stopping:
                return
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=10)
        self.engine.close()

    def _loop(self) -> None:
        while True:
            with self._cv:
                self.last_tick = time.monotonic()
                waited = not self._inbox and not self._stopping and not self.engine.has_unfinished()
                if waited:
                    self._cv.wait(timeout=0.05)
                    self.last_tick = time.monotonic()
                if self._stopping:
                    return
                inbox, self._inbox = self._inbox, []
            # Outside the lock: a sink may block on a pipe, and `submit` must never wait on it.
            if waited:
                self.engine.idle_tick()  # connector housekeeping while idle
                self.sink.idle()
            for fn in inbox:
                fn()
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # keep serving: fail what was in flight, not the server
                log.error("engine step failed: %s\n%s", exc, traceback.format_exc())
                self._fail_all(f"engine error: {exc}")
                continue
            if self.engine.last_step_idle:
                time.sleep(0.001)  # only remote loads in flight: do not spin
            now = time.monotonic()
            for out in outputs:
                out.produced_at = now
            self.sink.outputs(outputs)

    def _fail_all(self, message: str) -> None:
        # Nobody to blame: /health reports it until a model forward succeeds again.
        self.engine.fault = message
        failed = list(self.engine.requests)
        for rid in failed:
            self.engine.abort_request(rid)
        self.sink.failed(failed, message)


class EngineClient(abc.ABC):
    """What the server calls, wherever the engine runs: AsyncEngine (a thread of this
    process) or EngineProcess (a core process of its own). The asyncio side of requests in
    flight is shared: one queue per request, read by `generate`."""

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


class AsyncEngine(EngineClient):
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


def mergeable_runs(outputs: list[RequestOutput]) -> list[list[RequestOutput]]:
    """Consecutive outputs cut where tokens whose text is held back (an incomplete UTF-8
    sequence, a possible stop string) follow tokens whose text was emitted, and before an
    error. A merged output with text then covers its tokens' text as a single one does, which
    a reader that takes them as complete relies on (the gateway resumes a broken stream after
    those tokens); the tokens before an error are sent before it."""
    runs: list[list[RequestOutput]] = []
    run: list[RequestOutput] = []
    run_has_text = False
    for out in outputs:
        if run and (out.finish_reason == "error" or (run_has_text and not out.new_text)):
            runs.append(run)
            run, run_has_text = [], False
        run.append(out)
        run_has_text = run_has_text or bool(out.new_text)
    runs.append(run)
    return runs


def merge_deltas(outputs: list[RequestOutput]) -> RequestOutput:
    """One output for consecutive outputs of one request: their new text, token ids and
    logprobs joined; everything else (counts, finish, errors, times) as of the last."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    logprobs = None
    if any(o.logprobs for o in outputs):
        logprobs = [lp for o in outputs for lp in (o.logprobs or ())]
    return replace(
        last,
        new_text="".join(o.new_text for o in outputs),
        new_token_ids=[t for o in outputs for t in o.new_token_ids],
        logprobs=logprobs,
    )


def _put_all(items: list[tuple[asyncio.Queue[StreamItem], StreamItem]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
