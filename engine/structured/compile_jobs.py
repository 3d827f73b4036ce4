"""Guided requests' grammars compiled off the admission path, each within a deadline.

A guided request's spec compiles on a thread of its own while whoever admits requests (the
core's message reader, or the engine loop on a thread) goes on with aborts, other requests
and lease releases; the request joins the scheduler when its grammar is ready (`ready`
gets the compiled grammar) or is answered when it cannot (`refused`).

Bounds, since a thread inside xgrammar cannot be stopped:
- `slots` compiles run at once; later ones queue (at most `max_queued`) until a slot frees.
- A compile that passes its deadline is refused at the deadline with a 400 (the client
  waits no longer), frees its slot for the next request, and runs on to its end unattended
  (its result lands in the compiler's cache, bounded in bytes); so does one whose request
  was aborted. At most `max_overrun` such compiles run on: while that many do, new guided
  requests get 503 at once (another engine, or a retry, may serve them), and unguided ones
  are not affected at all. `holdup_s` says how long that has lasted (readiness reads it).
- A request still queued at its deadline gets 503: no slot came free, not its own fault.
The spec caps checked in the HTTP process (limits.py) make overruns rare.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from pdpool.engine.outputs import EngineBusy
from pdpool.engine.structured.grammar import GuidedDecodingError
from pdpool.engine.structured.spec import GuidedSpec

Ready = Callable[[Any], None]
Refused = Callable[[Exception], None]


# The least share of its deadline a queued request must have left to start compiling.
MIN_COMPILE_SHARE = 0.25


@dataclass(frozen=True)
class CompileBounds:
    timeout_s: float = 30.0
    slots: int = 2
    max_overrun: int = 2
    max_queued: int = 64

    @classmethod
    def of(cls, config: Any) -> "CompileBounds":
        """The bounds an EngineConfig sets (`pdpool serve --structured-*`)."""
        return cls(
            timeout_s=config.structured_compile_timeout_s,
            slots=config.structured_max_compiles,
            max_overrun=config.structured_max_overrun_compiles,
        )


@dataclass(eq=False)
class _Job:
    request_id: str
    spec: GuidedSpec
    deadline: float
    ready: Ready
    refused: Refused
    state: str = "queued"  # queued -> running -> done, or -> abandoned (runs on unattended)
    answered: bool = False  # the requester has its answer (or was aborted)


class GrammarJobs:
    """Compiles with `compile_fn(spec)` (raising for a spec that cannot compile)."""

    def __init__(
        self,
        compile_fn: Callable[[GuidedSpec], Any],
        bounds: Optional[CompileBounds] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._compile, self._clock = compile_fn, clock
        self.bounds = bounds or CompileBounds()
        self._cv = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._waiting: dict[str, _Job] = {}  # unanswered jobs by request id
        self._active = 0  # running compiles someone waits for (each holds a slot)
        self._overrun = 0  # abandoned compiles still running
        self._saturated_since: Optional[float] = None
        self._closed = False
        threading.Thread(target=self._watch, name="pdpool-grammar-deadlines", daemon=True).start()

    def submit(self, request_id: str, spec: GuidedSpec, ready: Ready, refused: Refused) -> None:
        """Starts (or queues) the compile; exactly one of `ready` / `refused` is called later,
        on another thread, unless the request is cancelled first. Never blocks. `ready` runs
        under this object's lock: it must hand the grammar on (a queue), nothing more."""
        with self._cv:
            busy = self._busy_reason()
            if busy is None:
                job = _Job(request_id, spec, self._clock() + self.bounds.timeout_s, ready, refused)
                self._waiting[request_id] = job
                self._queue.append(job)
                self._start_queued()
                self._cv.notify()
                return
        refused(EngineBusy(busy))

    def cancel(self, request_id: str) -> None:
        """The request was aborted: nobody waits for its grammar any more."""
        with self._cv:
            job = self._waiting.pop(request_id, None)
            if job is not None:
                self._abandon(job)
                self._start_queued()

    def holdup_s(self) -> float:
        """How long new guided requests have been refused because `max_overrun` compiles
        run on unattended (0: they are not)."""
        since = self._saturated_since
        return 0.0 if since is None else self._clock() - since

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    # --- under the lock -----------------------------------------------------------------
    def _busy_reason(self) -> Optional[str]:
        if self._overrun >= self.bounds.max_overrun:
            return (
                f"{self._overrun} grammar compiles have overrun their deadline and still run; "
                "no new guided request is taken until one ends (retry later)"
            )
        if len(self._queue) >= self.bounds.max_queued:
            return f"{len(self._queue)} guided requests wait for a grammar compile (retry later)"
        return None

    def _start_queued(self) -> None:
        now = self._clock()
        while self._queue and self._active < self.bounds.slots:
            job = self._queue.popleft()
            if job.answered:
                continue  # cancelled or timed out while queued
            if job.deadline - now < self.bounds.timeout_s * MIN_COMPILE_SHARE:
                # A slot came free too late to compile in: the watchdog answers it busy
                # now (it waited its time in the queue), not with a 400 for its spec.
                job.deadline = now
                self._cv.notify_all()
                continue
            job.state = "running"
            self._active += 1
            threading.Thread(
                target=self._run, args=(job,), name="pdpool-grammar-compile", daemon=True
            ).start()

    def _abandon(self, job: _Job) -> None:
        """Nobody waits for `job` any more; a running compile gives its slot up and runs on."""
        job.answered = True
        if job.state == "running":
            job.state = "abandoned"
            self._active -= 1
            self._overrun += 1
            self._saturation_changed()

    def _saturation_changed(self) -> None:
        saturated = self._overrun >= self.bounds.max_overrun
        if not saturated:
            self._saturated_since = None
        elif self._saturated_since is None:
            self._saturated_since = self._clock()

    # --- threads ------------------------------------------------------------------------
    def _run(self, job: _Job) -> None:
        compiled: Any = None
        error: Optional[Exception] = None
        try:
            compiled = self._compile(job.spec)
        except Exception as exc:  # the compiler's reason goes back to the client
            error = exc
        with self._cv:
            deliver = job.state == "running"
            if deliver:
                self._active -= 1
                job.answered = True
                self._waiting.pop(job.request_id, None)
                if error is None:
                    # Under the lock: an abort (`cancel`, then the engine's abort) either
                    # comes before this and stops it, or its abort follows this add.
                    job.ready(compiled)
            else:  # abandoned: its overrun ends
                self._overrun -= 1
                self._saturation_changed()
            job.state = "done"
            self._start_queued()
        if deliver and error is not None:
            job.refused(error)

    def _watch(self) -> None:
        """Answers the requests whose deadline passed (the watchdog thread)."""
        while True:
            with self._cv:
                if self._closed:
                    return
                now = self._clock()
                expired = [j for j in self._waiting.values() if j.deadline <= now]
                answers = [(job, self._timeout_error(job)) for job in expired]
                for job in expired:
                    del self._waiting[job.request_id]
                    self._abandon(job)
                self._start_queued()
                if not expired:
                    nearest = min((j.deadline for j in self._waiting.values()), default=now + 1)
                    self._cv.wait(timeout=max(0.01, min(nearest - now, 1.0)))
            for job, error in answers:
                job.refused(error)

    def _timeout_error(self, job: _Job) -> Exception:
        limit = self.bounds.timeout_s
        if job.state == "queued":
            return EngineBusy(f"no grammar compile slot came free within {limit:g}s (retry later)")
        return GuidedDecodingError(
            f"the structured output spec did not compile within {limit:g}s "
            "(--structured-compile-timeout-s); make it smaller or simpler"
        )
