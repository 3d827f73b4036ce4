"""The engine core in a process of its own, as vLLM runs its EngineCore: the step loop and
the model never share a GIL with HTTP parsing and SSE writing, so both run at once.

Both sides of the process boundary are here: `run_engine_process`, the core process's main
(the step loop of core_loop.py, fed by the server's messages), and CoreProcess, the server's
handle on one such process (spawn, wait until loaded, stop, kill). They exchange the typed
messages of core_messages.py over a CoreChannel (core_channel.py), which owns the socket's
blocking semantics: a large message or a burst waits for the peer, it never fails while the
peer lives. What the server calls is core_process_client.CoreProcessClient.

The core process leaves when its channel closes (the server is gone, however it died) or on
StopCore.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, Callable, Optional

from pdpool.engine.core_channel import ChannelClosed, CoreChannel, decode, encode
from pdpool.engine.core_loop import EngineLoop, add_to_engine, admit
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
from pdpool.engine.engine_state import EngineState, engine_state
from pdpool.engine.outputs import RequestOutput
from pdpool.start_up_gc import freeze_start_up_objects

if TYPE_CHECKING:  # for annotations only: the server process never imports torch
    from pdpool.engine.config import EngineConfig
    from pdpool.engine.engine_core import LLMEngine

log = logging.getLogger("pdpool.engine")

# How often an idle core says it is alive (and sends its gauges).
HEARTBEAT_S = 0.05
# How long a core whose server died may take to close its engine before it exits.
ORPHAN_EXIT_S = 2.0
# How long a core may take to load its model.
START_TIMEOUT_S = 600.0


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
    from pdpool.engine.cpu_memory import keep_freed_memory
    from pdpool.engine.cpu_threads import yield_to_relays
    from pdpool.engine.engine_core import LLMEngine

    if config.device != "cuda":
        keep_freed_memory()
        yield_to_relays()
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
    freeze_start_up_objects()  # the model's modules, the KV pools' bookkeeping
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


# --- the server's handle on it -----------------------------------------------------------
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
