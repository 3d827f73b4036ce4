"""Guided decoding's cost: output tokens/s of 64 concurrent streaming requests with 0%, 50%
and 100% of them guided by a JSON schema, pdpool serve vs stock vLLM (CPU build) on the same
checkpoint.

    python benchmarks/structured_outputs.py                    # small model, best of 2
    python benchmarks/structured_outputs.py --rounds 1 --fractions 0,1

Workload: /v1/completions with token-id prompts of 16-128 tokens, greedy, max_tokens 64;
unguided requests ignore EOS (64 tokens each); guided ones carry `structured_outputs.json`
(an object holding an array of integers, free whitespace as both engines default) and end
when the grammar does or at 64 tokens. Both engines use xgrammar. Each engine runs alone (the
other SIGSTOPped), rounds alternate, the best round counts. Reported per fraction: output
tok/s of each engine, the ratio pdpool / vLLM, and each engine's throughput relative to its
own unguided run (the cost of guiding); also output tokens per CPU second of each server's
processes, steadier than wall time on a shared machine (`_cpu` columns).
Results: benchmarks/results/structured_outputs.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import print_table, write_json
from benchmarks.engine_vs_vllm import Server, model_for, sse_lines
from pdpool.up.topology import VLLM_ARGS, VLLM_ENV, free_port, pdpool_command, served_model_name
from pdpool.up.topology import vllm_command as default_vllm

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "values": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["name", "values"],
}
MAX_TOKENS = 64


def workload(n: int, fraction: float, seed: int, vocab: int) -> list[dict]:
    """n request bodies, the first round(n * fraction) of them guided."""
    rng = random.Random(seed)
    guided = round(n * fraction)
    bodies = []
    for i in range(n):
        body = {
            "prompt": [rng.randrange(3, vocab - 20) for _ in range(rng.randint(16, 128))],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if i < guided:
            body["structured_outputs"] = {"json": SCHEMA}
        else:
            body["ignore_eos"] = True
        bodies.append(body)
    return bodies


async def one(client: httpx.AsyncClient, url: str, body: dict) -> int:
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in sse_lines(r):
            if line.startswith("data: ") and line != "data: [DONE]":
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


async def run_round(url: str, model: str, bodies: list[dict]) -> dict:
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(timeout=1800, limits=limits) as client:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(client, url, {"model": model, **b}) for b in bodies))
        wall = time.perf_counter() - t0
    return {"tok_s": sum(counts) / wall, "output_tokens": sum(counts), "wall_s": wall}


def servers(model: str, args) -> tuple[Server, Server]:
    logs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "logs")
    os.makedirs(logs, exist_ok=True)
    p1, p2 = free_port(), free_port()
    ours = Server(
        "pdpool",
        pdpool_command(
            "serve", model, "--port", str(p1), "--device", "cpu", "--log-level", "warning"
        ),
        p1,
        os.path.join(logs, "structured-pdpool.log"),
    )
    theirs = Server(
        "vllm",
        [
            args.vllm_bin or default_vllm(),
            "serve",
            model,
            "--port",
            str(p2),
            "--served-model-name",
            served_model_name(model),
            *VLLM_ARGS,
        ],
        p2,
        os.path.join(logs, "structured-vllm.log"),
        dict(VLLM_ENV),
    )
    return ours, theirs


def one_round(s: Server, other: Server, name: str, bodies: list[dict]) -> tuple[float, float]:
    """(output tok/s, output tokens per CPU second of the server) with the other stopped."""
    other.signal(signal.SIGSTOP)
    try:
        cpu0 = s.cpu_seconds()
        res = asyncio.run(run_round(s.url, name, bodies))
        cpu = s.cpu_seconds() - cpu0
    finally:
        other.signal(signal.SIGCONT)
    return res["tok_s"], res["output_tokens"] / max(cpu, 1e-9)


def best_rounds(ours: Server, theirs: Server, name: str, work: dict, rounds: int) -> dict:
    """Per fraction, the best tok/s and tok per CPU-s of each engine; the fractions and the
    engines interleave in every round, so that a busy moment of the machine is shared."""
    best: dict = {f: {} for f in work}
    for _ in range(rounds):
        for fraction, bodies in work.items():
            for s, other in ((ours, theirs), (theirs, ours)):
                tok_s, per_cpu = one_round(s, other, name, bodies)
                row = best[fraction]
                row[s.name] = max(row.get(s.name, 0.0), tok_s)
                row[f"{s.name}_cpu"] = max(row.get(f"{s.name}_cpu", 0.0), per_cpu)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fractions", default="0,0.5,1", help="guided fractions to run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-bin", help="the vllm executable (default: the build-venv.sh venv)")
    args = ap.parse_args()
    model = model_for("small")
    name = served_model_name(model)
    with open(os.path.join(model, "config.json")) as fh:
        vocab = json.load(fh)["vocab_size"]
    ours, theirs = servers(model, args)
    rows = []
    try:
        ours.wait(), theirs.wait()
        warm = workload(4, 1.0, args.seed + 1, vocab)
        for s in (ours, theirs):
            asyncio.run(run_round(s.url, name, warm))
        work = {
            float(f): workload(args.requests, float(f), args.seed, vocab)
            for f in args.fractions.split(",")
        }
        for fraction, best in best_rounds(ours, theirs, name, work, args.rounds).items():
            rows.append({"guided": f"{fraction:.0%}", **best})
    finally:
        ours.stop()
        theirs.stop()
    base = rows[0] if rows and rows[0]["guided"] == "0%" else None
    for r in rows:
        r["ratio"] = r["pdpool"] / r["vllm"]
        r["ratio_cpu"] = r["pdpool_cpu"] / r["vllm_cpu"]
        if base:
            r["ours_vs_0%"] = r["pdpool"] / base["pdpool"]
            r["ours_cpu_vs_0%"] = r["pdpool_cpu"] / base["pdpool_cpu"]
            r["vllm_cpu_vs_0%"] = r["vllm_cpu"] / base["vllm_cpu"]
    print_table(rows, f"output tok/s, {args.requests} concurrent requests (best of {args.rounds})")
    write_json("structured_outputs", {"rows": rows, "args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
