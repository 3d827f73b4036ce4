"""Adapter-aware routing vs adapter-blind routing: 4 engines with --max-loras 2 serving 8
adapters, a skewed adapter mix (adapter i drawn with weight 1/(i+1)), streamed through the
gateway. Three strategies, in alternating rounds on one set of processes:

  round-robin  the client sends to the 4 sidecars in turn (no gateway)
  gateway      our gateway with --no-lora-affinity (prefix affinity and load only)
  lora         our gateway with LoRA residency routing (the default)

Per strategy: adapter slot loads on the engines (pdpool_lora_slot_loads_total: an adapter
copied into one of an engine's --max-loras slots; vLLM counts none), TTFT p50/p99 and output
throughput. "Loads avoided" = round-robin's slot loads minus lora's, over the same requests.

    python benchmarks/lora_routing.py [--requests 48] [--rounds 3] [--concurrency 8]
                                      [--prompt-len 64] [--max-tokens 16] [--hidden 256]

Prints a table and writes benchmarks/results/lora_routing.json (with the load average).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from common import print_table, write_json
from http_load import percentile, run_requests
from lora import NUM_ADAPTERS, make_model_and_adapters

ENGINES, MAX_LORAS = 4, 2
STRATEGIES = ("round-robin", "gateway", "lora")


def slot_loads(urls: list[str]) -> float:
    total = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("pdpool_lora_slot_loads_total"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def workload(args, rng: random.Random) -> list[dict]:
    weights = [1 / (i + 1) for i in range(NUM_ADAPTERS)]
    names = rng.choices([f"a{i}" for i in range(NUM_ADAPTERS)], weights, k=args.requests)
    return [
        {
            "model": name,
            "prompt": [rng.randrange(3, 500) for _ in range(args.prompt_len)],
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        for name in names
    ]


def start(model: Path, adapters: list[Path], rank: int, log_dir: Path):
    from pdpool.command_lines import gateway_argv
    from pdpool.ports import free_port
    from pdpool.up.topology import SIDE_BY_SIDE, Child, Topology, TopologySpec

    lora = ["--enable-lora", f"--max-loras={MAX_LORAS}", f"--max-lora-rank={rank}"]
    lora += [f"--max-cpu-loras={NUM_ADAPTERS}"]
    lora += [f"--lora-modules=a{i}={d}" for i, d in enumerate(adapters)]
    spec = TopologySpec(
        model=str(model),
        prefill=0,
        decode=ENGINES,
        mode="aggregated",
        log_dir=str(log_dir),
        engine_args=["--num-kv-blocks=512", "--cpu-threads=1", *lora],
        **SIDE_BY_SIDE,
    )
    topo = Topology(spec)
    # a second gateway over the same sidecars, adapter-blind
    launch = topo.router_launch
    port = free_port()
    blind = replace(
        launch, serving=replace(launch.serving, port=port), extra_args=("--no-lora-affinity",)
    )
    topo.children.append(
        Child("gateway", 1, port, gateway_argv(blind), str(log_dir / "gateway-1.log"))
    )
    topo.start(timeout_s=600)
    return topo


def run_strategy(topo, name: str, bodies: list[dict], concurrency: int) -> dict:
    engines = [c.url for c in topo.by_role("decode")]
    sidecars = [c.url for c in topo.by_role("sidecar")]
    gateways = topo.by_role("gateway")
    loads0 = slot_loads(engines)
    if name == "round-robin":
        # each sidecar gets every 4th request, all of them at once (the same concurrency)
        from concurrent.futures import ThreadPoolExecutor

        share = max(concurrency // len(sidecars), 1)
        with ThreadPoolExecutor(len(sidecars)) as pool:
            parts = list(
                pool.map(
                    lambda i: run_requests(
                        sidecars[i], bodies[i :: len(sidecars)], share, stream=True
                    ),
                    range(len(sidecars)),
                )
            )
        results = [r for got, _ in parts for r in got]
        wall = max(w for _, w in parts)
    else:
        url = (gateways[0] if name == "lora" else gateways[1]).url
        results, wall = run_requests(url, bodies, concurrency, stream=True)
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    return {
        "slot_loads": slot_loads(engines) - loads0,
        "ttft_p50_ms": 1000 * percentile(ttfts, 0.5),
        "ttft_p99_ms": 1000 * percentile(ttfts, 0.99),
        "tok_s": sum(r.completion_tokens for r in results) / wall,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rank", type=int, default=8)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    runs: dict[str, list[dict]] = {s: [] for s in STRATEGIES}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model, adapters = make_model_and_adapters(Path(tmp), args.hidden, args.rank)
        topo = start(model, adapters, args.rank, Path(tmp))
        try:
            warm = workload(argparse.Namespace(**{**vars(args), "requests": 16}), rng)
            run_requests(topo.by_role("gateway")[0].url, warm, args.concurrency)
            for r in range(args.rounds):
                bodies = workload(args, rng)  # the same requests for every strategy
                for name in STRATEGIES[r % 3 :] + STRATEGIES[: r % 3]:  # each goes first once
                    runs[name].append(run_strategy(topo, name, bodies, args.concurrency))
        finally:
            topo.stop()
    load = os.getloadavg()
    rows = []
    for name in STRATEGIES:
        r = runs[name]
        rows.append(
            {
                "strategy": name,
                "slot_loads": sum(x["slot_loads"] for x in r),
                "ttft_p50_ms": statistics.median(x["ttft_p50_ms"] for x in r),
                "ttft_p99_ms": statistics.median(x["ttft_p99_ms"] for x in r),
                "tok_s": statistics.median(x["tok_s"] for x in r),
            }
        )
    by = {row["strategy"]: row for row in rows}
    avoided = by["round-robin"]["slot_loads"] - by["lora"]["slot_loads"]
    print_table(
        rows,
        f"{ENGINES} engines x --max-loras {MAX_LORAS}, {NUM_ADAPTERS} adapters (weights 1/(i+1)), "
        f"{args.requests} requests x {args.prompt_len}+{args.max_tokens} tokens per round, "
        f"{args.concurrency} concurrent, {args.rounds} alternating rounds "
        "(slot loads summed, TTFT and tok/s medians of the rounds)",
    )
    print(
        f"adapter slot loads avoided vs round-robin: {avoided:.0f} of "
        f"{by['round-robin']['slot_loads']:.0f}; vs the adapter-blind gateway: "
        f"{by['gateway']['slot_loads'] - by['lora']['slot_loads']:.0f}; "
        f"load average before {load_before}, after {load}"
    )
    write_json(
        "lora_routing",
        {
            "args": vars(args),
            "runs": runs,
            "rows": rows,
            "loads_avoided_vs_round_robin": avoided,
            "loads_avoided_vs_gateway": by["gateway"]["slot_loads"] - by["lora"]["slot_loads"],
            "loadavg_before": load_before,
            "loadavg": load,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
