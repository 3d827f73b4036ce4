"""What a load run talks to, and the faults it injects: `pdpool serve` (one engine, default
flags) or `pdpool up` (the whole P/D topology, supervised), their processes (server, engine
core, sidecars), their memory, and the time a killed one takes to serve again.

Processes are found through /proc (no psutil): an engine core is the child of its
`pdpool serve` that runs multiprocessing's spawn_main (named pdpool-engine-core when it sets
its process title)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx

from devtools.engine_procs import SpawnedEngine

CORE_MARKERS = (b"pdpool-engine-core", b"spawn_main")


# --- processes ------------------------------------------------------------------------
def children(pid: int) -> list[int]:
    """Every child of a process, whichever of its threads started it (/proc lists a child
    under the thread that forked it: a core restarted from an executor thread is not under
    the main one)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(set(found))


def _describes_core(pid: int) -> bool:
    try:
        names = Path(f"/proc/{pid}/comm").read_bytes() + Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return any(marker in names for marker in CORE_MARKERS)


def engine_core_pid(server_pid: int) -> Optional[int]:
    """The engine core process under a `pdpool serve` (None: it runs none, or not now)."""
    return next((c for c in children(server_pid) if _describes_core(c)), None)


def rss_bytes(pid: Optional[int]) -> Optional[int]:
    """Resident memory of a process (None when it is gone)."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# --- targets --------------------------------------------------------------------------
@dataclass
class Node:
    """One process of a target that serves HTTP: an engine server, a sidecar, a gateway."""

    name: str  # e.g. engine-0, decode-1, sidecar-0, gateway-0
    role: str  # engine (serve's), prefill, decode, sidecar, gateway
    url: str
    pid: int

    @property
    def is_engine(self) -> bool:
        return self.role in ("engine", "prefill", "decode")


class ServeTarget:
    """`pdpool serve MODEL` with its default flags (the engine core in a process of its
    own), on CPU."""

    name = "serve"

    def __init__(self, model: str, log_dir: Path, *flags: str):
        self.model = model
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.engine = SpawnedEngine(Path(model), Path(log_dir), *flags)

    def start(self, timeout_s: float = 180.0) -> "ServeTarget":
        self.engine.wait(timeout_s)
        return self

    @property
    def url(self) -> str:
        return self.engine.url

    def nodes(self) -> list[Node]:
        return [Node("engine-0", "engine", self.engine.url, self.engine.proc.pid)]

    def engines(self) -> list[Node]:
        return self.nodes()

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes() if n.name == name)

    def alone(self) -> bool:
        """Whether one engine is all there is (its outage leaves no path)."""
        return True

    def wait_ready(self, timeout_s: float) -> bool:
        """Waits until the engine answers /health with 200."""
        return _wait(lambda: _health(self.url) == 200, timeout_s)

    def logs(self) -> str:
        return str(self.engine.log)

    def stop(self) -> None:
        self.engine.stop()


class UpTarget:
    """`pdpool up` as one process (its supervisor restarts what dies), its ports and pids
    read from its --state-file; its URL is the gateway's."""

    name = "up"

    def __init__(
        self,
        log_dir: Path,
        prefill: int = 1,
        decode: int = 2,
        model: Optional[str] = None,
        engine_args: tuple = (),
        extra: tuple = (),
    ):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.state_file = self.log_dir / "up-state.json"
        self.model = model
        argv = ["up", "--prefill", str(prefill), "--decode", str(decode), "--port", "0"]
        argv += ["--state-file", str(self.state_file), "--log-dir", str(self.log_dir / "logs")]
        argv += ["--model", model] if model else []
        argv += [f"--engine-arg={a}" for a in engine_args] + list(extra)
        self.argv = argv
        self.proc: Optional[subprocess.Popen] = None

    def start(self, timeout_s: float = 300.0) -> "UpTarget":
        from pdpool.up.topology import pdpool_command

        self.state_file.unlink(missing_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with open(self.log_dir / "up.log", "ab") as out:  # the child holds its own copy
            self.proc = subprocess.Popen(
                pdpool_command(*self.argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self._wait_state(timeout_s)
        return self

    def _wait_state(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.state_file.exists():
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"pdpool up exited with {self.proc.returncode}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"pdpool up not ready after {timeout_s}s:\n{self.logs()}")
            time.sleep(0.2)
        if self.model is None:
            self.model = self.state()["spec"]["model"]

    def state(self) -> dict:
        return json.loads(self.state_file.read_text())

    @property
    def url(self) -> str:
        return self.state()["gateway_url"]

    def nodes(self) -> list[Node]:
        """Every child as the supervisor last wrote it (a restarted one has a new pid)."""
        return [Node(c["name"], c["role"], c["url"], c["pid"]) for c in self.state()["children"]]

    def engines(self) -> list[Node]:
        return [n for n in self.nodes() if n.is_engine]

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes() if n.name == name)

    def alone(self) -> bool:
        return False

    def decode_behind(self, backend: str) -> Node:
        """The decode engine behind the sidecar a gateway answer names (x-pdpool-backend:
        HOST:PORT of sidecar-i, which fronts decode-i)."""
        port = int(backend.rsplit(":", 1)[1])
        sidecar = next(
            n for n in self.nodes() if n.role == "sidecar" and n.url.endswith(f":{port}")
        )
        return self.node("decode-" + sidecar.name.split("-")[1])

    def gateway_sees(self) -> int:
        """How many decode sidecars the gateway counts healthy now."""
        try:
            return len(httpx.get(self.url + "/health", timeout=2).json().get("healthy", []))
        except (httpx.HTTPError, ValueError):
            return 0

    def wait_gateway_sees(self, count: int, timeout_s: float) -> bool:
        """Waits until the gateway routes to `count` sidecars again (its probes and ejections
        lag the processes themselves)."""
        return _wait(lambda: self.gateway_sees() >= count, timeout_s)

    def wait_ready(self, timeout_s: float) -> bool:
        """Waits until the gateway routes to every sidecar."""
        sidecars = sum(n.role == "sidecar" for n in self.nodes())
        return self.wait_gateway_sees(sidecars, timeout_s)

    def logs(self, lines: int = 40) -> str:
        path = self.log_dir / "up.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def server_errors(self, limit: int = 60) -> str:
        """What the children's logs say went wrong inside a server (an exception that
        reached uvicorn, a response never started), with the lines of each traceback: what
        a failed load test shows beside its problems."""
        return server_errors(sorted((self.log_dir / "logs").glob("*.log")), limit)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # `pdpool up` stops its children
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


# Lines of a server's log that report its own failure (uvicorn's, the engine's handlers').
SERVER_ERROR_MARKS = ("Exception in ASGI application", "ASGI callable", "unhandled error")


def server_errors(logs: list[Path], limit: int = 60) -> str:
    """The server failures `logs` report, each with the traceback after it, at most `limit`
    lines in all, every line named by its log; "" when there are none."""
    out: list[str] = []
    for path in logs:
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        for i, line in enumerate(lines):
            if any(mark in line for mark in SERVER_ERROR_MARKS):
                out += [f"{path.stem}: {text}" for text in _with_traceback(lines, i)]
    more = [f"... {len(out) - limit} lines more"] if len(out) > limit else []
    return "\n".join(out[:limit] + more)


def _with_traceback(lines: list[str], at: int) -> list[str]:
    """Line `at`, and the traceback right after it if one follows (to its exception line)."""
    taken = [lines[at]]
    rest = lines[at + 1 : at + 200]
    if not rest or not rest[0].startswith("Traceback"):
        return taken
    for line in rest:
        taken.append(line)
        inside = not line or line.startswith((" ", "Traceback", "During handling", "The above"))
        if not inside:
            break
    return taken


# --- serving, and coming back ----------------------------------------------------------
def _wait(predicate, timeout_s: float, every_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True


def _health(url: str) -> Optional[int]:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return None


def served_model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def max_model_len(url: str) -> int:
    return int(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"])


def probe(url: str, model: str, timeout_s: float = 10.0) -> Optional[int]:
    """One tiny completion: its status (None: no answer)."""
    body = {"model": model, "prompt": "are you there", "max_tokens": 1}
    try:
        return httpx.post(url + "/v1/completions", json=body, timeout=timeout_s).status_code
    except httpx.HTTPError:
        return None


@dataclass
class ProbeLog:
    """What probes of a recovering server saw: every status (None: no answer), and the
    seconds until the first 200 (None: none within the wait)."""

    start: float
    statuses: list = field(default_factory=list)
    ok_after: Optional[float] = None


def wait_serving(url: str, model: str, timeout_s: float, every_s: float = 0.2) -> ProbeLog:
    """Probes `url` until it answers a completion with 200 or timeout_s passes."""
    log = ProbeLog(time.monotonic())
    while time.monotonic() - log.start < timeout_s:
        status = probe(url, model, timeout_s=min(10.0, timeout_s))
        log.statuses.append(status)
        if status == 200:
            log.ok_after = time.monotonic() - log.start
            break
        time.sleep(every_s)
    return log


@dataclass
class Kill:
    """One injected fault and what came of it."""

    what: str  # engine-core, engine-server, sidecar
    node: str
    pid: int
    at: float  # time.monotonic() of the kill
    recovered_s: Optional[float] = None  # None: never served again within the wait
    probes: Optional[ProbeLog] = None

    def row(self) -> dict:
        back = "never" if self.recovered_s is None else round(self.recovered_s, 2)
        return {"fault": self.what, "node": self.node, "pid": self.pid, "recovered_s": back}


def kill_core(node: Node) -> Kill:
    """SIGKILLs the engine core of an engine server."""
    pid = engine_core_pid(node.pid)
    if pid is None:
        raise RuntimeError(f"{node.name} (pid {node.pid}) runs no engine core process")
    os.kill(pid, signal.SIGKILL)
    return Kill("engine-core", node.name, pid, time.monotonic())


def kill_process(node: Node, what: str) -> Kill:
    """SIGKILLs a server process itself (an engine server or a sidecar)."""
    os.kill(node.pid, signal.SIGKILL)
    return Kill(what, node.name, node.pid, time.monotonic())


def time_recovery(kill: Kill, url: str, model: str, timeout_s: float) -> Kill:
    """Waits until the killed node's URL serves a completion again; records how long after
    the kill."""
    kill.probes = wait_serving(url, model, timeout_s)
    if kill.probes.ok_after is not None:
        kill.recovered_s = time.monotonic() - kill.at
    return kill


def inject_faults(target, faults, model: str, recovery_timeout_s: float) -> list[Kill]:
    """Each fault in turn, once the target is whole again: (node name, what), what being
    engine-core (SIGKILL the node's core), engine-server or sidecar (SIGKILL the node);
    each timed until its node serves a completion again."""
    kills = []
    for name, what in faults:
        target.wait_ready(recovery_timeout_s)
        node = target.node(name)
        kill = kill_core(node) if what == "engine-core" else kill_process(node, what)
        kills.append(time_recovery(kill, node.url, model, recovery_timeout_s))
    return kills


def outages(kills: list[Kill], no_path: bool) -> list:
    """The kills as outage windows (to the recovery, or for ever)."""
    from devtools.load_mix import Outage

    return [Outage(k.node, k.at, _end(k), no_path) for k in kills]


def _end(kill: Kill) -> float:
    return float("inf") if kill.recovered_s is None else kill.at + kill.recovered_s


def memory(target) -> dict[str, Optional[int]]:
    """RSS of every node and of each engine's core, by name (e.g. decode-0, decode-0/core)."""
    out: dict[str, Optional[int]] = {}
    for node in target.nodes():
        out[node.name] = rss_bytes(node.pid)
        if node.is_engine:
            out[node.name + "/core"] = rss_bytes(engine_core_pid(node.pid))
    return out


def blocks_in_use(target) -> dict[str, float]:
    from devtools.load_mix import kv_blocks

    return {n.name: kv_blocks(n.url)["blocks_used"] for n in target.engines()}


def leaked_blocks(target, idle: dict[str, float], timeout_s: float) -> list[str]:
    """Waits up to timeout_s for the engines' KV blocks in use to be back to `idle`; the
    problem, with what holds the blocks, when they are not."""
    from devtools.load_mix import block_problems, kv_holders

    after = wait_blocks_idle(target, idle, timeout_s)
    if after == idle:
        return []
    holders = {n.name: kv_holders(n.url) for n in target.engines()}
    return block_problems(idle, after, holders)


def wait_blocks_idle(target, idle: dict[str, float], timeout_s: float) -> dict[str, float]:
    """Polls the engines' KV blocks in use until they are back to `idle` (a P/D lease may
    hold blocks for `engine.kv.leases.longest_hold_s`); returns the last reading."""
    deadline = time.monotonic() + timeout_s
    now = blocks_in_use(target)
    while now != idle and time.monotonic() < deadline:
        time.sleep(0.5)
        now = blocks_in_use(target)
    return now
