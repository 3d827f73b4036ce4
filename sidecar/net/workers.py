"""Several server processes on one port (`pdpool sidecar --workers`).

One event loop serves a burst of arrivals one after another: under a burst of 64 the median
request waits for some 30 others before its first byte leaves. Workers spread a burst over
the cores: the parent binds the port once per worker with SO_REUSEPORT, so the kernel hashes
each new connection to one worker's socket, forks the workers, and supervises them.

- No new port: every socket is bound here, to the serving port (and the metrics port),
  before any worker starts. The port is first bound once without SO_REUSEPORT, so a port
  that any other socket holds (a second sidecar started by mistake) is refused as before,
  instead of silently sharing its connections.
- The workers talk over Unix sockets in a folder only this user can open (mkdtemp, 0700):
  /metrics answers the sum over all workers (metrics_merge.py), and worker 0 alone probes
  the engine's capability and shares the answer there (capability_share.py).
- One worker's death stops them all and the parent exits non-zero, as the single process
  did when it crashed; a killed parent takes its workers along (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

from pdpool import parent_death
from pdpool.cpu_cores import usable_cores
from pdpool.errors import CliError

MAX_AUTO_WORKERS = 4  # beyond a few, a sidecar's share of the pod's cores is the limit


@dataclass(frozen=True)
class Worker:
    """One worker of `count`: where the workers reach each other."""

    index: int
    count: int
    share_dir: str

    def metrics_socket(self, index: int) -> str:
        return os.path.join(self.share_dir, f"metrics-{index}.sock")

    @property
    def capability_file(self) -> str:
        return os.path.join(self.share_dir, "engine-capability")

    @property
    def siblings(self) -> list[int]:
        return [i for i in range(self.count) if i != self.index]


def parse_workers(value: str) -> int:
    """`auto` (the usable cores, at most MAX_AUTO_WORKERS) or a count from 1 to 64."""
    if value == "auto":
        return max(1, min(usable_cores(), MAX_AUTO_WORKERS))
    try:
        count = int(value)
    except ValueError:
        raise CliError(f"--workers must be auto or a number, not {value!r}") from None
    if not 1 <= count <= 64:
        raise CliError(f"--workers must be between 1 and 64, not {count}")
    return count


def bind_shared(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` listening-ready sockets bound to one port with SO_REUSEPORT (port 0: one the
    kernel picks). CliError when the port is held by any socket at all."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probe = socket.socket(family)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind((host, port))  # no SO_REUSEPORT: fails if anything holds the port
        port = probe.getsockname()[1]
    except OSError as exc:
        raise CliError(f"cannot listen on {host}:{port}: {exc}") from None
    finally:
        probe.close()
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise CliError(f"cannot listen on {host}:{port}: {exc}") from None
    return sockets


# run_one(worker, its sockets) -> exit status: serves until stopped, in the worker process.
RunOne = Callable[[Worker, list[socket.socket]], int]


def run_workers(
    count: int, host: str, port: int, metrics_port: Optional[int], run_one: RunOne
) -> int:
    """Binds, forks `count` workers and waits for them; the exit status: 0 when they
    stopped on a signal, else the first failed worker's."""
    if metrics_port is not None and metrics_port == port and port:
        raise CliError("--metrics-port must differ from --port")
    serving = bind_shared(host, port, count)
    metrics = bind_shared(host, metrics_port, count) if metrics_port is not None else []
    share_dir = tempfile.mkdtemp(prefix="pdpool-workers-")  # 0700: this user only
    parent = os.getpid()
    children: dict[int, int] = {}
    try:
        for index in range(count):
            own = [serving[index]] + ([metrics[index]] if metrics else [])
            pid = os.fork()
            if pid == 0:
                _worker_main(parent, Worker(index, count, share_dir), own, run_one)
            children[pid] = index
    finally:
        for sock in serving + metrics:
            sock.close()  # the workers hold theirs; a socket nobody accepts on must not stay
    try:
        return _supervise(children)
    finally:
        shutil.rmtree(share_dir, ignore_errors=True)


def _worker_main(parent: int, worker: Worker, own: list[socket.socket], run_one: RunOne) -> None:
    """The forked worker: never returns."""
    status = 1
    try:
        _die_with(parent)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)  # uvicorn installs its own
        status = run_one(worker, own)
    except CliError as exc:
        print(f"pdpool worker {worker.index}: {exc}", file=sys.stderr)
        status = 2
    except KeyboardInterrupt:
        status = 0
    except BaseException:  # a worker reports any crash and exits
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _die_with(parent: int) -> None:
    """SIGKILL this process when the parent dies (a killed sidecar takes its workers)."""
    if not parent_death.end_with(parent, signal.SIGKILL):
        os._exit(1)


def _supervise(children: dict[int, int]) -> int:
    """Waits for every worker. SIGTERM/SIGINT go on to the workers (each stops as the
    single server would); a worker that exits first stops the others."""
    stopping = False
    status = 0

    def stop(signum: int, _frame: object = None) -> None:
        nonlocal stopping
        stopping = True
        for pid in list(children):
            _signal(pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while children:
            try:
                pid, wait_status = os.wait()
            except ChildProcessError:
                break
            index = children.pop(pid, None)
            if index is None:
                continue
            code = os.waitstatus_to_exitcode(wait_status)
            if not stopping:
                print(f"pdpool: worker {index} exited ({code}); stopping", file=sys.stderr)
                status = code if code > 0 else 1
                stop(signal.SIGTERM)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
