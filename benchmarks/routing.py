"""Routing strategies on a multi-turn shared-prefix workload through
`pdpool up --prefill 1 --decode 4`, and the KV index's own cost.

    python benchmarks/routing.py [--model DIR] [--only precise/aggregated,...] [--skip-e2e]

Workload (defaults): 8 system prompts of 1024 tokens, 6 users on each (48 conversations),
3 turns each: turn t's prompt is turn t-1's prompt + its answer (16 tokens, read back as
token ids) + 64 new user tokens, so a conversation shares its system prompt with 5 others
and its own history with its earlier turns. 8 users talk at a time (8 requests in flight),
each turn after turn; when one's conversation ends the next user (shuffled order) arrives:
144 requests, most of them later turns and repeat users (the steady state), 8 of them cold
system prompts.

KV budget: 256 blocks (4096 tokens) per decode engine. The working set (every system
prompt + the histories of the 8 conversations under way, printed) is 632 blocks: the
pool's 1024 blocks hold it once, one engine holds 40% of it. Round-robin makes every engine
see every system prompt and evict; a router that keeps each prefix on few engines fits.

Model (default): a Qwen3 of 4 layers, hidden 512, 8 heads of 64, vocab 512 (random
weights, made once with `pdpool tiny-model`, about 10M parameters). On this 2-core CPU a
1088-token prefill of it takes about 140 ms on an idle engine (more when four share the
cores), so what a cache hit saves is the bulk of a turn's time, as with real models on GPUs;
the tiny test model takes 18 ms, about what the HTTP hops of five processes on two cores
cost, and would measure the gateway instead of the routing.

The old single-turn workload stays one flag set away:
    --prefix-tokens 256 --user-tokens 32 --turns 1 --max-tokens 8 --concurrency 4
    --kv-blocks 512 --model <tiny qwen3 folder>

precise-envoy: the same precise routing behind real Envoy (`pdpool up --gateway envoy`:
Envoy's ext_proc asks `pdpool epp`, the Gateway API Inference Extension endpoint picker, over
the same routing core; scripts/envoy/install.sh installs Envoy), with the picker's own time
per request (epp_ms_p50/p99).

Strategies: round-robin (the client sends to the sidecars in turn), hash affinity (the
gateway as before), precise (the gateway with --kv-events: cost = uncached tokens + pending
prefill tokens + load, sidecar/routing/kv_cost.py), all with aggregated sidecars; then precise
again with decode-first sidecars, to count the decode-first round trips the up-front P/D
decision saves (requests the gateway sent straight to P/D, which the engine would have
rejected after a round trip) and its mispredictions.

Reported: prefix hit rate on the decode engines (vllm:prefix_cache_hits / queries, this
run's delta) and as a fraction of the oracle's: one ideal cache that never evicts and sees
the prompts in the order they were sent, where a request's leading full blocks that any
earlier prompt computed all hit (`oracle_hit_rate`; it ignores that a block computed by a
request still in flight is not yet reusable, so it is an upper bound). Then TTFT p50/p99
(streamed: the first chunk with a token), output tokens/s over the run's wall time,
preemptions. Then the index alone: memory per million blocks and events/s. Prints a table
and writes benchmarks/results/<--out>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
import tracemalloc
from dataclasses import dataclass

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import print_table, write_json
from pdpool.block_hash import chain_hashes
from pdpool.kv_events import BlockStored, KVEventBatch
from pdpool.sidecar.kv.index import KVIndex
from pdpool.up.topology import SIDE_BY_SIDE, Topology, TopologySpec, ensure_tiny_model

# The default model's shape (see the module doc): `pdpool tiny-model` arguments.
MODEL_SHAPE = [
    "--layers", "4", "--hidden-size", "512", "--intermediate-size", "1024",
    "--heads", "8", "--kv-heads", "4", "--head-dim", "64", "--vocab-size", "512",
]  # fmt: skip


def routing_model() -> str:
    """The default model's folder, made once under ~/.cache/pdpool."""
    out = os.path.join(os.path.expanduser("~"), ".cache", "pdpool", "routing-qwen3-h512-l4")
    return ensure_tiny_model("qwen3", out, MODEL_SHAPE)


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


@dataclass
class User:
    """One conversation: its system prompt and the new message of each turn. Turn t's prompt
    is the previous turn's prompt + that turn's answer + message t, so later turns share the
    conversation's own history as well as the system prompt."""

    system_id: int
    system: list[int]
    messages: list[list[int]]


def workload(args) -> list[User]:
    """`prefixes` system prompts, `per_prefix` users on each, in a shuffled arrival order."""
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    systems = [tokens(args.prefix_tokens) for _ in range(args.prefixes)]
    users = [
        User(k, s, [tokens(args.user_tokens) for _ in range(args.turns)])
        for k, s in enumerate(systems)
        for _ in range(args.per_prefix)
    ]
    rng.shuffle(users)
    return users


def oracle_hit_rate(prompts: list[list[int]], block_size: int = 16) -> float:
    """The hit rate of one ideal cache that never evicts and sees requests in the order they
    were sent: a request's leading full blocks that any earlier prompt computed all hit (as the
    engine counts: at least one token is left to compute). No router can do better; with the
    pool's summed KV capacity above the working set (see `main`) one can come close."""
    seen: set[bytes] = set()
    hits = total = 0
    for ids in prompts:
        keys = chain_hashes(ids, block_size)
        limit = max(len(ids) - 1, 0) // block_size
        n = 0
        while n < min(len(keys), limit) and keys[n] in seen:
            n += 1
        hits += n * block_size
        total += len(ids)
        seen.update(keys)
    return hits / total if total else 0.0


@dataclass
class Drive:
    ttfts: list[float]
    trace: list[dict]  # per request: when it was sent, where it went, its TTFT
    tokens: int
    wall_s: float
    prompts: list[list[int]]  # in the order they were sent


async def drive(targets, model: str, users: list[User], args) -> Drive:
    """`concurrency` users talk at once, each turn after turn (one request in flight each);
    when a user's conversation ends the next one arrives. The answer's token ids come back
    in the stream (return_token_ids)."""
    ttfts: list[float] = []
    trace: list[dict] = []
    prompts: list[list[int]] = []
    tokens = 0
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as c:

        async def turn(target: str, prompt: list[int], user: int, system: int, n: int) -> list[int]:
            nonlocal tokens
            answer: list[int] = []
            prompts.append(prompt)
            t0 = time.perf_counter()
            first = None
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
            async with c.stream("POST", target + "/v1/completions", json=body) as r:
                r.raise_for_status()
                backend = r.headers.get("x-pdpool-backend", target)
                async for line in r.aiter_lines():
                    if not line.startswith("data:") or "[DONE]" in line:
                        continue
                    for choice in json.loads(line[5:]).get("choices", []):
                        new = choice.get("token_ids") or []
                        if new and first is None:
                            first = time.perf_counter()
                        answer += new
            ttfts.append((first or time.perf_counter()) - t0)
            trace.append(
                {
                    "sent_s": round(t0 - start, 3),
                    "user": user,
                    "system": system,
                    "turn": n,
                    "prompt_tokens": len(prompt),
                    "backend": backend,
                    "ttft_ms": round(1000 * ttfts[-1], 1),
                }
            )
            tokens += len(answer)
            return answer

        async def converse(i: int, user: User) -> None:
            async with sem:  # a user at a time per slot: each turn waits for its answer
                history = list(user.system)
                for t, message in enumerate(user.messages):
                    prompt = history + message
                    target = targets(i * len(user.messages) + t)
                    history = prompt + await turn(target, prompt, i, user.system_id, t)

        start = time.perf_counter()
        await asyncio.gather(*(converse(i, u) for i, u in enumerate(users)))
        return Drive(ttfts, trace, tokens, time.perf_counter() - start, prompts)


def run_strategy(
    name: str, args, model_dir: str, mode: str = "aggregated"
) -> tuple[dict, list[dict]]:
    spec = TopologySpec(
        model=model_dir,
        prefill=1,
        decode=args.decode,
        mode=mode,
        engine_args=["--num-kv-blocks", str(args.kv_blocks)],
        kv_events=name.startswith("precise"),
        kv_load_cost=args.load_cost,
        gateway="envoy" if name.endswith("envoy") else "ours",
        **SIDE_BY_SIDE,
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
        p0 = engine_sum(decodes, "vllm:num_preemptions_total")
        run = asyncio.run(drive(targets, model, workload(args), args))
        q = engine_sum(decodes, "vllm:prefix_cache_queries_total") - q0
        h = engine_sum(decodes, "vllm:prefix_cache_hits_total") - h0
        preempted = engine_sum(decodes, "vllm:num_preemptions_total") - p0
        hints = {
            o: engine_sum(sidecars, "pdpool_sidecar_kv_path_hints_total{" + o)
            for o in (
                'hint="pd",outcome="honoured"',
                'hint="decode",outcome="correct"',
                'hint="decode",outcome="mispredicted"',
            )
        }
        picker = epp_decision_ms(topo.router.url) if spec.gateway == "envoy" else {}
    finally:
        topo.stop()
    ttfts = sorted(run.ttfts)
    hit_rate = h / q if q else 0.0
    row = {
        "strategy": name,
        "mode": mode,
        "hit_rate": hit_rate,
        "of_oracle": hit_rate / oracle_hit_rate(run.prompts),
        "round_trips_saved": int(hints['hint="pd",outcome="honoured"']),
        "mispredicted": int(hints['hint="decode",outcome="mispredicted"']),
        "ttft_mean_ms": 1000 * statistics.fmean(ttfts),
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "tok_s": run.tokens / run.wall_s,
        "wall_s": run.wall_s,
        "preemptions": int(preempted),
        **picker,
    }
    return row, run.trace


def epp_decision_ms(url: str) -> dict:
    """The endpoint picker's own time per request (from the request's headers reaching it
    to its routed answer: reading the body, parsing, routing), p50/p99 interpolated in the
    buckets of its pdpool_epp_decision_seconds histogram."""
    buckets: list[tuple[float, float]] = []
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("pdpool_epp_decision_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
    total = buckets[-1][1] if buckets else 0.0

    def quantile(q: float) -> float:
        lower, below = 0.0, 0.0
        for le, count in buckets:
            if count >= q * total and le != float("inf"):
                share = (q * total - below) / (count - below) if count > below else 1.0
                return 1000 * (lower + share * (le - lower))
            lower, below = (le, count) if le != float("inf") else (lower, below)
        return 1000 * lower

    return {"epp_ms_p50": quantile(0.5), "epp_ms_p99": quantile(0.99)} if total else {}


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
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--prefixes", type=int, default=8, help="system prompts")
    ap.add_argument("--per-prefix", type=int, default=6, help="users on each system prompt")
    ap.add_argument("--prefix-tokens", type=int, default=1024, help="system prompt length")
    ap.add_argument("--turns", type=int, default=3, help="turns of each conversation")
    ap.add_argument("--user-tokens", type=int, default=64, help="new tokens a user sends a turn")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens of each answer")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=256, help="KV blocks of each engine")
    ap.add_argument("--model", help="model folder (default: routing_model())")
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
    ap.add_argument("--out", default="routing", help="results name: benchmarks/results/<out>.json")
    args = ap.parse_args()
    rows: list[dict] = []
    traces: dict[str, list[dict]] = {}
    # The working set against the KV capacity, in blocks: every system prompt, plus the
    # whole own history (every turn's message and answer) of the conversations in flight.
    own_history = args.turns * (args.user_tokens + args.max_tokens)
    working_set = (
        args.prefixes * args.prefix_tokens
        + min(args.concurrency, args.prefixes * args.per_prefix) * own_history
    ) // 16
    if not args.skip_e2e:
        model_dir = args.model or routing_model()
        for name, mode in (
            ("round-robin", "aggregated"),
            ("affinity", "aggregated"),
            ("precise", "aggregated"),
            ("precise-envoy", "aggregated"),
            ("precise", "decode-first"),
        ):
            if args.only and f"{name}/{mode}" not in args.only.split(","):
                continue
            r, traces[f"{name}/{mode}"] = run_strategy(name, args, model_dir, mode)
            rows.append(r)
            print(f"{name} ({mode}): {r}", flush=True)
        rr = next((r["ttft_p50_ms"] for r in rows if r["strategy"] == "round-robin"), None)
        for r in rows:
            r["ttft_p50_vs_rr"] = r["ttft_p50_ms"] / rr if rr else float("nan")
        print_table(
            rows,
            f"{args.decode} decode engines x {args.kv_blocks} KV blocks (working set "
            f"{working_set} blocks); {args.prefixes} system prompts x {args.prefix_tokens} "
            f"tokens, {args.per_prefix} users each, {args.turns} turns of "
            f"{args.user_tokens} + {args.max_tokens} answer tokens, concurrency "
            f"{args.concurrency}",
        )
    c = index_cost()
    print(
        f"index: {c['MiB_per_million_blocks']:.0f} MiB per million blocks, "
        f"{c['events_per_s']:.0f} events/s ({c['blocks_per_s']:.0f} blocks/s, "
        f"16 hashes per BlockStored)"
    )
    write_json(
        args.out,
        {
            "args": vars(args),
            "working_set_blocks": working_set,
            "strategies": rows,
            "index": c,
            "requests": traces,
        },
    )


if __name__ == "__main__":
    main()
