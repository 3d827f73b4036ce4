"""Priority past the gateway: a high-priority trickle's TTFT under a saturating low-priority
load, through `pdpool up` on its defaults with a tenants file of two bands.

    python benchmarks/priority.py [--seconds 20] [--rounds 2] [--batch-streams 64]
                                  [--high-rps 1] [--policies priority,fcfs] [--model DIR]

Tenants: `interactive` (band 10) and `batch` (band -1); the gateway writes each request's
band into its body as the engines' `priority` (= -band), and `pdpool up --tenants-file`
runs the engines with --scheduling-policy priority. The batch tenant keeps
`--batch-streams` long streams open (closed loop, `--batch-max-tokens` each: the engines'
batch stays full); the interactive tenant sends `--high-rps` streamed completions a second
(Poisson, `--high-max-tokens` each) from this process (the load runs in a process of its
own, so parsing its streams never delays a measured first token). Phases of --seconds,
alternating for --rounds rounds (this machine's other load drifts: both see it):
  alone    the interactive tenant by itself
  loaded   the interactive tenant beside the batch load
`--policies priority,fcfs` runs the same on a second topology whose engines are told
--scheduling-policy fcfs (they ignore the band: today's behaviour past the gateway).
Reported per policy and phase: interactive TTFT p50/p99 (first streamed token) and p99
against alone, batch tokens a second, and requests that ended with neither an answer nor
a 429 ("lost": must be 0). The goal (issue 37): loaded p99 within 2x of alone under
priority. Writes benchmarks/results/priority.json.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import print_table, write_json
from pdpool.up.topology import SIDE_BY_SIDE, Topology, TopologySpec, ensure_tiny_model

KEYS = {"interactive": "interactive-key-0000000001", "batch": "batch-key-00000000000001"}
TENANTS = f"""tenants:
  - {{name: interactive, keys: ['{KEYS["interactive"]}'], priority: 10}}
  - {{name: batch, keys: ['{KEYS["batch"]}'], priority: -1}}
"""
WORDS = "river stone cloud lantern harbor meadow copper violet engine orbit signal garden".split()
LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=512)
CUT = -1  # a stream still open when its phase ended (cut by the client: not lost)


@dataclass
class Outcome:
    tenant: str
    status: int  # HTTP status; 0: no answer at all; CUT
    ttft_s: Optional[float] = None
    tokens: int = 0
    error: str = ""


@dataclass
class Run:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0


def body(rng: random.Random, words: int, max_tokens: int) -> dict:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return {"prompt": text, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}


async def one(client: httpx.AsyncClient, tenant: str, req: dict) -> Outcome:
    start, out = time.perf_counter(), Outcome(tenant, 0)
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    try:
        async with client.stream("POST", "/v1/completions", json=req, headers=headers) as r:
            if r.status_code != 200:
                out.status, out.error = r.status_code, (await r.aread()).decode()[:200]
                return out
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"text"' in line:
                    if out.ttft_s is None:
                        out.ttft_s = time.perf_counter() - start
                    out.tokens += 1
                elif line.startswith("data: [DONE]"):
                    out.status = 200
                    return out
            out.error = "stream ended without [DONE]"
    except asyncio.CancelledError:
        out.status = CUT
    except httpx.HTTPError as exc:
        out.error = repr(exc)
    return out


async def trickle(url: str, args: argparse.Namespace) -> list[Outcome]:
    """The interactive tenant: open-loop Poisson arrivals for --seconds."""
    rng = random.Random(1)  # the same arrivals every phase
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=LIMITS) as client:
        tasks, t0 = [], time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            req = body(rng, args.prompt_words, args.high_max_tokens)
            tasks.append(asyncio.ensure_future(one(client, "interactive", req)))
            await asyncio.sleep(rng.expovariate(args.high_rps))
        return list(await asyncio.gather(*tasks))


async def flood(url: str, args: argparse.Namespace, end: float) -> list[Outcome]:
    """The batch tenant: --batch-streams long streams, each renewed until `end`."""

    async def loop(i: int) -> list[Outcome]:
        rng, out = random.Random(100 + i), []
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=LIMITS) as client:
            while (left := end - time.perf_counter()) > 0:
                task = asyncio.ensure_future(
                    one(client, "batch", body(rng, args.prompt_words, args.batch_max_tokens))
                )
                done, _ = await asyncio.wait([task], timeout=left)
                if not done:
                    task.cancel()
                    out.append(await task)
                    break
                o = task.result()
                out.append(o)
                if o.status == 429:
                    await asyncio.sleep(0.2)
        return out

    parts = await asyncio.gather(*map(loop, range(args.batch_streams)))
    return [o for part in parts for o in part]


def flood_process(url: str, args: argparse.Namespace, end: float) -> list[Outcome]:
    return asyncio.run(flood(url, args, end))


def phase(url: str, args: argparse.Namespace, loaded: bool, run: Run) -> None:
    run.seconds += args.seconds
    if not loaded:
        run.outcomes += asyncio.run(trickle(url, args))
        return
    end = time.perf_counter() + args.settle_s + args.seconds
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        batch = pool.submit(flood_process, url, args, end)
        time.sleep(args.settle_s)  # the batch fills the engines first
        run.outcomes += asyncio.run(trickle(url, args))
        run.outcomes += batch.result()


def percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summary(policy: str, run: Run) -> dict:
    high = [o for o in run.outcomes if o.tenant == "interactive"]
    batch = [o for o in run.outcomes if o.tenant == "batch"]
    ttfts = [o.ttft_s * 1000 for o in high if o.status == 200 and o.ttft_s is not None]
    return {
        "policy": policy,
        "phase": run.name,
        "high_sent": len(high),
        "high_ok": sum(o.status == 200 for o in high),
        "high_ttft_p50_ms": percentile(ttfts, 0.5),
        "high_ttft_p99_ms": percentile(ttfts, 0.99),
        "batch_requests": len(batch),
        "batch_429": sum(o.status == 429 for o in batch),
        "batch_tokens_per_s": sum(o.tokens for o in batch) / run.seconds if batch else None,
        "lost": sum(o.status not in (200, 429, CUT) for o in run.outcomes),
    }


def run_policy(policy: str, model: str, tenants: str, args: argparse.Namespace) -> list[dict]:
    """One `pdpool up` on its defaults with the tenants file (engines: priority); `fcfs`
    tells its engines otherwise, for comparison."""
    engine_args = [] if policy == "priority" else ["--scheduling-policy", policy]
    spec = TopologySpec(model=model, tenants_file=tenants, engine_args=engine_args, **SIDE_BY_SIDE)
    alone, loaded = Run("alone"), Run("loaded")
    with Topology(spec) as topo:
        url = topo.gateway.url
        asyncio.run(trickle(url, argparse.Namespace(**{**vars(args), "seconds": 1.0})))  # warm
        for _ in range(args.rounds):
            phase(url, args, False, alone)
            phase(url, args, True, loaded)
    for run in (alone, loaded):
        for o in [o for o in run.outcomes if o.status not in (200, 429, CUT)][:5]:
            print(f"  lost ({policy} {run.name}): {o.tenant} {o.status} {o.error}", file=sys.stderr)
    rows = [summary(policy, alone), summary(policy, loaded)]
    base = rows[0]["high_ttft_p99_ms"]
    for r in rows:
        p99 = r["high_ttft_p99_ms"]
        r["p99_vs_alone"] = p99 / base if base and p99 else None
    return rows


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="checkpoint (default: the tiny test model)")
    p.add_argument("--seconds", type=float, default=20.0, help="of each phase")
    p.add_argument("--settle-s", type=float, default=2.0, help="batch load before measuring")
    p.add_argument("--rounds", type=int, default=2, help="alone / loaded phases, alternating")
    p.add_argument("--high-rps", type=float, default=1.0)
    p.add_argument("--high-max-tokens", type=int, default=16)
    p.add_argument("--batch-streams", type=int, default=64, help="saturates --max-num-seqs 64")
    p.add_argument("--batch-max-tokens", type=int, default=512)
    p.add_argument("--prompt-words", type=int, default=96)
    p.add_argument("--policies", default="priority,fcfs", help="engines' policies to run")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    model = args.model or ensure_tiny_model("qwen3")
    with tempfile.TemporaryDirectory() as tmp:
        tenants = os.path.join(tmp, "tenants.yaml")
        with open(tenants, "w") as f:
            f.write(TENANTS)
        rows = [
            r
            for policy in args.policies.split(",")
            for r in run_policy(policy, model, tenants, args)
        ]
    print_table(rows, "interactive (band 10) TTFT (ms) beside a batch (band -1) load")
    write_json("priority", {"args": vars(args), "rows": rows, "goal": "loaded p99 <= 2x alone"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
