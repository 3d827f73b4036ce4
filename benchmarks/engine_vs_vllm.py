"""pdpool serve vs stock vLLM (CPU build, scripts/vllm/build-venv.sh) on the same checkpoint.

    python benchmarks/engine_vs_vllm.py                  # small and large, best of 3
    python benchmarks/engine_vs_vllm.py --shapes small --rounds 1
    python benchmarks/engine_vs_vllm.py --shapes long,burst   # long prompts, no prefix reuse

Results: benchmarks/results/engine_vs_vllm.json, one entry per shape (a run replaces the
shapes it ran and keeps the others).

Workload: 64 concurrent streaming greedy /v1/completions (token-id prompts of 16-256 tokens,
outputs of 8-128 tokens with ignore_eos; one seeded random draw shared by both engines).
Each engine runs alone: the other server is SIGSTOPped during a round; rounds alternate
(ours, vLLM, ours, ...) and the best of N counts. Reported: output tokens/s (all output
tokens / wall time of the round) and their ratio (pdpool / vLLM), TTFT p50/p90 of that
round, output tokens per CPU second of the server's processes (steadier than wall time when
the machine is shared), tokens per streamed event (both servers send what waits for a reader
that fell behind in one event), and how many of the 64 greedy outputs are equal between the
engines, as token ids and as text (float32 both; vLLM on CPU with --enforce-eager). On these
random token-id prompts vLLM's streamed text is not always tokenizer.decode(its own token
ids) (its incremental detokenizer starts from the prompt's bytes), so the token ids are the
comparison that counts; ours is decode(ids).
Shapes: small = 2 layers, hidden 64, head_dim 32; large = 4 layers, hidden 512, head_dim 64.
Equal cores: the ratio that counts is against vLLM given every core this process may use
(`VLLM_CPU_OMP_THREADS_BIND` set to all of them; `--vllm-bind` picks others), as pdpool
serve uses them: torch in its engine process gets every usable core but one for decode
steps and every core for steps of 256 or more prompt tokens, through which its HTTP process
idles (engine/cpu_threads.py). A third server, vLLM on its own default (OpenMP bound to one
core, the other kept for its frontend), gives the defaults-vs-defaults column beside it
(`--no-defaults-column` skips it). Rounds cycle through the servers.
Both keep their prefix caches on (both defaults), and every round sends the same prompts:
after the first round the full prompt blocks are cache hits in both engines, so the best
round measures mostly decode (and TTFT mostly queueing behind the other requests).
Long-prompt shapes (the large model, max_model_len 4096 for both): prompts of 1000-3000
tokens, outputs of 32-64, fresh prompts every round (another seed per round, the same for
both engines), so nothing is a prefix hit and the rounds measure prefill; both engines get
the same 2 GiB of KV cache so that neither preempts. `long`: the requests go through 32
concurrent streams (a new one starts when one ends); `burst`: all of them at once. TTFT
p50/p90/p99 are reported for every shape.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.proc_cpu import fields_cpu_seconds, stat_fields
from pdpool.up.topology import (
    VLLM_ARGS,
    VLLM_ENV,
    free_port,
    healthy,
    pdpool_command,
    served_model_name,
    vllm_command,
)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SHAPES = {
    "small": dict(
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
    ),
    "large": dict(
        num_layers=4,
        hidden_size=512,
        intermediate_size=1024,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
    ),
}


@dataclass(frozen=True)
class Workload:
    model: str  # a key of SHAPES
    prompt: tuple[int, int] = (16, 256)  # token counts, inclusive
    output: tuple[int, int] = (8, 128)
    concurrency: Optional[int] = None  # streams at once; None: every request at once
    fresh: bool = False  # new prompts every round (no prefix reuse)
    max_model_len: Optional[int] = None  # both engines; None: their defaults
    kv_gib: Optional[int] = None  # both engines' KV cache; None: their defaults


LONG = dict(model="large", prompt=(1000, 3000), output=(32, 64), fresh=True)
WORKLOADS = {
    "small": Workload("small"),
    "large": Workload("large"),
    "long": Workload(**LONG, concurrency=32, max_model_len=4096, kv_gib=2),
    "burst": Workload(**LONG, max_model_len=4096, kv_gib=2),
}


def model_for(shape: str) -> str:
    from pdpool.engine.tiny_model import TinyModelSpec, write_tiny_model

    out = os.path.join(os.path.expanduser("~"), ".cache", "pdpool", f"bench-vllm-{shape}-h32")
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        write_tiny_model(out, TinyModelSpec(arch="qwen3", seed=7, **SHAPES[shape]))
    return out


def workload(
    n: int, seed: int, vocab: int, prompt=(16, 256), output=(8, 128)
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(3, vocab - 20) for _ in range(rng.randint(*prompt))],
            rng.randint(*output),
        )
        for _ in range(n)
    ]


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group `pgid`."""
    total = 0.0
    for entry in os.listdir("/proc"):
        fields = stat_fields(f"/proc/{entry}/stat") if entry.isdigit() else None
        if fields is not None and int(fields[2]) == pgid:
            total += fields_cpu_seconds(fields)
    return total


class Server:
    def __init__(self, name: str, argv: list[str], port: int, log: str, env=None):
        self.name, self.port, self.url = name, port, f"http://127.0.0.1:{port}"
        with open(log, "wb") as out:  # the child keeps its own copy of the file
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        self.log = log

    def wait(self, timeout: float = 900) -> float:
        t0 = time.monotonic()
        while not healthy(self.url):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {self.log}")
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(self.name)
            time.sleep(0.5)
        return time.monotonic() - t0

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server's live processes (its process group): on a
        shared machine, output tokens per CPU second vary less than per wall second."""
        return group_cpu_seconds(self.proc.pid)

    def signal(self, sig) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)


async def sse_lines(response: httpx.Response):
    """An SSE stream's lines, split at newlines only: httpx's aiter_lines also splits at
    \x1c, \x85, \u2028 and the like, which JSON leaves unescaped in a token's text (vLLM's
    events carry such text, and a split event is no longer JSON)."""
    pending = b""
    async for chunk in response.aiter_bytes():
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode()
    if pending:
        yield pending.decode()


async def one(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int
) -> tuple[float, str, int, list[int], int]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }  # vLLM's extension, also ours: token ids per chunk
    t0 = time.perf_counter()
    ttft, text, tokens, ids, events = None, [], 0, [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in sse_lines(r):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("choices"):
                events += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(ev["choices"][0].get("text") or "")
                ids.extend(ev["choices"][0].get("token_ids") or [])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
    return ttft or float("nan"), "".join(text), tokens, ids, events


async def run_round(url: str, model: str, work, concurrency: Optional[int] = None) -> dict:
    limits = httpx.Limits(max_connections=len(work), max_keepalive_connections=len(work))
    streams = asyncio.Semaphore(concurrency or len(work))

    async def limited(prompt, max_tokens):
        async with streams:  # TTFT counts from the request's own start, not its wait here
            return await one(client, url, model, prompt, max_tokens)

    async with httpx.AsyncClient(timeout=1800, limits=limits) as client:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(limited(p, m) for p, m in work))
        wall = time.perf_counter() - t0
    ttfts = sorted(o[0] for o in outs)
    tokens = sum(o[2] for o in outs)
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "tok_s": tokens / wall,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p90": ttfts[int(0.9 * len(ttfts))],
        "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        # Above 1 when the server sends several tokens per event (a reader behind the engine).
        "tokens_per_event": tokens / max(sum(o[4] for o in outs), 1),
        "texts": [o[1] for o in outs],
        "ids": [o[3] for o in outs],
    }


def vllm_server(name: str, model: str, served: str, bind: Optional[str], spec, log: str, vllm_bin):
    port = free_port()
    env = dict(VLLM_ENV)
    if bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    if spec.kv_gib:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.kv_gib)
    extra = ["--max-model-len", str(spec.max_model_len)] if spec.max_model_len else []
    argv = [vllm_bin or vllm_command(), "serve", model, "--port", str(port)]
    argv += ["--served-model-name", served, *VLLM_ARGS, *extra]  # later flags win
    return Server(name, argv, port, log, env)


def all_cores_bind() -> str:
    """VLLM_CPU_OMP_THREADS_BIND for every core this process may use (as pdpool serve)."""
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


def equal(a: list, b: list) -> int:
    return sum(x == y and len(x) > 0 for x, y in zip(a, b, strict=True))


def run_rounds(servers: list, shape: str, spec, name: str, work_of, warm, count: int) -> dict:
    """`count` rounds; in each, every server in turn runs the round's requests alone (the
    others SIGSTOPped). The first round starts with one warm-up request per server."""
    rounds: dict[str, list] = {s.name: [] for s in servers}
    for r in range(count):
        work = work_of(r)
        for s in servers:
            others = [o for o in servers if o is not s]
            for other in others:
                other.signal(signal.SIGSTOP)
            try:
                if r == 0:
                    asyncio.run(run_round(s.url, name, warm[:1]))
                cpu = s.cpu_seconds()
                res = asyncio.run(run_round(s.url, name, work, spec.concurrency))
                res["cpu_s"] = s.cpu_seconds() - cpu
                res["tok_per_cpu_s"] = res["output_tokens"] / max(res["cpu_s"], 1e-9)
                res["load_average"] = os.getloadavg()[0]
            finally:
                for other in others:
                    other.signal(signal.SIGCONT)
            rounds[s.name].append(res)
            print(
                f"  {shape} round {r + 1} {s.name}: {res['tok_s']:.0f} tok/s, "
                f"TTFT p50 {res['ttft_p50'] * 1000:.0f} ms, "
                f"p99 {res['ttft_p99'] * 1000:.0f} ms, "
                f"{res['tokens_per_event']:.2f} tokens per event, "
                f"{res['tok_per_cpu_s']:.0f} tok per CPU s, load {res['load_average']:.1f}",
                flush=True,
            )
    return rounds


def bench_shape(shape: str, args) -> dict:
    spec = WORKLOADS[shape]
    model = model_for(spec.model)
    name = served_model_name(model)
    with open(os.path.join(model, "config.json")) as fh:
        vocab = json.load(fh)["vocab_size"]

    def work_of(round_: int):
        seed = args.seed + (round_ if spec.fresh else 0)
        return workload(args.requests, seed, vocab, spec.prompt, spec.output)

    work = work_of(0)
    ours_extra = ["--max-model-len", str(spec.max_model_len)] if spec.max_model_len else []
    if spec.kv_gib:
        ours_extra += ["--kv-cache-memory", f"{spec.kv_gib}GiB"]
    logs = os.path.join(RESULTS, "logs")
    os.makedirs(logs, exist_ok=True)
    p1 = free_port()
    argv = ["serve", model, "--port", str(p1), "--device", "cpu", "--log-level", "warning"]
    servers = [
        Server(
            "pdpool",
            pdpool_command(*argv, *ours_extra, *args.pdpool_flag),
            p1,
            os.path.join(logs, f"vs-vllm-{shape}-pdpool.log"),
        )
    ]
    bind = args.vllm_bind or all_cores_bind()
    log = os.path.join(logs, f"vs-vllm-{shape}-vllm.log")
    servers.append(vllm_server("vllm", model, name, bind, spec, log, args.vllm_bin))
    if args.defaults_column:
        log = os.path.join(logs, f"vs-vllm-{shape}-vllm-default.log")
        servers.append(vllm_server("vllm_default", model, name, None, spec, log, args.vllm_bin))
    try:
        start = {s.name: s.wait() for s in servers}
        # a warm-up request that is no prefix of any round's prompts when those are fresh
        warm = workload(1, args.seed - 1, vocab, spec.prompt, spec.output) if spec.fresh else work
        rounds = run_rounds(servers, shape, spec, name, work_of, warm, args.rounds)
    finally:
        for s in servers:
            s.stop()
    best = {k: max(v, key=lambda x: x["tok_s"]) for k, v in rounds.items()}
    first = {k: v[0] for k, v in rounds.items()}  # round 1: the same prompts for every server
    ours = first["pdpool"]
    result = {
        "shape": shape,
        "spec": SHAPES[spec.model],
        "workload": {
            "prompt": spec.prompt,
            "output": spec.output,
            "concurrency": spec.concurrency,
            "fresh_prompts": spec.fresh,
            "max_model_len": spec.max_model_len,
            "kv_gib": spec.kv_gib,
        },
        "pdpool_flags": args.pdpool_flag,
        "vllm_bind": bind,
        "startup_s": start,
        "best": {
            k: {kk: vv for kk, vv in v.items() if kk not in ("texts", "ids")}
            for k, v in best.items()
        },
        "all_tok_s": {k: [round(x["tok_s"], 1) for x in v] for k, v in rounds.items()},
        "all_ttft_p99": {k: [round(x["ttft_p99"], 3) for x in v] for k, v in rounds.items()},
        "all_tok_per_cpu_s": {
            k: [round(x["tok_per_cpu_s"], 1) for x in v] for k, v in rounds.items()
        },
        "ratio": round(best["pdpool"]["tok_s"] / max(best["vllm"]["tok_s"], 1e-9), 3),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "equal_texts": sum(map(str.__eq__, ours["texts"], first["vllm"]["texts"])),
        "equal_token_ids": equal(ours["ids"], first["vllm"]["ids"]),
        "requests": len(work),
    }
    if "vllm_default" in best:
        result["ratio_defaults"] = round(
            best["pdpool"]["tok_s"] / max(best["vllm_default"]["tok_s"], 1e-9), 3
        )
        result["equal_token_ids_defaults"] = equal(ours["ids"], first["vllm_default"]["ids"])
    return result


def write_results(results: list[dict]) -> None:
    """Into engine_vs_vllm.json, replacing the shapes run and keeping the others' last run."""
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, "engine_vs_vllm.json")
    try:
        with open(path) as fh:
            kept = [r for r in json.load(fh) if r.get("shape") not in {x["shape"] for x in results}]
    except (OSError, ValueError):
        kept = []
    order = list(WORKLOADS)
    merged = sorted(
        kept + results, key=lambda r: order.index(r["shape"]) if r["shape"] in order else 99
    )
    with open(path, "w") as fh:
        json.dump(merged, fh, indent=2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="small,large", help=f"of {','.join(WORKLOADS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-bin", help="the vllm executable (default: the build-venv.sh venv)")
    ap.add_argument(
        "--vllm-bind",
        help="VLLM_CPU_OMP_THREADS_BIND for the equal-cores vLLM (default: every core here)",
    )
    ap.add_argument(
        "--no-defaults-column",
        dest="defaults_column",
        action="store_false",
        help="skip the third server (vLLM on its own default bind)",
    )
    ap.add_argument(
        "--pdpool-flag",
        action="append",
        default=[],
        help="an extra flag for pdpool serve, e.g. --pdpool-flag=--no-engine-process (repeat)",
    )
    args = ap.parse_args()
    results = []
    unknown = set(args.shapes.split(",")) - set(WORKLOADS)
    if unknown:
        ap.error(f"unknown shapes {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    for shape in args.shapes.split(","):
        results.append(bench_shape(shape, args))
    print(
        "\n| shape | engine | output tok/s (best of %d) | ratio | TTFT p50 | TTFT p90 | TTFT p99 "
        "| tok per CPU s | equal token ids |" % args.rounds
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for res in results:
        ours = res["best"]["pdpool"]["tok_s"]
        for eng, b in res["best"].items():
            same = {"pdpool": "-", "vllm": res["equal_token_ids"]}.get(
                eng, res.get("equal_token_ids_defaults")
            )
            print(
                f"| {res['shape']} | {eng} | {b['tok_s']:.0f} | {ours / b['tok_s']:.2f} "
                f"| {b['ttft_p50'] * 1000:.0f} ms | {b['ttft_p90'] * 1000:.0f} ms "
                f"| {b['ttft_p99'] * 1000:.0f} ms | {b['tok_per_cpu_s']:.0f} "
                f"| {same}/{res['requests']} |"
            )
    print(
        "(ratio: pdpool's output tok/s over that server's; vllm = equal cores, "
        "vllm_default = its own bind)"
    )
    write_results(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
