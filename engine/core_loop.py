"""The engine core's step loop, on a thread: it takes new requests and aborts through a
lock-protected inbox, steps the engine while it has work, and hands each step's outputs to a
sink. The in-process client (core_client.InProcessClient) and the core process
(core_process.py) run the same loop with their own sinks.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from pdpool.engine.engine_state import admission_problem, compile_holdup
from pdpool.engine.lora.registry import LoRARef
from pdpool.engine.outputs import RequestOutput
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
                # Only loads in flight: do not spin (a tier read's end wakes it).
                self.engine.wait_for_transfers(0.001)
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
