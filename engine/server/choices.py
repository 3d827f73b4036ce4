"""The engine side of one answer: its choices' engine requests, started together so that they
share steps, then collected (a whole response) or pumped (a stream), and always closed; and
the race of the work before the first token against a client that goes away."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncGenerator, Awaitable, Callable, Optional, Sequence, TypeVar

from fastapi import Request

from pdpool.engine.core_client import EngineClient
from pdpool.engine.outputs import merge_deltas, mergeable_runs
from pdpool.engine.outputs import RequestOutput, TokenLogprob
from pdpool.engine.server.errors import client_closed, engine_error, output_error
from pdpool.engine.server.metrics import EngineMetrics
from pdpool.engine.server.translator import ChoiceRequest

T = TypeVar("T")
LogprobsFormatter = Callable[[list[TokenLogprob]], dict[str, Any]]
Outputs = AsyncGenerator[RequestOutput, None]
# An answer's outputs, choice by choice as they come: (choice, output or the error that ended it).
Pumped = AsyncGenerator[tuple["Choice", "RequestOutput | Exception"], None]


async def until_disconnect(http_req: Request, work: Awaitable[T], metrics: EngineMetrics) -> T:
    """Awaits `work` (preparation, or the first outputs: a request that waits in the
    queue or prefills) unless the client goes away first: then `work` is cancelled,
    which aborts its engine requests (a queued one is never computed), and the
    disconnect is counted. Call only once the body has been read."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await http_req.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if watcher.done() and not watcher.cancelled():
                metrics.client_disconnected("waiting")
                raise client_closed()
    return task.result()


async def first_output(stream: Outputs) -> RequestOutput:
    """Pulls the first output so that validation errors become a 400 (or the error's
    own status) before any bytes."""
    try:
        first = await stream.__anext__()
    except Exception as exc:
        raise engine_error(exc) from exc
    if first.finish_reason == "error":
        raise output_error(first)
    return first


class Choice:
    """One engine request behind one choice of the answer, and what it produced so far."""

    def __init__(
        self,
        spec: ChoiceRequest,
        first: RequestOutput,
        stream: Outputs,
        format_logprobs: LogprobsFormatter,
    ):
        self.index, self.first_of_prompt = spec.index, spec.first_of_prompt
        self.request_id = spec.request_id
        self.first, self.stream, self.format_logprobs = first, stream, format_logprobs
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict[str, Any]] = []
        self.last: RequestOutput = first
        # Its prompt's logprobs, when asked: the first choice of the prompt computes them.
        self.prompt_logprobs: Optional[list[TokenLogprob]] = first.prompt_logprobs

    def absorb(self, out: RequestOutput) -> Optional[dict[str, Any]]:
        """Records one output; returns the logprobs of its tokens, if asked."""
        self.last = out
        self.text.append(out.new_text)
        self.token_ids.extend(out.new_token_ids)
        if not out.logprobs:
            return None
        lp = self.format_logprobs(out.logprobs)
        self.logprobs.append(lp)
        return lp


class ChoiceRunner:
    """Runs the engine requests of an answer's choices and observes their latencies."""

    def __init__(self, aengine: EngineClient, metrics: EngineMetrics) -> None:
        self.aengine, self.metrics = aengine, metrics

    def _submit(self, spec: ChoiceRequest, t_arrival: float) -> Outputs:
        """The output iterator of one engine request (added when first awaited)."""
        return self._observed(self.aengine.generate(spec), t_arrival, spec.priority)

    async def _observed(
        self,
        batches: AsyncGenerator[list[RequestOutput], None],
        t_arrival: float,
        priority: int,
    ) -> Outputs:
        """Few outputs per batch of those waiting, after every one of them is observed in the
        latency metrics as of the step that made it (so a reader that falls behind does not
        skew them). A first output that is an error becomes the HTTP error, not a latency."""
        t_last, n = t_arrival, 0
        try:
            async for batch in batches:
                for out in batch:
                    if n or out.finish_reason != "error":
                        since, e2e = out.produced_at - t_last, out.produced_at - t_arrival
                        self.metrics.observe_output(out, n == 0, since, e2e, priority)
                    t_last, n = out.produced_at, n + 1
                for run in mergeable_runs(batch):
                    yield merge_deltas(run)
        finally:
            await batches.aclose()

    async def start(
        self, specs: list[ChoiceRequest], new_logprobs_formatter: Callable[[], LogprobsFormatter]
    ) -> list[Choice]:
        """Submits every choice and waits for all their first outputs: an error in any
        becomes the answer's HTTP error, and closes the others."""
        t_arrival = time.monotonic()
        streams = [self._submit(spec, t_arrival) for spec in specs]
        try:
            results: list[RequestOutput | BaseException] = []
            if len(specs) > 1 and specs[1].after_first_choice:
                results.append(await first_output(streams[0]))
            # the rest all at once, so that they share steps
            results += await asyncio.gather(
                *(first_output(s) for s in streams[len(results) :]), return_exceptions=True
            )
            firsts: list[RequestOutput] = []
            for first in results:
                if isinstance(first, BaseException):
                    raise first
                firsts.append(first)
        except BaseException:
            for stream in streams:
                await stream.aclose()
            raise
        choices = [
            Choice(spec, first, stream, new_logprobs_formatter())
            for spec, first, stream in zip(specs, firsts, streams, strict=True)
        ]
        for c in choices:  # a prompt's choices are listed together, its first one first
            if c.first_of_prompt:
                shared = c.prompt_logprobs
            c.prompt_logprobs = shared
        return choices

    async def outputs(self, c: Choice) -> Outputs:
        """A choice's outputs from its first on."""
        out = c.first
        while True:
            yield out
            if out.finished:
                return
            out = await c.stream.__anext__()

    async def run_to_end(self, http_req: Request, choices: list[Choice]) -> None:
        """Collects a non-streaming answer; a client that goes away aborts it."""

        async def collect(c: Choice) -> None:
            try:
                async for out in self.outputs(c):
                    c.absorb(out)
                    if out.finish_reason == "error":
                        raise output_error(out)
            except Exception as exc:  # the engine failed it after its first output
                raise engine_error(exc) from exc

        tasks = [asyncio.ensure_future(collect(c)) for c in choices]
        try:
            while True:
                done, pending = await asyncio.wait(
                    tasks, timeout=0.5, return_when=asyncio.FIRST_EXCEPTION
                )
                for t in done:
                    exc = t.exception()
                    if exc is not None:
                        raise exc
                if not pending:
                    return
                if await http_req.is_disconnected():
                    self.metrics.client_disconnected("running")
                    raise client_closed()
        finally:
            await self.close(choices, tasks)

    def pump(self, choices: list[Choice]) -> tuple[Pumped, list[asyncio.Task[None]]]:
        """Every choice's outputs as (choice, output), in the order they come, and the tasks
        that pump them (for `close`); a choice that fails gives (choice, exception) and
        stops. One choice is read in place: no task and no second queue per token."""
        if len(choices) == 1:
            return self._read_one(choices[0]), []
        queue: asyncio.Queue[tuple[Choice, RequestOutput | Exception]] = asyncio.Queue()

        async def pump_one(c: Choice) -> None:
            async for item in self._read_one(c):
                queue.put_nowait(item)

        async def read_queue() -> Pumped:
            while True:
                yield await queue.get()

        return read_queue(), [asyncio.ensure_future(pump_one(c)) for c in choices]

    async def _read_one(self, c: Choice) -> Pumped:
        try:
            async for out in self.outputs(c):
                yield c, out
        except Exception as exc:
            yield c, exc

    async def close(self, choices: list[Choice], tasks: Sequence[asyncio.Future[Any]]) -> None:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in choices:
            await c.stream.aclose()  # aborts the ones still running
