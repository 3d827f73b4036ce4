"""The whole P/D topology as local processes: prefill engines, decode engines each with a
sidecar, and the gateway. Used by `pdpool up`, the end-to-end tests and the benchmarks.

A small supervisor: every child runs in its own process group with its output in a log
file; a child that dies while the topology is up is started again on the same port (an
engine restart is something the sidecar and gateway must ride out); stop() ends them all.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional, Sequence

from pdpool import parent_death
from pdpool.cpu_cores import engine_share_of_cores
from pdpool.ports import free_port
from pdpool.sidecar.net.workers import MAX_AUTO_WORKERS
from pdpool.command_lines import (
    EngineLaunch,
    KVEventsPublisher,
    KVLink,
    KVOffload,
    RouterLaunch,
    Serving,
    SidecarLaunch,
    VllmLaunch,
    gateway_argv,
    last_flag_value,
    num,
    pdpool_engine_argv,
    sidecar_argv,
    vllm_engine_argv,
)
from pdpool.tlsutil import make_ca_and_certificate

from .envoy_gateway import swap_in_envoy

# re-exported: callers build the spec and the topology from here
from .spec import SIDE_BY_SIDE as SIDE_BY_SIDE, TopologySpec as TopologySpec


def pdpool_command(*args: str) -> list[str]:
    # Not `-m pdpool.cli`: that runs cli.py as __main__, a second copy of the module whose
    # CliError is not the one subcommands raise (errors would become tracebacks).
    return [
        sys.executable,
        "-c",
        "import sys; from pdpool.cli import main; sys.exit(main())",
        *args,
    ]


def _generator_fingerprint() -> str:
    """Hash of the engine's tiny-model generator sources (read, not imported: that
    would load torch), so that a changed generator never reuses a stale cached model."""
    spec = importlib.util.find_spec("pdpool.engine")
    digest = hashlib.sha256()
    if spec and spec.submodule_search_locations:
        folder = next(iter(spec.submodule_search_locations))
        for name in sorted(os.listdir(folder)):
            if name.startswith("tiny_model") and name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as fh:
                    digest.update(name.encode() + fh.read())
    return digest.hexdigest()[:12]


def default_tiny_model_dir(arch: str) -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pdpool", f"tiny-{arch}-{_generator_fingerprint()}")


def ensure_tiny_model(
    arch: str = "qwen3", out_dir: Optional[str] = None, shape: Sequence[str] = ()
) -> str:
    """Generates the tiny random-weight checkpoint once and reuses it afterwards; `shape`
    holds `pdpool tiny-model` flags (give such a model its own `out_dir`)."""
    out = out_dir or default_tiny_model_dir(arch)
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f"tiny-{arch}-", dir=os.path.dirname(out))
    done = subprocess.run(
        pdpool_command("tiny-model", tmp, "--arch", arch, *shape), capture_output=True, text=True
    )
    if done.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"pdpool tiny-model failed: {done.stderr.strip()[-500:]}")
    with contextlib.suppress(OSError):  # another process won the race: use its copy
        os.rename(tmp, out)
    return out


@dataclass
class Child:
    role: str  # prefill, decode, sidecar, gateway
    index: int
    port: int
    argv: list[str]
    log_path: str
    kv_port: Optional[int] = None
    env: dict[str, str] = field(default_factory=dict)  # added to the parent's environment
    pid: Optional[int] = None
    restarts: int = 0
    proc: Optional[subprocess.Popen[bytes]] = field(default=None, repr=False)
    scheme: str = "http"  # https with `pdpool up --tls`
    kv_events: Optional[str] = None  # an engine's PUB|REPLAY endpoints (--kv-events)
    # serving; starting (added by the autoscaler, not yet routed to); draining (no longer
    # routed to, finishing its requests before it is stopped: never restarted)
    state: str = "serving"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


ENGINES = ("pdpool", "vllm")
THREAD_FLAGS = ("--cpu-threads", "--cpu-prefill-threads")
# Stock vLLM on CPU, as tests/vllm and benchmarks/engine_vs_vllm.py run it (block size 128).
VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    "UCX_NET_DEVICES": "lo",
}
VLLM_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]


def vllm_command() -> str:
    """$PDPOOL_VLLM_BIN, else the venv of scripts/vllm/build-venv.sh, else `vllm` on PATH."""
    explicit = os.environ.get("PDPOOL_VLLM_BIN")
    if explicit:
        return explicit
    venv = os.environ.get("PDPOOL_VLLM_VENV") or os.path.join(
        os.path.expanduser("~"), ".cache", "pdpool", "vllm-venv"
    )
    candidate = os.path.join(venv, "bin", "vllm")
    return candidate if os.access(candidate, os.X_OK) else (shutil.which("vllm") or "vllm")


def served_model_name(model: str) -> str:
    """The name `pdpool serve` gives a model folder; vLLM engines get the same one."""
    return os.path.basename(os.path.realpath(model.rstrip("/")))


def nixl_available() -> bool:
    try:
        import nixl  # noqa: F401

        return True
    except ImportError:
        return False


class Topology:
    def __init__(self, spec: TopologySpec) -> None:
        self.spec = spec
        self.log_dir = spec.log_dir or tempfile.mkdtemp(prefix="pdpool-up-")
        os.makedirs(self.log_dir, exist_ok=True)
        if spec.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {spec.engine!r}")
        self.kv_connector = spec.kv_connector
        if self.kv_connector == "auto":
            # vLLM's venv (scripts/vllm/build-venv.sh) brings its own nixl.
            self.kv_connector = "nixl" if spec.engine == "vllm" or nixl_available() else "none"
        self.children: list[Child] = []
        # The pool's secret signs kv_transfer_params and the shared offload tier's records.
        needs_secret = self.kv_connector != "none" or spec.kv_offload == "shared"
        self.kv_secret_file = self._write_kv_secret() if needs_secret else None
        self.ca_file: Optional[str] = None
        self.tls_files: Optional[tuple[str, str]] = None
        if spec.tls:
            self.ca_file, self.tls_files = make_tls_files(os.path.join(self.log_dir, "tls"))
        self._plan()
        self._stopping = False
        # Children that end with this process even when it is killed (pdpool/parent_death.py).
        self.children_die_with_parent = False

    def _write_kv_secret(self) -> str:
        """The pool's secret for signing kv_transfer_params: new for each topology, readable
        by this user only."""
        import secrets

        path = os.path.join(self.log_dir, "kv-secret")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32))
        return path

    # ------------------------------------------------------------------ planning
    def _serving(self, port: int, tls: bool = True) -> Serving:
        return Serving(
            tuple(pdpool_command()),
            "127.0.0.1",
            port,
            tls=self.tls_files if tls else None,
            otlp_traces_endpoint=self.spec.otlp_traces_endpoint,
        )

    def _engine(self, role: str, index: int) -> Child:
        s = self.spec
        port, kv_port = free_port(), free_port()
        events = None
        if s.kv_events:  # PUB + replay on free loopback ports
            events = KVEventsPublisher("127.0.0.1", free_port(), free_port(), s.engine == "vllm")
        launch = EngineLaunch(
            self._serving(port),
            s.model,
            priority_scheduling=bool(s.tenants_file),
            kv_events=events,
            offload=self._offload(role, index),
            extra_args=tuple(s.engine_args),  # last: later flags win (vLLM's parser too)
        )
        env: dict[str, str] = {}
        if s.engine == "vllm":
            argv, env = self._vllm_engine(launch, role, index, kv_port)
        else:
            kv = None
            if self.kv_connector != "none" and self.kv_secret_file is not None:
                # Both roles on both sides: decode reads prefill's blocks, and prefill reads
                # decode's cached prefix (the bidirectional pull of decode-first).
                kv = KVLink("both", "127.0.0.1", kv_port, "127.0.0.1", self.kv_secret_file)
            argv = pdpool_engine_argv(
                replace(launch, device=s.device, kv=kv, cpu_prefill_threads=self._threads())
            )
        child = Child(
            role, index, port, argv, self._log(role, index), kv_port, env, scheme=self._scheme
        )
        if events is not None:
            child.kv_events = f"tcp://127.0.0.1:{events.port}|tcp://127.0.0.1:{events.replay_port}"
        return child

    def _offload(self, role: str, index: int) -> Optional[KVOffload]:
        """The engine's offload tier: one directory per engine (disk) or one for all
        (shared)."""
        s = self.spec
        if s.kv_offload is None:
            return None
        if s.kv_offload == "native":
            return KVOffload(s.kv_offload_size_gib, "native")
        root = s.kv_offload_dir or os.path.join(self.log_dir, "kv-offload")
        path = root if s.kv_offload == "shared" else os.path.join(root, f"{role}-{index}")
        # With a KV connector, its link passes the secret already.
        secret = (
            self.kv_secret_file
            if s.kv_offload == "shared" and self.kv_connector == "none"
            else None
        )
        return KVOffload(s.kv_offload_size_gib, s.kv_offload, path, secret_file=secret)

    def _threads(self) -> Optional[int]:
        """The engines share this machine's cores: each one's prompt steps get an equal
        share (on their own, they would each take every core). None when the engine
        arguments choose a thread count."""
        chosen = any(a.split("=")[0] in THREAD_FLAGS for a in self.spec.engine_args)
        if self.spec.device == "cuda" or chosen:
            return None
        return engine_share_of_cores(self.spec.prefill + self.spec.decode)

    @property
    def _scheme(self) -> str:
        return "https" if self.tls_files else "http"

    def _vllm_engine(
        self, launch: EngineLaunch, role: str, index: int, kv_port: int
    ) -> tuple[list[str], dict[str, str]]:
        """Stock `vllm serve` on CPU. P/D through vLLM's NixlConnector: prefill engines are
        kv_producer, decode engines kv_consumer (CPU buffers; its side channel on kv_port)."""
        program = (self.spec.vllm_bin or vllm_command(),)
        launch = replace(
            launch,
            serving=replace(launch.serving, program=program),
            served_name=served_model_name(self.spec.model),
        )
        connector = self.kv_connector != "none"
        argv = vllm_engine_argv(
            VllmLaunch(
                launch,
                ("kv_producer" if role == "prefill" else "kv_consumer") if connector else None,
                "cpu" if connector else None,
                vllm_args=VLLM_ARGS,
            )
        )
        env = dict(VLLM_ENV, VLLM_NIXL_SIDE_CHANNEL_PORT=str(kv_port))
        # One OpenMP core each, spread over the machine (vLLM's default binds every
        # engine to the same first core).
        ordinal = index if role == "prefill" else self.spec.prefill + index
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(ordinal % (os.cpu_count() or 1))
        return argv, env

    def _log(self, role: str, index: int) -> str:
        return os.path.join(self.log_dir, f"{role}-{index}.log")

    def _plan(self) -> None:
        s = self.spec
        prefills = [self._engine("prefill", i) for i in range(s.prefill)]
        decodes = [self._engine("decode", i) for i in range(s.decode)]
        sidecars = [self.sidecar(i, dec, prefills) for i, dec in enumerate(decodes)]
        kv: dict[str, Any] = {}
        if s.kv_events:  # the gateway indexes the decode engines' events
            kv = dict(
                kv_events=[
                    f"127.0.0.1:{sc.port}={dec.kv_events}"
                    for dec, sc in zip(decodes, sidecars, strict=True)
                ],
                kv_threshold=num(s.cache_hit_threshold),
                kv_load_cost=None if s.kv_load_cost is None else num(s.kv_load_cost),
                **self._kv_index(),
            )
        self.router_launch = RouterLaunch(
            self._serving(s.port or free_port()),
            decode_service=(
                f"file:{self.discovery_file('sidecar')}" if s.discovery_files else None
            ),
            decode_urls=[] if s.discovery_files else [f"127.0.0.1:{sc.port}" for sc in sidecars],
            health_interval_s="1",
            tenants_file=s.tenants_file,
            ca_file=self.ca_file,
            extra_args=tuple(s.gateway_args),
            **kv,
        )
        gateway = Child(
            "gateway",
            0,
            self.router_launch.serving.port,
            gateway_argv(self.router_launch),
            self._log("gateway", 0),
            scheme=self._scheme,
        )
        self.children = prefills + decodes + sidecars + [gateway]
        if s.gateway == "envoy":
            self.children = swap_in_envoy(self, self.children)

    def _kv_index(self) -> dict[str, Any]:
        """How a subscriber turns the engines' events into its index: their block size and,
        for token ids (stock vLLM's events), the model's tokenizer."""
        tokenizer = os.path.join(self.spec.model, "tokenizer.json")
        return dict(
            kv_block_size=self._engine_block_size(),
            kv_tokenizer=tokenizer if os.path.exists(tokenizer) else None,
        )

    def sidecar(self, index: int, dec: Child, prefills: list[Child]) -> Child:
        """The sidecar in front of decode engine `dec`."""
        s = self.spec
        events = [f"127.0.0.1:{p.port}={p.kv_events}" for p in prefills if p.kv_events]
        engines = s.prefill + s.decode
        launch = SidecarLaunch(
            self._serving(free_port()),
            decode_url=dec.url,
            prefill_service=f"file:{self.discovery_file('prefill')}" if s.discovery_files else None,
            prefill_urls=[] if s.discovery_files else [f"127.0.0.1:{p.port}" for p in prefills],
            mode=s.mode,
            cache_hit_threshold=num(s.cache_hit_threshold),
            prefill_timeout=num(s.prefill_timeout),
            decode_retry_s=num(s.decode_retry_s),
            # Stock vLLM ignores cache_hit_threshold: the sidecar decides by length.
            engine_rejects=s.engine_rejects or ("no" if s.engine == "vllm" else "yes"),
            pull_from_decode=s.pull_from_decode,
            prefill_min_prompt_tokens=s.prefill_min_prompt_tokens,
            prefill_kv_events=events,
            ca_file=self.ca_file,
            lora_allowed_dirs=s.lora_allowed_dirs,
            # one machine for every process here: a sidecar's share of the cores, as an
            # engine's (on their own, each sidecar would fork a worker per core)
            workers=min(MAX_AUTO_WORKERS, engine_share_of_cores(engines, environ={}) or 1),
            extra_args=s.sidecar_args,
            **(self._kv_index() if events else {}),
        )
        return Child(
            "sidecar",
            index,
            launch.serving.port,
            sidecar_argv(launch),
            self._log("sidecar", index),
            scheme=self._scheme,
        )

    # ------------------------------------------------------------------ changing the set
    def discovery_file(self, role: str) -> str:
        """With discovery_files: the file listing the serving prefill engines (`prefill`)
        or decode sidecars (`sidecar`), one HOST:PORT a line."""
        return os.path.join(self.log_dir, f"{role}-endpoints.txt")

    def write_discovery(self) -> None:
        """Rewrites both files (atomically) from the children serving now."""
        if not self.spec.discovery_files:
            return
        for role in ("prefill", "sidecar"):
            path = self.discovery_file(role)
            lines = [f"127.0.0.1:{c.port}\n" for c in self.by_role(role) if c.state == "serving"]
            with open(path + ".tmp", "w", encoding="utf-8") as fh:
                fh.writelines(lines)
            os.replace(path + ".tmp", path)

    def add_engine(self, role: str) -> list[Child]:
        """Starts one more engine of `role` (a decode engine with its sidecar), in state
        starting: not routed to until mark_serving()."""
        index = 1 + max((c.index for c in self.by_role(role)), default=-1)
        engine = self._engine(role, index)
        added = [engine]
        if role == "decode":
            sc_index = 1 + max((c.index for c in self.by_role("sidecar")), default=-1)
            added.append(self.sidecar(sc_index, engine, self.by_role("prefill")))
        for child in added:
            child.state = "starting"
            self.children.insert(len(self.children) - 1, child)  # the gateway stays last
            self._spawn(child)
        return added

    def mark_serving(self, children: list[Child]) -> None:
        for child in children:
            child.state = "serving"
        self.write_discovery()

    def retire(self, children: list[Child]) -> None:
        """No longer routed to (they finish what they have): the files drop them."""
        for child in children:
            child.state = "draining"
        self.write_discovery()

    def remove(self, children: list[Child], grace_s: float = 30.0) -> None:
        """Stops retired children (SIGTERM: their servers finish what is left) and forgets
        them."""
        for child in children:
            _signal(child, signal.SIGTERM)
        for child in children:
            if child.proc is not None:
                try:
                    child.proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    _signal(child, signal.SIGKILL)
                    child.proc.wait(5)
            if child in self.children:
                self.children.remove(child)

    def _engine_block_size(self) -> int:
        """The engines' KV block size: their --block-size, else their default."""
        given = last_flag_value(self.spec.engine_args, "--block-size")
        return int(given) if given is not None else (128 if self.spec.engine == "vllm" else 16)

    @property
    def gateway(self) -> Child:
        """The front door: our gateway, or Envoy (--gateway envoy)."""
        return (self.by_role("gateway") or self.by_role("envoy"))[0]

    @property
    def router(self) -> Child:
        """The child that routes (our gateway, or the endpoint picker behind Envoy)."""
        return (self.by_role("gateway") or self.by_role("epp"))[0]

    def by_role(self, role: str) -> list[Child]:
        return [c for c in self.children if c.role == role]

    # ------------------------------------------------------------------ running
    def _spawn(self, child: Child) -> None:
        with open(child.log_path, "ab") as log:  # the child holds its own copy
            argv = child.argv
            if self.children_die_with_parent:
                argv = parent_death.wrapped(argv, os.getpid())
            child.proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, **self.spec.tracing_env, **child.env}
                if child.env or self.spec.tracing_env
                else None,
            )
        child.pid = child.proc.pid

    def start(self, timeout_s: float = 180.0) -> None:
        try:
            self.write_discovery()
            for child in self.children:
                self._spawn(child)
            self.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(self.children)
        while pending:
            for child in list(pending):
                code = _process(child).poll()
                if code is not None:
                    raise RuntimeError(
                        f"{child.name} exited with {code}; last log lines:\n{tail(child.log_path)}"
                    )
                if healthy(child.url, ca_file=self.ca_file):
                    pending.remove(child)
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise TimeoutError(
                    f"not healthy after {timeout_s:.0f}s: {names} (logs in {self.log_dir})"
                )
            if pending:
                time.sleep(0.2)
        self._wait_gateway_sees_backends(deadline)

    def _wait_gateway_sees_backends(self, deadline: float) -> None:
        """Every child answering is not enough: the gateway routes only to backends its own
        probes found healthy, so ready means the gateway sees every sidecar."""
        import ssl

        want = len(self.by_role("sidecar"))
        context = ssl.create_default_context(cafile=self.ca_file) if self.ca_file else None
        while True:
            try:
                with urllib.request.urlopen(
                    self.router.url + "/health", timeout=2, context=context
                ) as r:
                    seen = len(json.loads(r.read()).get("healthy", []))
            except (urllib.error.URLError, OSError, ValueError):
                seen = 0
            if seen >= want:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the gateway sees {seen} of {want} sidecars healthy (logs in {self.log_dir})"
                )
            time.sleep(0.2)

    def restart(self, child: Child) -> None:
        """Kills one child and starts it again on the same port (a crash and restart)."""
        _signal(child, signal.SIGKILL)
        _process(child).wait(10)
        child.restarts += 1
        self._spawn(child)

    def supervise_once(self) -> list[Child]:
        """Restarts children that died; returns those restarted."""
        restarted = []
        for child in self.children:
            if child.state == "draining" or self._stopping:
                continue
            if child.proc and child.proc.poll() is not None:
                child.restarts += 1
                self._spawn(child)
                restarted.append(child)
        return restarted

    def stop(self, grace_s: float = 10.0) -> None:
        self._stopping = True
        # The gateway first, engines last: nothing is sent to a stopped engine.
        for child in reversed(self.children):
            _signal(child, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in reversed(self.children):
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _signal(child, signal.SIGKILL)
                child.proc.wait(5)

    def kill(self) -> None:
        """Stops every child now (SIGKILL), as a second interrupt asks."""
        self._stopping = True
        for child in self.children:
            _signal(child, signal.SIGKILL)

    def describe(self) -> dict[str, Any]:
        return {
            "gateway_url": self.gateway.url,
            "kv_connector": self.kv_connector,
            "engine": self.spec.engine,
            "log_dir": self.log_dir,
            "ca_file": self.ca_file,
            "spec": asdict(self.spec),
            "children": [
                {
                    "name": c.name,
                    "role": c.role,
                    "port": c.port,
                    "url": c.url,
                    "kv_port": c.kv_port,
                    "pid": c.pid,
                    "restarts": c.restarts,
                    "state": c.state,
                    "log": c.log_path,
                }
                for c in self.children
            ],
        }

    def __enter__(self) -> "Topology":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _process(child: Child) -> subprocess.Popen[bytes]:
    if child.proc is None:
        raise RuntimeError(f"{child.name} was never started")
    return child.proc


def _signal(child: Child, sig: int) -> None:
    if child.proc is None or child.proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.proc.pid, sig)


def healthy(url: str, timeout: float = 1.0, ca_file: Optional[str] = None) -> bool:
    import ssl

    context = ssl.create_default_context(cafile=ca_file) if ca_file else None
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout, context=context) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, "rb") as fh:
            return b"\n".join(fh.read().splitlines()[-lines:]).decode("utf-8", "replace")
    except OSError:
        return "(no log)"


def write_state(path: str, topology: Topology) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(topology.describe(), fh, indent=2)
    os.replace(tmp, path)


def make_tls_files(directory: str) -> tuple[str, tuple[str, str]]:
    """`pdpool up --tls`'s CA and its one server certificate, for 127.0.0.1 and localhost,
    valid for a week. Returns (ca.crt, (tls.crt, tls.key))."""
    return make_ca_and_certificate(directory, ca_cn="pdpool-up-ca", cn="pdpool-up", days=7)
