"""The engine core in a process of its own, as vLLM runs its EngineCore: the step loop and
the model never share a GIL with HTTP parsing and SSE writing, so both run at once.

The server process (EngineProcess) and the core process (run_engine_process) exchange the
typed messages of core_messages.py over a CoreChannel (core_channel.py), which owns the
socket's blocking semantics: a large message or a burst waits for the peer, it never fails
while the peer lives. Load is never taken for death: only the core's exit (its end of the
channel closes) is. A core that stops ticking while it has work fails readiness (a stall),
not liveness.

When the core dies (killed, out of memory, a crash), the server fails the requests in flight
(503 before their first token, an error event in a stream, so that a gateway migrates it) and
starts a new core in place; requests meanwhile get 503. A core that keeps dying
(MAX_RESTARTS within RESTART_WINDOW_S) or cannot start again makes the server exit with a
non-zero status, for its supervisor (`pdpool up`, the kubelet) to restart.

The core process leaves when its channel closes (the server is gone, however it died) or on
StopCore.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, Callable, Optional

from pdpool.engine.async_engine import (
    EngineClient,
    EngineLoop,
    NewRequest,
    add_to_engine,
    admit,
)
from pdpool.engine.core_channel import ChannelClosed, CoreChannel, decode, encode
from pdpool.engine.core_messages import (
    AbortRequest,
    AddRequest,
    CoreFailedToStart,
    CoreReady,
    EngineFacts,
    Heartbeat,
    LeaseReleased,
    ReleaseLease,
    RequestRefused,
    RequestsFailed,
    StepOutputs,
    StopCore,
)
from pdpool.engine.engine_state import EngineState, admission_problem, engine_state
from pdpool.engine.outputs import EngineUnavailable, RequestOutput

if TYPE_CHECKING:  # for annotations only: the server process never imports torch
    from pdpool.engine.config import EngineConfig
    from pdpool.engine.engine_core import LLMEngine

log = logging.getLogger("pdpool.engine")

# How often an idle core says it is alive (and sends its gauges).
HEARTBEAT_S = 0.05
# How long a core whose server died may take to close its engine before it exits.
ORPHAN_EXIT_S = 2.0
# Restarts in place before the server gives up and exits for its supervisor.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 300.0
# How long a core may take to load its model.
START_TIMEOUT_S = 600.0

__all__ = ["EngineFacts", "EngineProcess", "EngineStartError", "run_engine_process"]


class EngineStartError(RuntimeError):
    """The engine core could not load its model (the message says why)."""


# --- the core process ---------------------------------------------------------------------
class _CoreSink:
    """The step loop's sink in the core process: outputs and state go to the server. A
    server that falls behind holds the step loop back (bounded memory) instead of letting
    outputs pile up."""

    def __init__(self, channel: CoreChannel, engine: LLMEngine, inbox: "_CoreInbox"):
        self.channel, self.engine, self.inbox = channel, engine, inbox
        self._last_sent = 0.0

    def _due(self) -> bool:
        return time.monotonic() - self._last_sent >= HEARTBEAT_S

    def _send(self, msg: object) -> None:
        self._last_sent = time.monotonic()
        try:
            self.channel.send(msg)
            while not self.channel.wait_room(timeout=1.0):
                pass  # the server reads again, or its end closes (then there is room)
        except ChannelClosed:
            pass  # the server is gone: the main thread exits

    def _state(self) -> EngineState:
        """The engine's state, with the reader's holdup when it is the longer one."""
        state = engine_state(self.engine)
        busy = self.inbox.busy_s()
        if busy > state.admission_holdup_s:
            by = "the engine core's reader is still handling a message"
            state = dataclasses.replace(state, admission_holdup_s=busy, admission_holdup=by)
        return state

    def outputs(self, outputs: list[RequestOutput]) -> None:
        # A step without outputs (a prefill chunk, loads in flight) still says it is alive.
        if outputs or self._due():
            self._send(StepOutputs(outputs, self._state()))

    def failed(self, request_ids: list[str], message: str) -> None:
        self._send(RequestsFailed(request_ids, message, self._state()))

    def idle(self) -> None:
        if self._due():
            self._send(Heartbeat(self._state()))


class _CoreInbox:
    """The core's handling of the server's messages, on the channel's reader thread. Nothing
    here waits on a request's content: a guided request's grammar compiles on a thread of
    its own (GrammarJobs) and the request joins the step loop once it is ready, so aborts,
    other requests and lease releases are read meanwhile."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.stop = threading.Event()
        self.server_gone = threading.Event()
        self._busy_since: Optional[float] = None  # the reader's current batch, when it has one

    def attach(self, channel: CoreChannel, loop: EngineLoop) -> None:
        self.channel, self.loop = channel, loop

    def busy_s(self) -> float:
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def on_messages(self, msgs: list[Any]) -> None:
        self._busy_since = time.monotonic()
        try:
            for msg in msgs:
                self._on_message(msg)
        finally:
            self._busy_since = None

    def _on_message(self, msg: Any) -> None:
        if isinstance(msg, AddRequest):
            admit(
                self.engine,
                msg,
                lambda compiled: self.loop.submit(functools.partial(self._add, msg, compiled)),
                functools.partial(self._refuse, msg.request_id),
            )
        elif isinstance(msg, AbortRequest):
            self.engine.grammar_jobs.cancel(msg.request_id)
            self.loop.submit(functools.partial(self.engine.abort_request, msg.request_id))
        elif isinstance(msg, ReleaseLease):
            # Thread-safe: it only marks the lease; the engine thread frees the blocks.
            released = self.engine.connector.release_lease(msg.params)
            self._reply(LeaseReleased(msg.call_id, released))
        elif isinstance(msg, StopCore):
            self.stop.set()

    def on_closed(self, why: str) -> None:
        self.server_gone.set()
        self.stop.set()

    def _add(self, msg: AddRequest, compiled: Any) -> None:
        try:
            add_to_engine(self.engine, msg, compiled)
        except Exception as exc:  # validation: the server answers it as the thread mode does
            self._refuse(msg.request_id, exc)

    def _refuse(self, request_id: str, exc: Exception) -> None:
        self._reply(RequestRefused.of(request_id, exc))

    def _reply(self, msg: object) -> None:
        with contextlib.suppress(ChannelClosed):
            self.channel.send(msg)


def _first_message(conn: Connection, msg: object) -> None:
    conn.send_bytes(encode(msg))


def run_engine_process(config: EngineConfig, conn: Connection, log_level: str) -> None:
    """The core process's main: load the engine, then serve the channel until it closes."""
    # A Ctrl-C or a SIGTERM to the process group reaches both: the server drains its streams
    # and then stops this process (or this process sees the channel close).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from pdpool.engine.engine_core import LLMEngine

    try:
        engine = LLMEngine(config)
    except Exception as exc:
        _first_message(conn, CoreFailedToStart(str(exc) or type(exc).__name__))
        return
    facts = EngineFacts(
        engine.model_name,
        engine.max_model_len,
        engine.kv_capacity_tokens,
        engine.memory.fingerprint,
    )
    _first_message(conn, CoreReady(facts, engine_state(engine)))
    inbox = _CoreInbox(engine)
    channel = CoreChannel(conn, inbox.on_messages, inbox.on_closed, name="engine-core")
    inbox.attach(channel, EngineLoop(engine, _CoreSink(channel, engine, inbox)))
    channel.start()
    inbox.stop.wait()
    if inbox.server_gone.is_set():
        # Nobody is left to answer: free this engine's ports (KV handshake, events) within
        # seconds, for a server restarted on them, even if a long step is running.
        log.warning("the server process is gone: the engine core stops")
        stopper = threading.Thread(target=inbox.loop.shutdown, daemon=True)
        stopper.start()
        stopper.join(ORPHAN_EXIT_S)
        os._exit(0)
    inbox.loop.shutdown()
    channel.flush_and_close()


# --- the server process -------------------------------------------------------------------
class CoreProcess:
    """One engine core process, started and ready, and the channel to it."""

    def __init__(self, proc: BaseProcess, conn: Connection, facts: EngineFacts, state: EngineState):
        self.proc, self.conn, self.facts, self.first_state = proc, conn, facts, state
        self.channel: Optional[CoreChannel] = None
        self.started_at = time.monotonic()

    @classmethod
    def start(cls, config: EngineConfig, log_level: str) -> "CoreProcess":
        """Spawns a core and waits (blocking) until its model is loaded."""
        ctx = multiprocessing.get_context("spawn")  # safe with CUDA and torch's threads
        conn, child_conn = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=run_engine_process,
            args=(config, child_conn, log_level),
            name="pdpool-engine-core",
            daemon=True,
        )
        proc.start()
        child_conn.close()
        try:
            msg = cls._wait_first_message(proc, conn)
        except BaseException:
            cls._end(proc)
            conn.close()
            raise
        if isinstance(msg, CoreFailedToStart):
            proc.join(10)
            conn.close()
            raise EngineStartError(msg.why)
        assert isinstance(msg, CoreReady)
        return cls(proc, conn, msg.facts, msg.state)

    @staticmethod
    def _wait_first_message(proc: BaseProcess, conn: Connection) -> object:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not conn.poll(0.2):
            if not proc.is_alive():
                raise EngineStartError(
                    f"the engine core exited (code {proc.exitcode}) while loading"
                )
            if time.monotonic() > deadline:
                raise EngineStartError(f"the engine core did not load in {START_TIMEOUT_S:.0f}s")
        try:
            return decode(conn.recv_bytes())
        except (EOFError, OSError) as exc:
            proc.join(5)
            raise EngineStartError(
                f"the engine core exited (code {proc.exitcode}) while loading"
            ) from exc

    def open(
        self, on_messages: Callable[[list[Any]], None], on_closed: Callable[[str], None]
    ) -> CoreChannel:
        self.channel = CoreChannel(self.conn, on_messages, on_closed, name="engine-server")
        return self.channel.start()

    @property
    def exitcode(self) -> Optional[int]:
        return self.proc.exitcode

    def is_alive(self) -> bool:
        return bool(self.proc.is_alive())

    def stop(self, grace_s: float = 15.0) -> None:
        """Asks the core to stop, then makes sure it has (terminate, then kill)."""
        if self.proc.is_alive() and self.channel is not None:
            with contextlib.suppress(ChannelClosed):
                self.channel.send(StopCore())
            self.proc.join(grace_s)
        self._end(self.proc)
        if self.channel is not None:
            self.channel.flush_and_close(timeout=1.0)
        else:
            self.conn.close()

    def kill(self) -> None:
        """Ends a core that is gone or useless (its channel broke) at once."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        if self.channel is not None:
            self.channel.flush_and_close(timeout=0.5)

    @staticmethod
    def _end(proc: BaseProcess) -> None:
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


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


class EngineProcess(EngineClient):
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
