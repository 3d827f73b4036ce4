"""Multi-turn sessions whose working set is many times the KV pool, through `pdpool up`:
offload tiers off vs a local disk tier per engine vs one directory shared by the engines.

Each session has a long private prefix (a document, ~3000 tokens) and comes back for more
turns after every other session has had its turn, so by then its prefix has long left the
pool (the pool holds a fraction of the sessions' prefixes: `working set / pool` is
printed). Without a tier a returning turn recomputes its whole prefix; with one it loads it.
The gateway spreads requests over the decode engines, so with a per-engine disk tier a
session that lands on another engine recomputes, while the shared tier serves it anywhere.

Reported per mode: TTFT p50/p99 of first turns (computed from scratch) and of returning
turns, returning-turn TTFT p50 relative to tiers-off, and throughput (requests/s and
prompt tokens/s over the whole run), with the tier's counters. Every mode runs in each of
`--rounds` rounds, in alternating order (a drifting machine load hits every mode alike);
ratios are taken within a round, and the table gives each mode's median over the rounds.

    python benchmarks/kv_offload.py [--sessions 22] [--turns 4] [--prefix-tokens 3000]

`--shape large` runs the larger random Qwen3 of engine_vs_vllm.py (4 layers, hidden 512)
instead of the tiny one (2 layers, hidden 64): a tier trades a read of KV bytes for a
recompute's FLOPs, so the script prints the model's FLOPs per KV byte (the tiny model's is
far below a real model's, which makes a tier look worse than it would be).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from common import print_table, write_json

from pdpool.up.topology import SIDE_BY_SIDE, Topology, TopologySpec, ensure_tiny_model

SHAPES = ("tiny", "large")  # tiny: `pdpool up`'s default model; large: engine_vs_vllm's


def model_for_shape(shape: str) -> str:
    if shape == "large":
        from engine_vs_vllm import model_for  # the same cached checkpoint, made once

        return model_for("large")
    return ensure_tiny_model("qwen3")


def flops_per_kv_byte(config: dict, tokens: int, kv_bytes_per_value: int) -> dict[str, float]:
    """What recomputing a prefix of `tokens` costs per byte of KV a tier would read instead,
    for a dense decoder (HF config fields). `weights`: the projections and MLP of every layer
    (2 FLOPs per weight and token; the vocabulary head runs for the last token only);
    `with_attention`: plus QK^T and PV over the causal context (mean (tokens + 1) / 2)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter
    weights = 2 * layers * per_layer
    attention = 4 * layers * heads * head_dim * (tokens + 1) / 2
    kv_bytes = 2 * layers * kv_heads * head_dim * kv_bytes_per_value
    return {
        "kv_bytes_per_token": kv_bytes,
        "weights": weights / kv_bytes,
        "with_attention": (weights + attention) / kv_bytes,
    }


MODES = {"off": None, "native": "native", "disk": "disk", "shared": "shared"}


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            key = m.group(1) + (m.group(2) or "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def offload_stat(metrics: list[dict[str, float]], stat: str) -> float:
    return sum(
        v
        for m in metrics
        for k, v in m.items()
        if k.startswith("pdpool_kv_offload{") and f'stat="{stat}"' in k
    )


def by_source(metrics: list[dict[str, float]], source: str) -> float:
    key = "pdpool_prompt_tokens_by_source_total{"
    return sum(
        v for m in metrics for k, v in m.items() if k.startswith(key) and f'source="{source}"' in k
    )


# The engines' own split of a request's TTFT (vLLM's phase histograms, and the wait for KV
# to arrive that pdpool adds), summed over engines: mean milliseconds per request.
PHASES = {
    "engine_ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "kv_wait": "pdpool_kv_load_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}


def phase_ms(before: list[dict[str, float]], after: list[dict[str, float]], name: str) -> float:
    """Mean of a histogram between two scrapes, in ms (nan when nothing was observed)."""

    def total(ms: list[dict[str, float]], suffix: str) -> float:
        return sum(v for m in ms for k, v in m.items() if k.split("{")[0] == name + suffix)

    n = total(after, "_count") - total(before, "_count")
    return 1000 * (total(after, "_sum") - total(before, "_sum")) / n if n else float("nan")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)] if values else float("nan")


async def one_turn(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int):
    """(TTFT seconds, the generated token ids) of one streamed completion."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    started, first, ids = time.perf_counter(), None, []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                got = chunk["choices"][0].get("token_ids") or []
                if got and first is None:
                    first = time.perf_counter()
                ids += got
    return (first or time.perf_counter()) - started, ids


def run_mode(name: str, args, model_dir: str, log_dir: Path) -> dict:
    tier = MODES[name]
    spec = TopologySpec(
        model=model_dir,
        prefill=0,
        decode=args.engines,
        mode="aggregated",
        device="cpu",
        log_dir=str(log_dir),
        engine_args=[
            "--num-kv-blocks",
            str(args.kv_blocks),
            "--max-model-len",
            str(args.kv_blocks * 16),
        ],
        kv_offload=tier,
        kv_offload_size_gib=args.tier_gib,
        **SIDE_BY_SIDE,
    )
    rng = random.Random(args.seed)
    prefixes = [
        [rng.randrange(3, 500) for _ in range(args.prefix_tokens)] for _ in range(args.sessions)
    ]
    histories = [list(p) for p in prefixes]
    first_ttft: list[float] = []
    return_ttft: list[float] = []
    outputs: dict[tuple[int, int], list[int]] = {}
    prompt_tokens = 0
    phase_walls: list[float] = []
    first_done: list[dict[str, float]] = []
    with Topology(spec) as topo:
        engines = [c.url for c in topo.by_role("decode")]
        model = httpx.get(topo.gateway.url + "/v1/models").json()["data"][0]["id"]

        async def workload() -> None:
            nonlocal prompt_tokens
            sem = asyncio.Semaphore(args.concurrency)
            async with httpx.AsyncClient(base_url=topo.gateway.url, timeout=900) as client:

                async def turn(s: int, t: int) -> None:
                    nonlocal prompt_tokens
                    async with sem:
                        question = [rng.randrange(3, 500) for _ in range(args.question_tokens)]
                        prompt = histories[s] + question
                        ttft, ids = await one_turn(client, model, prompt, args.max_tokens)
                        histories[s] = prompt + ids
                        outputs[(s, t)] = ids
                        prompt_tokens += len(prompt)
                        (first_ttft if t == 0 else return_ttft).append(ttft)

                for t in range(args.turns):  # every session's turn t, then turn t+1
                    phase = time.perf_counter()
                    await asyncio.gather(*(turn(s, t) for s in range(args.sessions)))
                    phase_walls.append(time.perf_counter() - phase)
                    if t == 0:  # nothing in flight: where the returning turns start
                        first_done.extend(scrape(u) for u in engines)

        before = [scrape(u) for u in engines]
        started = time.perf_counter()
        asyncio.run(workload())
        wall = time.perf_counter() - started
        after = [scrape(u) for u in engines]
    requests = args.sessions * args.turns
    row = {
        "mode": name,
        "first_p50_s": pct(first_ttft, 0.5),
        "first_p99_s": pct(first_ttft, 0.99),
        "return_p50_s": pct(return_ttft, 0.5),
        "return_p99_s": pct(return_ttft, 0.99),
        "req_per_s": requests / wall,
        "prompt_tok_per_s": prompt_tokens / wall,
        "wall_s": wall,
        # The returning turns alone (every turn after the first): what a tier changes.
        "return_req_per_s": args.sessions * (args.turns - 1) / sum(phase_walls[1:]),
        "computed_prompt_tok": by_source(after, "computed") - by_source(before, "computed"),
        "tier_hit_tokens": offload_stat(after, "hit_tokens") - offload_stat(before, "hit_tokens"),
        "tier_loaded_tokens": offload_stat(after, "loaded_tokens")
        - offload_stat(before, "loaded_tokens"),
        "tier_rejected": offload_stat(after, "records_rejected"),
        # Reads started at a request's arrival, and those done by its admission (no wait).
        "tier_staged": offload_stat(after, "staged_reads") - offload_stat(before, "staged_reads"),
        "tier_staged_ready": offload_stat(after, "staged_ready")
        - offload_stat(before, "staged_ready"),
        "tier_mb": offload_stat(after, "bytes_used") / 1e6,
    }
    # Returning turns only (from the end of the first turns): the engines' TTFT split;
    # the rest of the client's TTFT is HTTP, the gateway and streaming.
    for label, metric in PHASES.items():
        row[f"ret_{label}_ms"] = phase_ms(first_done, after, metric)
    load_s = offload_stat(after, "load_seconds")
    loads = offload_stat(after, "loads_ok") + offload_stat(after, "loads_failed")
    row["tier_load_ms_avg"] = 1000 * load_s / loads if loads else 0.0
    shutil.rmtree(log_dir / "kv-offload", ignore_errors=True)
    return {"row": row, "outputs": {f"{s}/{t}": v for (s, t), v in outputs.items()}}


def _median_row(name: str, rows: list[dict]) -> dict:
    """A mode's median over the rounds, field by field."""
    out: dict = {"mode": name, "rounds": len(rows)}
    for field, value in rows[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and field != "round":
            out[field] = statistics.median(r[field] for r in rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The defaults make the working set 11x the pools (the issue asks for at least 10x).
    ap.add_argument("--sessions", type=int, default=22)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=3000)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--engines", type=int, default=2, help="decode engines behind the gateway")
    ap.add_argument("--kv-blocks", type=int, default=200, help="KV pool per engine, in blocks")
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    ap.add_argument("--tier-gib", type=float, default=2.0)
    ap.add_argument("--modes", default="off,disk,shared")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every mode, alternating")
    ap.add_argument("--shape", choices=SHAPES, default="tiny", help="random Qwen3 to run")
    ap.add_argument("--model", help="checkpoint (default: the random Qwen3 of --shape)")
    args = ap.parse_args()
    model_dir = args.model or model_for_shape(args.shape)
    try:
        with open(Path(model_dir) / "config.json") as fh:
            config = json.load(fh)
    except (OSError, ValueError) as e:
        ap.error(f"--model {model_dir}: no readable config.json ({e})")
    # The engine keeps KV in the checkpoint's dtype (these random ones: float32).
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    width = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)
    try:
        ratio: dict[str, float] = flops_per_kv_byte(config, args.prefix_tokens, width)
        print(
            f"model {model_dir}: {ratio['kv_bytes_per_token']:.0f} KV bytes per token; "
            f"recomputing {args.prefix_tokens} tokens costs {ratio['weights']:.0f} FLOPs per "
            f"KV byte in the weights, {ratio['with_attention']:.0f} with attention"
        )
    except (KeyError, TypeError, ZeroDivisionError) as e:  # not a dense decoder's config
        ratio = {}
        print(f"model {model_dir}: FLOPs per KV byte unknown (config lacks {e})")
    pool_tokens = args.engines * args.kv_blocks * 16
    working_set = args.sessions * (
        args.prefix_tokens + args.turns * (args.question_tokens + args.max_tokens)
    )
    load = os.getloadavg()
    print(
        f"working set {working_set} tokens = {working_set / pool_tokens:.1f}x the pools "
        f"({args.engines} engines x {args.kv_blocks} blocks x 16); load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    names = args.modes.split(",")
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory(prefix="kv-offload-bench-") as tmp:
        for r in range(args.rounds):
            results: dict[str, dict] = {}
            for name in names if r % 2 == 0 else names[::-1]:
                results[name] = run_mode(name, args, model_dir, Path(tmp) / f"{name}-{r}")
                results[name]["row"]["round"] = r
                print(f"  round {r} {name}: {results[name]['row']}", flush=True)
            base = results.get("off")
            for res in results.values():
                row = res["row"]
                if base is not None:
                    off = base["row"]
                    row["return_p50_vs_off"] = row["return_p50_s"] / off["return_p50_s"]
                    row["throughput_vs_off"] = row["req_per_s"] / off["req_per_s"]
                    row["return_throughput_vs_off"] = (
                        row["return_req_per_s"] / off["return_req_per_s"]
                    )
                    row["tokens_equal_to_off"] = res["outputs"] == base["outputs"]
            rounds.append(results)
    rows = [_median_row(name, [rr[name]["row"] for rr in rounds]) for name in names]
    equal = {
        name: all(rr[name]["row"].get("tokens_equal_to_off", True) for rr in rounds)
        for name in names
    }
    load_end = os.getloadavg()
    print_table(rows, "KV offload tiers: multi-turn sessions through pdpool up")
    print(f"greedy tokens equal to tiers-off: {equal}")
    print(f"load average at the end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")
    path = write_json(
        "kv_offload" if args.shape == "tiny" or args.model else f"kv_offload_{args.shape}",
        {
            "args": vars(args),
            "model_config": config,
            "flops_per_kv_byte": ratio,
            "working_set_tokens": working_set,
            "pool_tokens": pool_tokens,
            "load_average_start": load,
            "load_average_end": load_end,
            "rows": rows,
            "rounds": [[rr[name]["row"] for name in names] for rr in rounds],
            "tokens_equal_to_off": equal,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
