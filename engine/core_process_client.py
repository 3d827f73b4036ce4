"""What the server calls when its engine core runs in a process of its own (the default),
as vLLM's AsyncMPClient: requests go out as messages, outputs come back on the server's
event loop, and a core that dies is replaced.

CoreProcessClient is the engine client (core_client.EngineClient) of a core running in a
process of its own (core_process.py). Load is never taken for death: only the core's exit
(its end of the channel closes) is. A core that stops ticking while it has work fails
readiness (a stall), not liveness.

When the core dies (killed, out of memory, a crash), the server fails the requests in flight
(503 before their first token, an error event in a stream, so that a gateway migrates it) and
starts a new core in place; requests meanwhile get 503. A core that keeps dying
(MAX_RESTARTS within RESTART_WINDOW_S) or cannot start again makes the server exit with a
non-zero status, for its supervisor (`pdpool up`, the kubelet) to restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Optional

from pdpool.engine.core_channel import ChannelClosed, CoreChannel
from pdpool.engine.core_client import EngineClient
from pdpool.engine.core_loop import NewRequest
from pdpool.engine.core_messages import (
    AbortRequest,
    AddRequest,
    EngineFacts,
    Heartbeat,
    LeaseReleased,
    ReleaseLease,
    RequestRefused,
    RequestsFailed,
    StepOutputs,
)
from pdpool.engine.core_process import CoreProcess, EngineStartError
from pdpool.engine.engine_state import EngineState, admission_problem
from pdpool.engine.outputs import EngineUnavailable

if TYPE_CHECKING:  # for annotations only: the server process never imports torch
    from pdpool.engine.config import EngineConfig

log = logging.getLogger("pdpool.engine")

# Restarts in place before the server gives up and exits for its supervisor.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 300.0


class EngineMirror:
    """The server's view of its engine core: the facts, the tokenizer (loaded here too),
    and the state the core last sent."""

    def __init__(self, config: EngineConfig, facts: EngineFacts, state: EngineState):
        from pdpool.engine.model_info import read_model_info
        from pdpool.engine.server.text_tokenizer import TextTokenizer

        self.config, self.info = config, read_model_info(config.model)
        self.tokenizer = TextTokenizer(self.info.path)
        self.use(facts, state)

    def use(self, facts: EngineFacts, state: EngineState) -> None:
        """The facts and first state of a (re)started core."""
        self.facts = facts
        self.model_name, self.max_model_len = facts.model_name, facts.max_model_len
        self.kv_capacity_tokens = facts.kv_capacity_tokens
        self.kv_fingerprint = facts.kv_fingerprint
        self.latest = state

    def state(self) -> EngineState:
        return self.latest

    @property
    def fault(self) -> Optional[str]:
        return self.latest.fault


class CoreProcessClient(EngineClient):
    """The engine core in a child process, behind the engine-client interface; restarted in
    place when it dies. `attach` it to the server's event loop before serving."""

    view: EngineMirror

    def __init__(self, config: EngineConfig, log_level: str = "info"):
        super().__init__()
        self.config, self.log_level = config, log_level
        try:
            self._core = CoreProcess.start(config, log_level)
        except ModuleNotFoundError as exc:
            raise EngineStartError(str(exc)) from exc
        self.view = EngineMirror(config, self._core.facts, self._core.first_state)
        self._calls: dict[int, asyncio.Future[bool]] = {}
        self._next_call = 0
        self._last_heard = time.monotonic()
        self._gone: Optional[str] = None  # why no core serves now (None: one does)
        self._restarts: deque[float] = deque()
        self._restarting: Optional[asyncio.Task[None]] = None  # held: a task needs a reference
        self._stopping = False
        self.fatal: Optional[str] = None  # set when the server must exit for its supervisor
        # How the server is told to stop (serve_cli sets it; a SIGTERM elsewhere).
        self.stop_server: Callable[[], None] = functools.partial(
            signal.raise_signal, signal.SIGTERM
        )
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._open(self._core)

    async def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Delivers the core's messages on `loop` (the server's) from now on."""
        self._loop = loop
        channel = self._core.channel
        if channel is not None and channel.closed:  # the core died before the server served
            self._lost(self._core, "the engine core exited before the server started")

    def _open(self, core: CoreProcess) -> None:
        core.open(
            functools.partial(self._from_reader, core),
            functools.partial(self._closed_from_reader, core),
        )

    # --- requests -----------------------------------------------------------------------
    def _channel(self) -> CoreChannel:
        if self._gone is not None:
            raise EngineUnavailable(self._gone)
        assert self._core.channel is not None
        return self._core.channel

    def _send(self, msg: object) -> None:
        try:
            self._channel().send(msg)
        except ChannelClosed as exc:
            raise EngineUnavailable(f"the engine core is gone: {exc}") from exc

    async def _send_add(self, spec: NewRequest) -> None:
        msg = AddRequest(
            spec.request_id,
            spec.prompt_ids,
            spec.params,
            spec.cache_salt,
            spec.cache_hit_threshold,
            spec.kv_transfer_params,
            spec.priority,
            spec.lora,
        )
        try:
            # Backpressure: a request waits here while the channel holds too much unsent.
            await self._channel().wait_room_async()
            self._send(msg)
        except EngineUnavailable as exc:
            self._put([(spec.request_id, exc)])

    def abort(self, request_id: str) -> None:
        with contextlib.suppress(EngineUnavailable):  # the core is gone, and its requests
            self._send(AbortRequest(request_id))

    async def release_lease(self, params: dict[str, Any]) -> bool:
        call_id, self._next_call = self._next_call, self._next_call + 1
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self._send(ReleaseLease(call_id, params))
            return bool(await asyncio.wait_for(fut, timeout=30))
        finally:
            self._calls.pop(call_id, None)

    # --- health -------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._gone is None and self._core.is_alive()

    def readiness(self, max_stall_s: float) -> Optional[str]:
        if self._gone is not None:
            return self._gone
        if not self._core.is_alive():
            return f"the engine core has exited (code {self._core.exitcode})"
        stalled = time.monotonic() - self._last_heard
        if stalled > max_stall_s and (self._streams or self.view.latest.has_work):
            return f"the engine loop has not ticked for {stalled:.1f}s while it has work"
        latest = self.view.latest
        return admission_problem(latest.admission_holdup_s, latest.admission_holdup, max_stall_s)

    def shutdown(self) -> None:
        """Stops the engine core (once; later calls do nothing)."""
        if self._stopping:
            return
        self._stopping = True
        self._core.stop()

    # --- the core's messages ------------------------------------------------------------
    def _from_reader(self, core: CoreProcess, msgs: list[Any]) -> None:
        """On the channel's reader thread: hands the batch to the event loop."""
        loop = self._loop
        if loop is None:  # not serving yet: only the gauges matter
            for msg in msgs:
                if isinstance(msg, (StepOutputs, Heartbeat)):
                    self.view.latest = msg.state
            return
        if not loop.is_closed():
            loop.call_soon_threadsafe(self._handle_all, core, msgs)

    def _closed_from_reader(self, core: CoreProcess, why: str) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._lost, core, why)

    def _handle_all(self, core: CoreProcess, msgs: list[Any]) -> None:
        if core is not self._core:
            return  # a message of a core that was replaced
        self._last_heard = time.monotonic()
        for msg in msgs:
            self._handle(msg)

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, StepOutputs):
            self.view.latest = msg.state
            if msg.outputs:
                self._put([(out.request_id, out) for out in msg.outputs])
        elif isinstance(msg, Heartbeat):
            self.view.latest = msg.state
        elif isinstance(msg, RequestsFailed):
            self.view.latest = msg.state
            self._put([(rid, RuntimeError(msg.message)) for rid in msg.request_ids])
        elif isinstance(msg, RequestRefused):
            self._put([(msg.request_id, msg.exception())])
        elif isinstance(msg, LeaseReleased):
            fut = self._calls.get(msg.call_id)
            if fut is not None and not fut.done():
                fut.set_result(msg.released)

    # --- death and restart --------------------------------------------------------------
    def _lost(self, core: CoreProcess, why: str) -> None:
        """The core's channel closed: the core is gone (or useless: it is killed). Fail
        everything in flight, then start a new core."""
        if core is not self._core or self._gone is not None or self._stopping:
            return
        core.kill()
        self._gone = f"the engine core exited (code {core.exitcode}); it is being restarted"
        log.error("%s (%s)", self._gone, why)
        lost = EngineUnavailable(f"the engine core exited (code {core.exitcode})")
        self._put([(rid, lost) for rid in list(self._streams)])
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineUnavailable(self._gone))
        self._restarting = asyncio.ensure_future(self._restart())

    def _may_restart(self) -> bool:
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > RESTART_WINDOW_S:
            self._restarts.popleft()
        self._restarts.append(now)
        return len(self._restarts) <= MAX_RESTARTS

    async def _restart(self) -> None:
        if not self._may_restart():
            self._give_up(
                f"the engine core died {len(self._restarts)} times within {RESTART_WINDOW_S:.0f}s"
            )
            return
        t0 = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            core = await loop.run_in_executor(None, CoreProcess.start, self.config, self.log_level)
        except Exception as exc:
            self._give_up(f"the engine core could not start again: {exc}")
            return
        if self._stopping:
            core.stop()
            return
        self._core = core
        self.view.use(core.facts, core.first_state)
        self._last_heard = time.monotonic()
        self._open(core)
        self._gone = None
        log.warning(
            "a new engine core serves, %.1fs after the last one died", time.monotonic() - t0
        )

    def _give_up(self, why: str) -> None:
        """The server exits (non-zero) so that its supervisor starts it afresh."""
        log.error("%s: the server exits for its supervisor to restart it", why)
        self.fatal = why
        self._gone = why
        if not self._stopping:
            self.stop_server()
