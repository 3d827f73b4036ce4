"""P/D-aware autoscaling measured through `pdpool up`: the same load ramp against static
minimum replicas, static maximum replicas, and `pdpool up --autoscale` between them.

The load: closed-loop users (each sends its next request when the last one ends), ramped
1 -> N -> 1 twice: a long-prompt phase (prompts of --long-prompt words, 16 tokens out) and a
long-output phase (short prompts, --long-output tokens out), --step-s seconds per level.
Reported per variant: SLO attainment (share of requests with TTFT <= target and mean
inter-token latency <= target), TTFT/ITL p90, engine-seconds (prefill + decode engine
processes alive, integrated over the run, from the state file), scale events, failed
requests (non-200, broken or short streams).

Backends:
  pdpool  real `pdpool serve` engines (tiny model): on this 2-core machine replicas share
          the same cores, so extra ones add little compute;
  sim     llm-d-inference-sim (scripts/llm-d-sim/build-sim.sh) behind `pdpool up --engine
          vllm` (benchmarks/sim_engine.py): each replica has its own capacity, as GPUs.

    python benchmarks/autoscale.py --backend sim --users 12 --step-s 8 --interval-s 1
    python benchmarks/autoscale.py --backend pdpool --users 6 --step-s 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import contextlib
import os
import random
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, write_json

ROOT = Path(__file__).resolve().parent.parent
PDPOOL = [sys.executable, "-c", "import sys; from pdpool.cli import main; sys.exit(main())"]


@dataclass
class Result:
    phase: str
    users: int = 0  # the load level it was sent at
    status: int = 0
    ttft: Optional[float] = None
    itl: Optional[float] = None
    tokens: int = 0
    error: Optional[str] = None


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    engine_seconds: float = 0.0
    events: list[dict] = field(default_factory=list)
    max_engines: int = 0
    # (seconds since the load began, what happened): load levels and engine counts
    timeline: list[tuple[float, str]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def mark(self, what: str) -> None:
        self.timeline.append((round(time.monotonic() - self.started, 1), what))


def levels(users: int) -> list[int]:
    up = sorted({1, max(users // 4, 1), max(users // 2, 1), users})
    return up + up[-2::-1]


async def one_request(client, url, model, phase, users, prompt_words, max_tokens) -> Result:
    body = {
        "model": model,
        # A unique head: no two prompts share KV blocks (one token per "a ").
        "prompt": f"{random.randrange(10**9)} " + "a " * prompt_words,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    res = Result(phase, users)
    start = time.monotonic()
    first = last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            res.status = r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.monotonic()
                first = first or now
                last = now
                res.tokens += 1
    except httpx.HTTPError as exc:
        res.error = repr(exc)
    if first is not None:
        res.ttft = first - start
        if res.tokens > 1 and last is not None:
            res.itl = (last - first) / (res.tokens - 1)
    return res


async def ramp(url, model, args, run: Run) -> None:
    phases = [("long-prompt", args.long_prompt, 16), ("long-output", 24, args.long_output)]
    async with httpx.AsyncClient(timeout=300) as client:
        for phase, words, max_tokens in phases:
            for n in levels(args.users):
                stop = time.monotonic() + args.step_s
                run.mark(f"load: {phase}, {n} users")

                async def user(phase=phase, n=n, words=words, max_tokens=max_tokens, stop=stop):
                    while time.monotonic() < stop:
                        run.results.append(
                            await one_request(client, url, model, phase, n, words, max_tokens)
                        )

                await asyncio.gather(*(user() for _ in range(n)))


def count_engines(state_file: str) -> tuple[list[dict], list[dict]]:
    """The engine processes alive (any state) and the scale events, from the state file."""
    try:
        with open(state_file) as fh:
            state = json.load(fh)
    except (OSError, ValueError):
        return [], []
    engines = [c for c in state["children"] if c["role"] in ("prefill", "decode")]
    return engines, (state.get("autoscaling") or {}).get("events", [])


def engine_counts(engines: list[dict]) -> str:
    parts = []
    for role in ("prefill", "decode"):
        states = [c.get("state", "serving") for c in engines if c["role"] == role]
        extra = len(states) - states.count("serving")
        parts.append(f"{role} {states.count('serving')}" + (f"(+{extra})" if extra else ""))
    return "engines: " + ", ".join(parts)


def sampler(state_file: str, run: Run, stop: threading.Event) -> None:
    last, shown = time.monotonic(), ""
    while not stop.is_set():
        time.sleep(0.25)
        now = time.monotonic()
        engines, events = count_engines(state_file)
        run.engine_seconds += len(engines) * (now - last)
        run.max_engines = max(run.max_engines, len(engines))
        run.events = events
        counts = engine_counts(engines)
        if engines and counts != shown:
            run.mark(counts)
            shown = counts
        last = now


def sim_wrapper(work: Path) -> str:
    script = work / "vllm-sim"
    script.write_text(
        f'#!/bin/sh\nexec {sys.executable} {ROOT / "benchmarks" / "sim_engine.py"} "$@"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def up_command(args, variant: str, state_file: str, log_dir: str) -> list[str]:
    lo_p, hi_p, lo_d, hi_d = args.prefill_min, args.prefill_max, args.decode_min, args.decode_max
    p, d = {"static-min": (lo_p, lo_d), "static-max": (hi_p, hi_d)}.get(variant, (lo_p, lo_d))
    cmd = [*PDPOOL, "up", "--port", "0", "--prefill", str(p), "--decode", str(d)]
    cmd += ["--state-file", state_file, "--log-dir", log_dir]
    if args.backend == "sim":
        cmd += ["--engine", "vllm", "--kv-connector", "none", "--prefill-min-prompt-tokens", "256"]
    else:
        cmd += ["--engine-arg=--max-model-len=4096"]
    if variant == "autoscale":
        cmd += ["--autoscale", "--prefill-max", str(hi_p), "--decode-max", str(hi_d)]
        cmd += ["--ttft-target-ms", str(args.ttft_ms), "--itl-target-ms", str(args.itl_ms)]
        cmd += ["--autoscale-interval-s", str(args.interval_s)]
        cmd += ["--scale-down-window-s", str(args.down_window_s)]
        # The planner's inputs, for replaying its decisions (pdpool/planner/trace.py).
        cmd += ["--autoscale-trace", str(Path(log_dir).parent / f"trace-{args.backend}.jsonl.gz")]
    return cmd


def run_variant(args, variant: str, work: Path, env: dict) -> Run:
    """One variant; started again once if `pdpool up` fails to start (two processes of a
    busy machine can race for the same free port)."""
    try:
        return run_once(args, variant, work, env, "")
    except StartFailed as exc:
        print(f"{variant}: {exc}; starting it again", file=sys.stderr)
        return run_once(args, variant, work, env, "-retry")


class StartFailed(RuntimeError):
    pass


def run_once(args, variant: str, work: Path, env: dict, suffix: str) -> Run:
    variant_dir = variant + suffix
    state_file = str(work / f"{variant_dir}.json")
    log_dir = str(work / f"logs-{variant_dir}")
    with open(work / f"{variant_dir}.out", "wb") as out:
        proc = subprocess.Popen(
            up_command(args, variant, state_file, log_dir),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            return measure(args, proc, state_file, out.name)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)


def measure(args, proc: subprocess.Popen, state_file: str, out_name: str) -> Run:
    run, stop = Run(), threading.Event()
    deadline = time.monotonic() + 600
    while not os.path.exists(state_file):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise StartFailed(f"pdpool up did not start: see {out_name}")
        time.sleep(0.5)
    with open(state_file) as fh:
        url = json.load(fh)["gateway_url"]
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    run.started = time.monotonic()
    thread = threading.Thread(target=sampler, args=(state_file, run, stop))
    thread.start()
    try:
        asyncio.run(ramp(url, model, args, run))
    finally:
        stop.set()
        thread.join()
    return run


def p90(values: list[float]) -> Optional[float]:
    values = sorted(values)
    return values[int(0.9 * (len(values) - 1))] if values else None


def within_slo(args, r: Result) -> bool:
    if r.status != 200 or r.error or r.ttft is None:
        return False
    return r.ttft <= args.ttft_ms / 1000 and (r.itl or 0) <= args.itl_ms / 1000


def slo_by_level(args, run: Run) -> dict[str, str]:
    """SLO attainment per load level (phase and users): where the misses are."""
    out = {}
    for phase in ("long-prompt", "long-output"):
        for users in sorted({r.users for r in run.results if r.phase == phase}):
            level = [r for r in run.results if r.phase == phase and r.users == users]
            met = sum(1 for r in level if within_slo(args, r))
            out[f"{phase} x{users}"] = f"{met}/{len(level)}"
    return out


def summarize(args, variant: str, run: Run) -> dict:
    ok = [r for r in run.results if r.status == 200 and not r.error and r.ttft is not None]
    failed = len(run.results) - len(ok)
    within = [r for r in ok if within_slo(args, r)]
    ups, downs = (sum(1 for e in run.events if e.get("direction") == d) for d in ("up", "down"))
    ttft, itl = p90([r.ttft for r in ok]), p90([r.itl for r in ok if r.itl is not None])
    return {
        "variant": variant,
        "requests": len(run.results),
        "slo_pct": round(100 * len(within) / max(len(run.results), 1), 1),
        "ttft_p90_s": round(ttft, 3) if ttft is not None else None,
        "itl_p90_ms": round(1000 * itl, 1) if itl is not None else None,
        "engine_s": round(run.engine_seconds, 1),
        "max_engines": run.max_engines,
        "scale_events": f"{ups} up / {downs} down",
        "failed": failed,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("pdpool", "sim"), default="sim")
    ap.add_argument("--users", type=int, default=12)
    ap.add_argument("--step-s", type=float, default=8.0)
    ap.add_argument("--long-prompt", type=int, default=1500, help="words (~tokens)")
    ap.add_argument("--long-output", type=int, default=128, help="tokens")
    ap.add_argument("--prefill-min", type=int, default=1)
    ap.add_argument("--prefill-max", type=int, default=3)
    ap.add_argument("--decode-min", type=int, default=1)
    ap.add_argument("--decode-max", type=int, default=3)
    ap.add_argument("--ttft-ms", type=float, default=1000.0)
    ap.add_argument("--itl-ms", type=float, default=50.0)
    ap.add_argument("--interval-s", type=float, default=1.0)
    ap.add_argument("--down-window-s", type=float, default=10.0)
    ap.add_argument(
        "--sim-args",
        default="--max-num-seqs 4 --prefill-time-per-token 0.2ms --prefill-overhead 20ms "
        "--inter-token-latency 15ms --time-factor-under-load 2.0 --max-model-len 8192",
        help="the simulator's latencies and capacity per replica (sim backend)",
    )
    ap.add_argument("--variants", default="static-min,static-max,autoscale")
    args = ap.parse_args()
    env = dict(os.environ)
    work = Path(tempfile.mkdtemp(prefix="autoscale-bench-"))
    if args.backend == "sim":
        env["PDPOOL_VLLM_BIN"] = sim_wrapper(work)
        env["PDPOOL_SIM_ARGS"] = args.sim_args
    rows, timelines = [], {}
    for variant in args.variants.split(","):
        run = run_variant(args, variant, work, env)
        rows.append(summarize(args, variant, run))
        timelines[variant] = {"events": run.timeline, "slo_by_level": slo_by_level(args, run)}
        print_table(rows[-1:], f"{variant} ({args.backend})")
    print_table(rows, f"autoscaling, backend {args.backend}: ramp 1..{args.users} users and back")
    result = {"args": vars(args), "rows": rows, "timelines": timelines}
    path = write_json(f"autoscale_{args.backend}", result)
    print(f"\nJSON: {path}\nlogs: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
