"""The engine in a process of its own, as vLLM runs its EngineCore: the step loop and the
model never share a GIL with HTTP parsing and SSE writing, so both run at once.

The server process (EngineProcess) and the engine process (run_engine_process) talk over one
duplex pipe of pickled tuples:

    server -> engine   ("add", request) ("abort", request_id) ("release", call_id, params)
                       ("stop",)
    engine -> server   ("ready", facts, state) or ("failed", why), once, at start-up
                       ("out", outputs, state)   after a step (every step with outputs)
                       ("state", state)          while idle, about every 50 ms
                       ("failed_requests", request_ids, message, state)
                       ("refused", request_id, exception)
                       ("reply", call_id, value)

The engine process leaves when the pipe closes (the server process is gone, however it died)
or on "stop". When the engine process dies, every request in flight fails and /health says so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from typing import Optional

from pdpool.engine.async_engine import EngineLoop, OutputStreams, add_to_engine
from pdpool.engine.engine_state import EngineState, engine_state

log = logging.getLogger("pdpool.engine")

# How often an idle engine process says it is alive (and sends its gauges).
HEARTBEAT_S = 0.05
# How long an engine process whose server died may take to close its engine before it exits.
ORPHAN_EXIT_S = 2.0


class EngineStartError(RuntimeError):
    """The engine process could not load its model (the message says why)."""


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    model_name: str
    max_model_len: int


# --- the engine process -------------------------------------------------------------------
class _PipeSender:
    """Sends, in the order given, from a thread of its own: neither the engine loop nor the
    pipe reader ever waits for the server to read (the server may be sending a large request
    at that moment, which needs the reader free)."""

    def __init__(self, conn):
        self.conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine-pipe-send", daemon=True)
        self._thread.start()

    def send(self, msg: tuple) -> None:
        self._queue.put(msg)

    def close(self) -> None:
        """Sends what is queued, then stops."""
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while (msg := self._queue.get()) is not None:
            try:
                self.conn.send(msg)
            except (OSError, ValueError):
                return  # the server process is gone
            except Exception as exc:  # a message that does not pickle (a refusal's exception)
                if msg[0] == "refused":
                    self.conn.send(("refused", msg[1], RuntimeError(str(msg[2]) or str(exc))))
                else:
                    log.exception("engine message %r not sent", msg[0])


class _PipeSink:
    """The engine loop's sink in the engine process: outputs and state go down the pipe."""

    def __init__(self, sender: _PipeSender, engine):
        self.sender, self.engine = sender, engine
        self._last_sent = 0.0

    def _due(self) -> bool:
        return time.monotonic() - self._last_sent >= HEARTBEAT_S

    def _send(self, msg: tuple) -> None:
        self._last_sent = time.monotonic()
        self.sender.send(msg)

    def outputs(self, outputs) -> None:
        # A step without outputs (a prefill chunk, loads in flight) still says it is alive.
        if outputs or self._due():
            self._send(("out", outputs, engine_state(self.engine)))

    def failed(self, request_ids: list[str], message: str) -> None:
        self._send(("failed_requests", request_ids, message, engine_state(self.engine)))

    def idle(self) -> None:
        if self._due():
            self._send(("state", engine_state(self.engine)))


def _add(engine, sender: _PipeSender, spec) -> None:
    try:
        add_to_engine(engine, spec)
    except Exception as exc:  # validation: the server answers it as the thread mode does
        sender.send(("refused", spec.request_id, exc))


def run_engine_process(config, conn, log_level: str) -> None:
    """The engine process's main: load the engine, then serve the pipe until it closes."""
    # A Ctrl-C or a SIGTERM to the process group reaches both: the server drains its streams
    # and then stops this process (or this process sees the pipe close).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from pdpool.engine.engine_core import LLMEngine

    try:
        engine = LLMEngine(config)
    except Exception as exc:
        conn.send(("failed", str(exc) or type(exc).__name__))
        return
    sender = _PipeSender(conn)
    loop = EngineLoop(engine, _PipeSink(sender, engine))
    facts = EngineFacts(engine.model_name, engine.max_model_len)
    sender.send(("ready", facts, engine_state(engine)))
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "add":
                loop.submit(functools.partial(_add, engine, sender, msg[1]))
            elif msg[0] == "abort":
                loop.submit(functools.partial(engine.abort_request, msg[1]))
            elif msg[0] == "release":
                # Thread-safe: it only marks the lease; the engine thread frees the blocks.
                sender.send(("reply", msg[1], engine.connector.release_lease(msg[2])))
            elif msg[0] == "stop":
                break
    except (EOFError, OSError):
        # Nobody is left to answer: free this engine's ports (KV handshake, events) within
        # seconds, for a server restarted on them, even if a long step is running.
        log.warning("the server process is gone: the engine process stops")
        stopper = threading.Thread(target=loop.shutdown, daemon=True)
        stopper.start()
        stopper.join(ORPHAN_EXIT_S)
        os._exit(0)
    loop.shutdown()
    sender.close()


# --- the server process -------------------------------------------------------------------
class EngineMirror:
    """The server's view of an engine process: its facts, the tokenizer (loaded here too),
    and the state it last sent."""

    def __init__(self, config, facts: EngineFacts, state: EngineState):
        from transformers import AutoTokenizer

        from pdpool.engine.model_loader import read_model_info

        self.config, self.info = config, read_model_info(config.model)
        self.model_name, self.max_model_len = facts.model_name, facts.max_model_len
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.info.path))
        self.latest = state

    def state(self) -> EngineState:
        return self.latest

    @property
    def fault(self) -> Optional[str]:
        return self.latest.fault


class EngineProcess(OutputStreams):
    """The engine in a child process, behind AsyncEngine's interface. `attach` it to the
    server's event loop before serving."""

    def __init__(self, config, log_level: str = "info"):
        super().__init__()
        ctx = multiprocessing.get_context("spawn")  # safe with CUDA and torch's threads
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=run_engine_process,
            args=(config, child_conn, log_level),
            name="pdpool-engine-core",
            daemon=True,
        )
        self._proc.start()
        child_conn.close()
        facts, state = self._wait_ready()
        self.view = EngineMirror(config, facts, state)
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._last_heard = time.monotonic()
        self._gone: Optional[str] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    def _wait_ready(self) -> tuple[EngineFacts, EngineState]:
        while not self._conn.poll(0.2):
            if not self._proc.is_alive():
                raise EngineStartError(
                    f"the engine process exited (code {self._proc.exitcode}) while loading"
                )
        try:
            msg = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise EngineStartError(
                f"the engine process exited (code {self._proc.exitcode}) while loading"
            )
        if msg[0] == "failed":
            self._proc.join(10)
            raise EngineStartError(msg[1])
        return msg[1], msg[2]

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Reads the engine's messages on `loop` (the server's) from now on."""
        self._loop = loop
        loop.add_reader(self._conn.fileno(), self._on_readable)

    # --- requests -----------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        if self._gone is not None:
            raise RuntimeError(self._gone)
        try:
            self._conn.send(msg)
        except OSError:
            self._lost()
            raise RuntimeError(self._gone)

    def _send_add(self, spec) -> None:
        try:
            self._send(("add", spec))
        except RuntimeError as exc:
            self._put([(spec.request_id, exc)])

    def abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except RuntimeError:
            pass  # the engine is gone, and its requests with it

    async def release_lease(self, params: dict) -> bool:
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self._send(("release", call_id, params))
            return await asyncio.wait_for(fut, timeout=30)
        finally:
            self._calls.pop(call_id, None)

    # --- health -------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._gone is None and self._proc.is_alive()

    def readiness(self, max_stall_s: float) -> Optional[str]:
        if not self.alive:
            return self._gone or f"the engine process has exited (code {self._proc.exitcode})"
        stalled = time.monotonic() - self._last_heard
        if stalled > max_stall_s and (self._streams or self.view.latest.has_work):
            return f"the engine loop has not ticked for {stalled:.1f}s while it has work"
        return None

    def shutdown(self) -> None:
        """Stops the engine process (once; later calls do nothing)."""
        if self._conn.closed:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._conn.fileno())
        if self._proc.is_alive():
            try:
                self._conn.send(("stop",))
            except OSError:
                pass
            self._proc.join(15)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()

    # --- the engine's messages, on the event loop ---------------------------------------
    def _on_readable(self) -> None:
        try:
            while self._conn.poll():
                self._handle(self._conn.recv())
        except (EOFError, OSError):
            self._lost()

    def _handle(self, msg: tuple) -> None:
        self._last_heard = time.monotonic()
        kind = msg[0]
        if kind == "out":
            self.view.latest = msg[2]
            if msg[1]:
                self._put([(out.request_id, out) for out in msg[1]])
        elif kind == "state":
            self.view.latest = msg[1]
        elif kind == "failed_requests":
            self.view.latest = msg[3]
            self._put([(rid, RuntimeError(msg[2])) for rid in msg[1]])
        elif kind == "refused":
            self._put([(msg[1], msg[2])])
        elif kind == "reply":
            fut = self._calls.get(msg[1])
            if fut is not None and not fut.done():
                fut.set_result(msg[2])

    def _lost(self) -> None:
        """The engine process is gone: fail everything in flight (once)."""
        if self._gone is not None:
            return
        self._proc.join(1)
        self._gone = f"the engine process has exited (code {self._proc.exitcode})"
        log.error("%s", self._gone)
        if self._loop is not None and not self._loop.is_closed() and not self._conn.closed:
            self._loop.remove_reader(self._conn.fileno())
        self._put([(rid, RuntimeError(self._gone)) for rid in list(self._streams)])
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(RuntimeError(self._gone))
