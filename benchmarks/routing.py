"""Routing strategies on a shared-prefix workload through `pdpool up --decode 4`, and the
KV index's own cost.

    python benchmarks/routing.py [--decode 4] [--prefixes 8] [--per-prefix 6] [--skip-e2e]

Strategies: round-robin (the client sends to the sidecars in turn), hash affinity (the
gateway as before), precise (the gateway with --kv-events: cost = uncached tokens + load),
all with aggregated sidecars; then precise again with decode-first sidecars, to count the
decode-first round trips the up-front P/D decision saves (requests the gateway sent straight
to P/D, which the engine would have rejected after a round trip) and its mispredictions.
Reported: prefix hit rate on the decode engines (vllm:prefix_cache_hits / queries, this
run's delta) and as a fraction of the oracle's (every request after the first of its prefix
finds the whole prefix cached: the most any router can get), TTFT p50/p99 (streamed), output
tokens/s. Then the index alone: memory per million blocks and events/s. Prints a table and
writes benchmarks/results/routing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
import tracemalloc

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import print_table, write_json
from pdpool.kv_events import BlockStored, KVEventBatch
from pdpool.sidecar.kv_index import KVIndex
from pdpool.sidecar.topology import Topology, TopologySpec, ensure_tiny_model


def engine_sum(urls: list[str], name: str) -> float:
    total = 0.0
    for url in urls:
        for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                head = line.split(" ")[0]
                # `name` may carry leading labels: 'metric{label="x"'
                if (
                    head == name
                    or head.startswith(name + "{")
                    or ("{" in name and head.startswith(name))
                ):
                    total += float(line.rsplit(" ", 1)[1])
    return total


def oracle_hit_rate(args, reqs: list[list[int]], block_size: int = 16) -> float:
    """Every request after the first of its prefix hits the prefix's full blocks."""
    per_prefix = args.prefix_tokens // block_size * block_size
    hits = per_prefix * (len(reqs) - args.prefixes)
    return hits / sum(len(r) for r in reqs)


def workload(args) -> list[list[int]]:
    rng = random.Random(0)
    prefixes = [
        [rng.randrange(3, 500) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)
    ]
    reqs = [
        p + [rng.randrange(3, 500) for _ in range(32)]
        for p in prefixes
        for _ in range(args.per_prefix)
    ]
    rng.shuffle(reqs)
    return reqs


async def drive(targets, model: str, reqs, concurrency: int) -> tuple[list[float], int, float]:
    ttfts: list[float] = []
    tokens = 0
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as c:

        async def one(i: int, prompt: list[int]) -> None:
            nonlocal tokens
            async with sem:
                t0 = time.perf_counter()
                first = None
                async with c.stream(
                    "POST",
                    targets(i) + "/v1/completions",
                    json={
                        "model": model,
                        "prompt": prompt,
                        "max_tokens": 8,
                        "temperature": 0,
                        "ignore_eos": True,
                        "stream": True,
                    },
                ) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data:") and "[DONE]" not in line:
                            first = first or time.perf_counter()
                            tokens += 1
                ttfts.append((first or time.perf_counter()) - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(reqs)))
        return ttfts, tokens, time.perf_counter() - t0


def run_strategy(name: str, args, model_dir: str, mode: str = "aggregated") -> dict:
    spec = TopologySpec(
        model=model_dir,
        prefill=1,
        decode=args.decode,
        mode=mode,
        engine_args=["--num-kv-blocks", str(args.kv_blocks)],
        kv_events=name.startswith("precise"),
        kv_load_cost=args.load_cost,
    )
    topo = Topology(spec)
    topo.start(timeout_s=300)
    try:
        decodes = [d.url for d in topo.by_role("decode")]
        sidecars = [s.url for s in topo.by_role("sidecar")]
        gw = topo.gateway.url
        model = httpx.get(gw + "/v1/models").json()["data"][0]["id"]
        q0 = engine_sum(decodes, "vllm:prefix_cache_queries_total")
        h0 = engine_sum(decodes, "vllm:prefix_cache_hits_total")
        targets = (
            (lambda i: sidecars[i % len(sidecars)]) if name == "round-robin" else (lambda i: gw)
        )
        ttfts, tokens, wall = asyncio.run(drive(targets, model, workload(args), args.concurrency))
        q = engine_sum(decodes, "vllm:prefix_cache_queries_total") - q0
        h = engine_sum(decodes, "vllm:prefix_cache_hits_total") - h0
        hints = {
            o: engine_sum(sidecars, "pdpool_sidecar_kv_path_hints_total{" + o)
            for o in (
                'hint="pd",outcome="honoured"',
                'hint="decode",outcome="correct"',
                'hint="decode",outcome="mispredicted"',
            )
        }
    finally:
        topo.stop()
    ttfts.sort()
    return {
        "strategy": name,
        "mode": mode,
        "hit_rate": h / q if q else 0.0,
        "round_trips_saved": int(hints['hint="pd",outcome="honoured"']),
        "mispredicted": int(hints['hint="decode",outcome="mispredicted"']),
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "tok_s": tokens / wall,
    }


def index_cost(n_blocks: int = 1_000_000, per_event: int = 16) -> dict:
    rng = random.Random(1)
    batches = []
    for _ in range(n_blocks // per_event):
        hashes = [rng.randbytes(32) for _ in range(per_event)]
        batches.append(
            KVEventBatch(0.0, [BlockStored(hashes, None, [], 16, None, "GPU", 0, "full_attention")])
        )
    index = KVIndex(max_blocks_per_engine=n_blocks)
    tracemalloc.start()
    t0 = time.perf_counter()
    for seq, b in enumerate(batches):
        index.on_message("e", seq, b)
    dt = time.perf_counter() - t0
    mem = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {
        "blocks": index.block_count("e"),
        "MiB_per_million_blocks": mem / 2**20 * 1e6 / n_blocks,
        "events_per_s": len(batches) / dt,
        "blocks_per_s": n_blocks / dt,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--per-prefix", type=int, default=6)
    ap.add_argument("--prefix-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--kv-blocks", type=int, default=512)
    ap.add_argument("--model")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument(
        "--load-cost",
        type=float,
        default=None,
        help="the gateway's --kv-load-cost (default: the gateway's own)",
    )
    ap.add_argument(
        "--only", default=None, help="comma-separated strategy rows to run, e.g. precise/aggregated"
    )
    args = ap.parse_args()
    rows: list[dict] = []
    oracle = oracle_hit_rate(args, workload(args))
    if not args.skip_e2e:
        model_dir = args.model or ensure_tiny_model("qwen3")
        for name, mode in (
            ("round-robin", "aggregated"),
            ("affinity", "aggregated"),
            ("precise", "aggregated"),
            ("precise", "decode-first"),
        ):
            if args.only and f"{name}/{mode}" not in args.only.split(","):
                continue
            r = run_strategy(name, args, model_dir, mode)
            r["of_oracle"] = r["hit_rate"] / oracle
            rows.append(r)
            print(f"{name} ({mode}): {r}", flush=True)
        rr = rows[0]["ttft_p50_ms"] if rows[0]["strategy"] == "round-robin" else float("nan")
        for r in rows:
            r["ttft_p50_vs_rr"] = r["ttft_p50_ms"] / rr
        print_table(
            rows,
            f"{args.decode} decode engines, {args.prefixes} prefixes x "
            f"{args.per_prefix} requests, {args.prefix_tokens}-token prefixes + "
            f"32 own tokens, concurrency {args.concurrency}; oracle hit rate "
            f"{oracle:.3f}",
        )
    c = index_cost()
    print(
        f"index: {c['MiB_per_million_blocks']:.0f} MiB per million blocks, "
        f"{c['events_per_s']:.0f} events/s ({c['blocks_per_s']:.0f} blocks/s, "
        f"16 hashes per BlockStored)"
    )
    write_json(
        "routing", {"args": vars(args), "oracle_hit_rate": oracle, "strategies": rows, "index": c}
    )


if __name__ == "__main__":
    main()
