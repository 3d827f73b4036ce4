"""The sidecar's own overhead: latency it adds over calling the decode engine directly.

    python benchmarks/sidecar_overhead.py                      # vLLM stand-in upstream
    python benchmarks/sidecar_overhead.py --engine             # a real `pdpool serve`
    python benchmarks/sidecar_overhead.py --engine-rejects yes # one sidecar mode only
    python benchmarks/sidecar_overhead.py --arrivals spread    # requests not in lock-step
    python benchmarks/sidecar_overhead.py --engine-rejects yes --tracing both  # off vs on
    python benchmarks/sidecar_overhead.py --engine-rejects yes --baseline-commit REV  # vs before
    python benchmarks/sidecar_overhead.py --llmd               # beside llm-d's pd-sidecar
    python benchmarks/sidecar_overhead.py --gateway            # and `pdpool gateway` alone

64 concurrent streaming clients (keep-alive, one connection each) send requests straight
to the upstream and through `pdpool sidecar` (decode-first, threshold 0), in alternating
rounds. By default two sidecars are measured, `--engine-rejects auto` (the default: it
probes the engine in the background and is measured once it knows the answer) and `yes`
(the hot path that inspects the first chunk and then streams through). Against the
stand-in, which ignores `cache_hit_threshold` as vLLM does, auto learns "cannot reject" and
serves these short prompts by decode alone (relayed without inspection). Reported: time to
first token and end-to-end latency p50/p99 of each path, what each sidecar adds, and its CPU
per request; the same in benchmarks/results/sidecar_overhead[_engine][_spread].json.

With `--llmd`, llm-d's Go `pd-sidecar` (built from llm-d-router by
scripts/llm-d/build-pd-sidecar.sh, or the binary in $PDPOOL_LLMD_PD_SIDECAR) runs in front of
the same upstream, measured in the same alternating rounds: requests carry no prefill header,
so it forwards them to its decoder as ours serves them by decode alone. A stream that fails
(an error status, a broken connection) is counted per target instead of ending the run.

With `--gateway`, `pdpool gateway` (on its defaults, one decode URL: the upstream) is measured
too, in the same rounds: the front door's own added time, without a sidecar behind it (with
`--baseline-commit`, the gateway of that revision as well).

By default all clients start together and every stream is as long, so requests come in
bursts of 64 within a millisecond: the worst case for a proxy on one event loop, whose
added TTFT is then mostly the queue of the burst's other requests. `--arrivals spread`
staggers the clients over one stream's duration, as independent users would arrive.

The default upstream is a STAND-IN that imitates vLLM's answers (tokens at a fixed pace),
so that what is measured is the sidecar and not the engine's batching noise. The load
generator is a minimal HTTP/1.1 client on raw asyncio streams for the same reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.proc_cpu import cpu_seconds_of
from pdpool.otlp_receiver import OtlpReceiver
from pdpool.ports import free_port
from pdpool.up.topology import ensure_tiny_model, healthy, pdpool_command

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# ----------------------------------------------------------------------- stand-in upstream
# STAND-IN for a vLLM OpenAI server, on raw asyncio streams so that it costs little next to
# the sidecar. It answers what the sidecar asks of vLLM, in vLLM's shapes: GET /health (200,
# empty), GET /v1/models, POST /v1/completions streamed (one SSE event per token, a final
# usage chunk when asked for, `data: [DONE]`) or whole (after the tokens' time, as an engine
# answers once it has generated). Like vLLM it ignores `cache_hit_threshold`, so the
# sidecar's capability probe (--engine-rejects auto) concludes "cannot reject".
STANDIN_MODEL = "standin-model"


def _vllm_models() -> dict:
    created = int(time.time())
    card = {"id": STANDIN_MODEL, "object": "model", "created": created, "owned_by": "vllm"}
    card.update(root=STANDIN_MODEL, parent=None, max_model_len=4096)
    return {"object": "list", "data": [card]}


def _choice(text: str, finish: str | None) -> dict:
    return {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        "prompt_logprobs": None,
    }


def _usage(prompt: int, completion: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }


class StandinCompletion:
    """One completion request's answer, as vLLM words it."""

    def __init__(self, body: dict) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.tokens = int(body.get("max_tokens") or 16)
        self.prompt_tokens = max(1, len(str(body.get("prompt", ""))) // 4)
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

    def _object(self, choices: list, usage: dict | None) -> dict:
        head = {"id": self.id, "object": "text_completion", "created": self.created}
        return {**head, "model": STANDIN_MODEL, "choices": choices, "usage": usage}

    def event(self, i: int) -> bytes:
        finish = "length" if i == self.tokens - 1 else None
        data = self._object([_choice(f" t{i}", finish)], None)
        return b"data: " + json.dumps(data).encode() + b"\n\n"

    def usage_event(self) -> bytes:
        data = self._object([], _usage(self.prompt_tokens, self.tokens))
        return b"data: " + json.dumps(data).encode() + b"\n\n"

    def whole(self) -> dict:
        text = "".join(f" t{i}" for i in range(self.tokens))
        answer = self._object([_choice(text, "length")], _usage(self.prompt_tokens, self.tokens))
        answer["kv_transfer_params"] = None
        return answer


def _response(status: int, body: bytes, content_type: str = "application/json") -> bytes:
    reason = {200: "OK", 404: "Not Found"}.get(status, "Error")
    head = (
        f"HTTP/1.1 {status} {reason}\r\nserver: uvicorn\r\ncontent-type: {content_type}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    method, path = lines[0].decode().split(" ")[:2]
    length = 0
    for line in lines[1:]:
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return method, path, await reader.readexactly(length) if length else b""


async def _stream_completion(
    writer: asyncio.StreamWriter, answer: StandinCompletion, token_interval_s: float
) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\n"
        b"content-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    for i in range(answer.tokens):
        writer.write(_chunk(answer.event(i)))
        await writer.drain()
        if i < answer.tokens - 1:
            await asyncio.sleep(token_interval_s)
    if answer.include_usage:
        writer.write(_chunk(answer.usage_event()))
    writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")


async def _answer(
    writer: asyncio.StreamWriter, method: str, path: str, body: bytes, token_interval_s: float
) -> None:
    if method == "GET" and path == "/health":
        writer.write(_response(200, b""))
    elif method == "GET" and path == "/v1/models":
        writer.write(_response(200, json.dumps(_vllm_models()).encode()))
    elif method == "POST" and path == "/v1/completions":
        request = json.loads(body)
        answer = StandinCompletion(request)
        if request.get("stream"):
            await _stream_completion(writer, answer, token_interval_s)
        else:
            await asyncio.sleep(token_interval_s * answer.tokens)
            writer.write(_response(200, json.dumps(answer.whole()).encode()))
    else:
        writer.write(_response(404, b'{"detail":"Not Found"}'))
    await writer.drain()


async def serve_standin(port: int, token_interval_s: float) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                method, path, body = await _read_request(reader)
                await _answer(writer, method, path, body, token_interval_s)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


# ----------------------------------------------------------------------- load generator
class Conn:
    """One keep-alive HTTP/1.1 connection that sends streaming POSTs."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def post_stream(self, path: str, body: bytes) -> tuple[float, float]:
        """Returns (time to first data byte, total time) in seconds."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        start = time.perf_counter()
        self.writer.write(
            b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(), len(body), body)
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.decode(errors="replace"))
        first = None
        chunked = b"chunked" in head.lower()
        if not chunked:
            raise RuntimeError("expected a chunked stream")
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
            data = await self.reader.readexactly(size + 2)
            if first is None and size:
                first = time.perf_counter() - start
            if size == 0:
                break
            del data
        return first, time.perf_counter() - start


STREAM_FAILURES = (RuntimeError, ConnectionError, asyncio.IncompleteReadError, ValueError)


async def run_round(
    host: str, port: int, concurrency: int, per_client: int, body: bytes, spread_s: float = 0.0
) -> tuple[list[float], list[float], int]:
    """Every client sends `per_client` requests back to back. With `spread_s` the clients
    start that far apart in all (evenly): their requests then keep arriving spread out,
    instead of all 64 in the same millisecond whenever the previous streams end. Returns
    the TTFTs and totals of the streams served and the count of failed ones (a client whose
    stream failed goes on with a new connection)."""
    ttfts: list[float] = []
    totals: list[float] = []
    failed = 0
    conns = [Conn(host, port) for _ in range(concurrency)]

    async def client(i: int) -> None:
        nonlocal failed
        await asyncio.sleep(spread_s * i / concurrency)
        for _ in range(per_client):
            try:
                first, total = await conns[i].post_stream("/v1/completions", body)
            except STREAM_FAILURES:
                failed += 1
                if conns[i].writer is not None:
                    conns[i].writer.close()
                conns[i] = Conn(host, port)
                continue
            ttfts.append(first)
            totals.append(total)

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    for c in conns:
        if c.writer is not None:
            c.writer.close()
    return ttfts, totals, failed


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process and its live descendants (a sidecar's workers)
    have used so far."""
    return sum(cpu_seconds_of(f"/proc/{one}/stat") for one in process_tree(pid))


def process_tree(pid: int) -> list[int]:
    """`pid` and every live descendant of it."""
    found, todo = [], [pid]
    while todo:
        one = todo.pop()
        found.append(one)
        try:
            tasks = os.listdir(f"/proc/{one}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{one}/task/{task}/children") as fh:
                    todo.extend(int(child) for child in fh.read().split())
            except OSError:
                continue
    return found


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)]


# ----------------------------------------------------------------------- main
MODES = ("auto", "yes")  # --engine-rejects of the sidecars measured (auto: the default)
LLMD = "llm-d pd-sidecar"


def wait_healthy(url: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not healthy(url):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy")
        time.sleep(0.2)


def engine_rejects_gauge(url: str) -> float:
    """The sidecar's pdpool_sidecar_engine_rejects (1 yes, 0 no, -1 not known yet)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("pdpool_sidecar_engine_rejects "):
                return float(line.split()[1])
    return -1.0


def wait_capability(url: str, timeout_s: float = 60) -> str:
    """What a sidecar learned of its engine, once it knows: what users' requests meet
    after start-up. Requests do not wait for it, but the benchmark measures the steady
    state."""
    deadline = time.monotonic() + timeout_s
    while (value := engine_rejects_gauge(url)) < 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    return {1.0: "rejects", 0.0: "cannot reject"}.get(value, "unknown")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", action="store_true", help="a real `pdpool serve` upstream")
    ap.add_argument("--model", help="engine checkpoint (default: the tiny model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument(
        "--token-interval-ms",
        type=float,
        default=20.0,
        help="stand-in pace: a GPU decode step at batch 64 takes about 20 ms",
    )
    ap.add_argument(
        "--engine-rejects",
        action="append",
        choices=("auto", "yes", "no"),
        help="the sidecar's --engine-rejects (repeatable; default: auto and yes, each "
        "through a sidecar of its own)",
    )
    ap.add_argument(
        "--arrivals",
        choices=("burst", "spread"),
        default="burst",
        help="burst: all clients start together, so their requests arrive in bursts of "
        "--concurrency each time the streams end together (the worst case); spread: the "
        "clients start evenly over one stream's duration (tokens x token interval)",
    )
    ap.add_argument(
        "--sidecar-nice",
        type=int,
        default=0,
        help="niceness of the sidecar (negative: give it CPU first, as a pod "
        "with its own CPU request would have it; needs root)",
    )
    ap.add_argument(
        "--tracing",
        choices=("off", "on", "both"),
        default="off",
        help="the sidecars' OpenTelemetry tracing: on exports every span (OTLP/HTTP) to a "
        "receiver in this process; both: a sidecar of each per mode, measured alike",
    )
    ap.add_argument(
        "--baseline-commit",
        help="also measure, alike, a sidecar of this git revision (its tree exported to a "
        "temporary folder and imported from there): what the changes since cost",
    )
    ap.add_argument(
        "--sidecar-workers",
        help="our sidecars' --workers (default: theirs, auto); the baseline's is its own",
    )
    ap.add_argument(
        "--llmd",
        action="store_true",
        help="also measure llm-d's pd-sidecar in front of the same upstream (built by "
        "scripts/llm-d/build-pd-sidecar.sh unless $PDPOOL_LLMD_PD_SIDECAR names the binary)",
    )
    ap.add_argument(
        "--gateway",
        action="store_true",
        help="also measure `pdpool gateway` (its defaults) in front of the same upstream",
    )
    ap.add_argument("--serve-standin", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.llmd_binary = llmd_pd_sidecar_binary() if args.llmd else None
    args.baseline_root = export_baseline(args.baseline_commit) if args.baseline_commit else None
    args.engine_rejects = list(dict.fromkeys(args.engine_rejects or MODES))
    return args


def start_upstream(args: argparse.Namespace, port: int) -> tuple[subprocess.Popen, dict]:
    """The upstream process and the prompt part of the requests sent to it."""
    prompt = {
        "prompt": "benchmark prompt " * 8,
        "max_tokens": args.tokens,
        "stream_options": {"include_usage": True},
    }
    if not args.engine:
        command = [sys.executable, os.path.abspath(__file__), "--serve-standin", str(port)]
        command += ["--token-interval-ms", str(args.token_interval_ms)]
        return subprocess.Popen(command), prompt
    model = args.model or ensure_tiny_model("qwen3")
    command = pdpool_command(
        "serve",
        model,
        "--port",
        str(port),
        "--device",
        args.device,
        "--log-level",
        "warning",
        "--max-num-seqs",
        str(max(args.concurrency, 64)),
    )
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, {**prompt, "temperature": 0, "ignore_eos": True}


def start_sidecar(
    port: int,
    upstream_port: int,
    engine_rejects: str,
    nice: int,
    traces: str | None = None,
    import_root: str | None = None,
    workers: str | None = None,
) -> subprocess.Popen:
    extra = ["--otlp-traces-endpoint", traces] if traces else []
    extra += ["--workers", workers] if workers else []
    env = {**os.environ, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    if import_root:  # the baseline's `pdpool` package comes first
        env["PYTHONPATH"] = import_root
    proc = subprocess.Popen(
        pdpool_command(
            "sidecar",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--decode-url",
            f"http://127.0.0.1:{upstream_port}",
            "--mode",
            "decode-first",
            "--cache-hit-threshold",
            "0",
            "--engine-rejects",
            engine_rejects,
            *extra,
        ),
        env=env,
        cwd=import_root,  # `python -c` puts the working folder first on sys.path
    )
    if nice:
        os.setpriority(os.PRIO_PROCESS, proc.pid, nice)
    return proc


def start_sidecars(
    args: argparse.Namespace,
    up_port: int,
    receiver: OtlpReceiver | None,
    procs: list[subprocess.Popen],
) -> dict[str, tuple[int, int]]:
    """One sidecar per --engine-rejects mode (and per --tracing state): name -> (port,
    pid); each process is added to `procs`."""
    targets = {}
    for mode in args.engine_rejects:
        for traced in {"off": [False], "on": [True], "both": [False, True]}[args.tracing]:
            port = free_port()
            endpoint = receiver.endpoint if traced and receiver else None
            procs.append(
                start_sidecar(
                    port, up_port, mode, args.sidecar_nice, endpoint, workers=args.sidecar_workers
                )
            )
            targets[f"sidecar {mode}{' traced' if traced else ''}"] = (port, procs[-1].pid)
        if args.baseline_root:
            port = free_port()
            procs.append(
                start_sidecar(port, up_port, mode, args.sidecar_nice, None, args.baseline_root)
            )
            targets[f"sidecar {mode} baseline"] = (port, procs[-1].pid)
    if args.gateway:
        roots = {"gateway": None}
        if args.baseline_root:
            roots["gateway baseline"] = args.baseline_root
        for name, root in roots.items():
            port = free_port()
            procs.append(start_gateway(port, up_port, root))
            targets[name] = (port, procs[-1].pid)
    if args.llmd:
        port = free_port()
        procs.append(start_llmd_sidecar(args.llmd_binary, port, up_port))
        targets[LLMD] = (port, procs[-1].pid)
    return targets


def start_gateway(port: int, upstream_port: int, import_root: str | None) -> subprocess.Popen:
    """`pdpool gateway` on its defaults with the upstream as its one decode URL."""
    env = {**os.environ, **({"PYTHONPATH": import_root} if import_root else {})}
    command = ["gateway", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--decode-url", f"http://127.0.0.1:{upstream_port}"]
    return subprocess.Popen(pdpool_command(*command), env=env, cwd=import_root)


def llmd_pd_sidecar_binary() -> str:
    """llm-d's pd-sidecar: $PDPOOL_LLMD_PD_SIDECAR, else built (or found cached) by
    scripts/llm-d/build-pd-sidecar.sh; SystemExit with the build's reason when neither."""
    binary = os.environ.get("PDPOOL_LLMD_PD_SIDECAR")
    if binary:
        if not os.access(binary, os.X_OK):
            raise SystemExit(f"PDPOOL_LLMD_PD_SIDECAR={binary} is not an executable file")
        return binary
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(repo, "scripts", "llm-d", "build-pd-sidecar.sh")
    done = subprocess.run([script], capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        reason = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise SystemExit(f"cannot build llm-d's pd-sidecar (exit {done.returncode}): {reason}")
    return lines[-1]


def llmd_upstream_port_flag(binary: str) -> str:
    """The flag naming the engine's port: llm-d-router's pd-sidecar takes
    --model-server-port, llm-d-inference-scheduler's (the module proxy's) --vllm-port."""
    done = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    newer = "--model-server-port" in done.stdout + done.stderr
    return "--model-server-port" if newer else "--vllm-port"


def start_llmd_sidecar(binary: str, port: int, upstream_port: int) -> subprocess.Popen:
    """llm-d's pd-sidecar on `port` in front of the engine on `upstream_port`, plain HTTP
    (its default is a self-signed TLS listener), its default connector; requests without
    its prefill header (x-prefiller-host-port) go to the decoder alone."""
    command = [binary, "--port", str(port), llmd_upstream_port_flag(binary), str(upstream_port)]
    command += ["--secure-proxy=false", "--zap-log-level", "error"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL)


def export_baseline(revision: str) -> str:
    """The repository at `revision` as an import root: its folders laid out as the
    `pdpool` package (setup.py's mapping), in a temporary folder."""
    import tempfile

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = tempfile.mkdtemp(prefix="pdpool-baseline-")
    archive = subprocess.run(
        ["git", "-C", repo, "archive", revision], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
    for name, folder in (("engine", "engine"), ("kernels", "kernels"), ("sidecar", "sidecar")):
        os.symlink(os.path.join(root, folder), os.path.join(root, "pdpool", name))
    return root


def spread_s(args: argparse.Namespace) -> float:
    """How far apart the clients start (--arrivals spread: over one stream's duration)."""
    return args.tokens * args.token_interval_ms / 1e3 if args.arrivals == "spread" else 0.0


def measure(
    args: argparse.Namespace, targets: dict[str, tuple[int, int]], body: bytes
) -> tuple[dict[str, tuple[list[float], list[float]]], dict[str, float], dict[str, int]]:
    """Alternating rounds over every target (name: (port, pid of its process)): the
    (TTFTs, totals) of each, the CPU seconds each spent and its failed streams."""
    for port, _ in targets.values():  # warm-up: connections, caches, lazy imports
        asyncio.run(run_round("127.0.0.1", port, args.concurrency, 1, body))
    data: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in targets}
    cpu = dict.fromkeys(targets, 0.0)
    failed = dict.fromkeys(targets, 0)
    for _ in range(args.rounds):
        for name, (port, pid) in targets.items():
            cpu_before = cpu_seconds(pid)
            ttfts, totals, round_failed = asyncio.run(
                run_round(
                    "127.0.0.1",
                    port,
                    args.concurrency,
                    args.requests_per_client,
                    body,
                    spread_s(args),
                )
            )
            cpu[name] += cpu_seconds(pid) - cpu_before
            failed[name] += round_failed
            data[name][0].extend(ttfts)
            data[name][1].extend(totals)
    return data, cpu, failed


def summary(ttft: list[float], total: list[float]) -> dict:
    if not ttft:
        nan = float("nan")
        return dict.fromkeys(("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms"), nan) | {
            "n": 0,
            "e2e_mean_ms": nan,
        }
    return {
        "n": len(ttft),
        "ttft_p50_ms": pct(ttft, 0.5) * 1e3,
        "ttft_p99_ms": pct(ttft, 0.99) * 1e3,
        "e2e_p50_ms": pct(total, 0.5) * 1e3,
        "e2e_p99_ms": pct(total, 0.99) * 1e3,
        "e2e_mean_ms": statistics.mean(total) * 1e3,
    }


def print_table(rows: dict, added: dict, cpu_ms: dict, failed: dict) -> None:
    print(
        f"{'path':<24}{'n':>6}{'TTFT p50':>11}{'TTFT p99':>11}{'E2E p50':>11}{'E2E p99':>11}"
        f"{'failed':>8}"
    )
    for name, r in rows.items():
        print(
            f"{name:<24}{r['n']:>6}{r['ttft_p50_ms']:>9.2f}ms{r['ttft_p99_ms']:>9.2f}ms"
            f"{r['e2e_p50_ms']:>9.2f}ms{r['e2e_p99_ms']:>9.2f}ms{failed[name]:>8}"
        )
    for name, a in added.items():
        label = "added " + name.removeprefix("sidecar ")
        print(
            f"{label:<24}{'':>6}{a['ttft_p50_ms']:>9.2f}ms"
            f"{a['ttft_p99_ms']:>9.2f}ms{a['e2e_p50_ms']:>9.2f}ms{a['e2e_p99_ms']:>9.2f}ms"
            f"{'':>8}   CPU {cpu_ms[name]:.3f} ms/request"
        )


def main() -> int:
    args = parse_args()
    if args.serve_standin:
        asyncio.run(serve_standin(args.serve_standin, args.token_interval_ms / 1e3))
        return 0
    procs: list[subprocess.Popen] = []
    up_port = free_port()
    targets: dict[str, tuple[int, int]] = {}
    learned = {}
    receiver: OtlpReceiver | None = None
    try:
        upstream, prompt = start_upstream(args, up_port)
        procs.append(upstream)
        targets["direct"] = (up_port, upstream.pid)
        if args.tracing != "off":
            receiver = OtlpReceiver(keep=False).start()
        targets.update(start_sidecars(args, up_port, receiver, procs))
        wait_healthy(f"http://127.0.0.1:{up_port}")
        for name, (port, _) in targets.items():
            wait_healthy(f"http://127.0.0.1:{port}")
            if name.startswith("sidecar "):
                learned[name] = wait_capability(f"http://127.0.0.1:{port}")
        body = json.dumps({**prompt, "stream": True}).encode()
        data, cpu, failed = measure(args, targets, body)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(20)
        if receiver is not None:
            receiver.stop()

    rows = {name: summary(*values) for name, values in data.items()}
    keys = ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms")
    sidecars = [name for name in rows if name != "direct"]
    added = {name: {k: rows[name][k] - rows["direct"][k] for k in keys} for name in sidecars}
    cpu_ms = {name: cpu[name] * 1e3 / max(rows[name]["n"], 1) for name in sidecars}
    upstream_name = (
        "engine (pdpool serve, " + args.device + ")"
        if args.engine
        else f"vLLM stand-in ({args.tokens} tokens, {args.token_interval_ms} ms apart)"
    )
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    print(
        f"sidecar overhead: {args.concurrency} concurrent streams, upstream = {upstream_name}, "
        f"{os.cpu_count()} CPUs, machine load average {load:.1f}, sidecar nice "
        f"{args.sidecar_nice}, arrivals {args.arrivals}"
    )
    print("engine capability as the auto sidecar learned it: " + str(learned.get("sidecar auto")))
    print_table(rows, added, cpu_ms, failed)
    print(f"(CPU: the sidecar's, per streamed request of {args.tokens} tokens + usage + [DONE])")
    os.makedirs(RESULTS, exist_ok=True)
    suffix = ("_engine" if args.engine else "") + ("_spread" if args.arrivals == "spread" else "")
    suffix += "" if args.tracing == "off" else f"_tracing_{args.tracing}"
    suffix += "_llmd" if args.llmd else ""
    suffix += "_gateway" if args.gateway else ""
    out = os.path.join(RESULTS, f"sidecar_overhead{suffix}.json")
    with open(out, "w") as fh:
        json.dump(
            {
                "concurrency": args.concurrency,
                "upstream": upstream_name,
                "cpus": os.cpu_count(),
                "load_average": load,
                "sidecar_nice": args.sidecar_nice,
                "sidecar_workers": args.sidecar_workers or "default",
                "arrivals": args.arrivals,
                "engine_rejects": args.engine_rejects,
                "tracing": args.tracing,
                "baseline_commit": args.baseline_commit,
                "capability_learned": learned,
                "llmd_pd_sidecar": args.llmd_binary,
                "sidecar_cpu_ms_per_request": cpu_ms,
                "failed_streams": failed,
                "rows": rows,
                "added": added,
            },
            fh,
            indent=2,
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
