"""Runs the engine's step loop on a background thread and streams outputs to asyncio.

The HTTP server lives on the event loop; the model runs on one engine thread. New requests
and aborts are handed over through a lock-protected inbox; a step's outputs come back
through one `loop.call_soon_threadsafe` into one asyncio queue per request. A reader that
falls behind the engine gets everything waiting for it at once: one output per step would
make a slow reader slower (one SSE event, one send per token).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from dataclasses import replace
from typing import AsyncIterator, Callable, Optional

from pdpool.engine.engine_core import LLMEngine, RequestOutput

log = logging.getLogger("pdpool.engine")


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: list[Callable[[], None]] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self.last_tick = time.monotonic()  # the engine loop's last sign of life
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # --- called from the event loop -----------------------------------------------------
    async def generate(
        self, request_id: str, add: Callable[[], object]
    ) -> AsyncIterator[list[RequestOutput]]:
        """Queues `add()` (which adds the request to the engine, on the engine thread) and
        yields its outputs, as lists of all those that are waiting (one or more, in order;
        `merge_deltas` makes one of them). Leaving the iterator early aborts the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, queue)
        added = loop.create_future()

        def do_add():
            try:
                add()
                loop.call_soon_threadsafe(_set_result, added, None)
            except Exception as exc:  # validation errors surface to the caller
                self._streams.pop(request_id, None)
                loop.call_soon_threadsafe(_set_exception, added, exc)

        self._submit(do_add)
        finished = False
        try:
            await added
            while True:
                batch = [await queue.get()]
                while not queue.empty() and _more_may_follow(batch[-1]):
                    batch.append(queue.get_nowait())
                if isinstance(batch[-1], BaseException):
                    if len(batch) > 1:
                        yield batch[:-1]
                    raise batch[-1]
                yield batch
                if batch[-1].finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self.engine.abort_request(request_id))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def readiness(self, max_stall_s: float) -> Optional[str]:
        """None when ready; else why not: the engine thread died, or it has work and its
        loop has not ticked for `max_stall_s` (a step that hangs)."""
        if not self.alive:
            return "the engine loop has stopped"
        stalled = time.monotonic() - self.last_tick
        if stalled > max_stall_s and (self._inbox or self.engine.has_unfinished()):
            return f"the engine loop has not ticked for {stalled:.1f}s while it has work"
        return None

    def shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=10)
        self.engine.close()

    # --- the engine thread --------------------------------------------------------------
    def _submit(self, fn: Callable[[], None]) -> None:
        with self._cv:
            self._inbox.append(fn)
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                self.last_tick = time.monotonic()
                while not self._inbox and not self._stopping and not self.engine.has_unfinished():
                    self._cv.wait(timeout=0.05)
                    self.last_tick = time.monotonic()
                    self.engine.idle_tick()  # connector housekeeping while idle
                if self._stopping:
                    return
                inbox, self._inbox = self._inbox, []
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
            self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # One wake-up of each event loop per step, not one per output: every
        # call_soon_threadsafe writes to the loop's self-pipe.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        now = time.monotonic()
        for out in outputs:
            out.produced_at = now
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, message: str) -> None:
        # Nobody to blame: /health reports it until a model forward succeeds again.
        self.engine.fault = message
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
            stream = self._streams.get(rid)
            if stream is not None:
                stream[0].call_soon_threadsafe(stream[1].put_nowait, RuntimeError(message))


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


def _more_may_follow(item: object) -> bool:
    return isinstance(item, RequestOutput) and not item.finished


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
