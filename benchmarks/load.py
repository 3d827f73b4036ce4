"""Load and chaos: what production sends, against `pdpool serve` (one engine, default flags:
its engine core in a process of its own) and `pdpool up --prefill 1 --decode 2` (through the
gateway URL it serves).

The mix (devtools/load_mix.py): bursts of concurrent requests, prompts from 16 tokens up to
max_model_len (some exactly at it, less max_tokens), streamed and not, chats and
completions, n>1 with logprobs, clients that leave mid-stream, multi-turn conversations
sharing prefixes, bodies near the size limit and over it (413), over-long prompts (400), one
~10 MB prompt (400 or 413).

Per target, two phases:
  load   --requests requests in bursts of --burst;
  chaos  (--chaos) bursts keep coming while faults are injected one after another, each once
         the target is whole again, and timed until the victim serves 200 again:
         serve: its engine core SIGKILLed (nothing restarts the server by hand);
         up:    decode-0's engine core, prefill-0's engine core, decode-1's engine server
                and sidecar-0 SIGKILLed (`pdpool up` restarts the processes).
Reported: requests by class (2xx, 400, 413, 429, 5xx, transport errors, streams ended by an
error event, streams cut without one, clients that left), TTFT and ITL p50/p99 of the
streams, output tok/s, recovery times, KV blocks in use after the run vs idle (/metrics:
pdpool_kv_blocks_used, vllm:kv_cache_usage_perc), RSS of every server and engine core before
and after, and every problem the tests would fail on.

    python benchmarks/load.py --quick                  # about 3 minutes on 2 cores
    python benchmarks/load.py --target serve --burst 256 --requests 1024 --no-chaos
    python benchmarks/load.py --target up --chaos-rounds 8 --requests 64   # 32 kills
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import print_table, write_json

from devtools.load_mix import (
    HealthWatch,
    MixSpec,
    Outcome,
    build_units,
    by_kind,
    health_problems,
    kv_blocks,
    load_during,
    memory_problems,
    outcome_problems,
    run_units,
    summarize,
)
from devtools.load_targets import (
    ServeTarget,
    UpTarget,
    blocks_in_use,
    inject_faults,
    leaked_blocks,
    max_model_len,
    memory,
    outages,
    served_model,
    server_errors,
)
from pdpool.up.topology import ensure_tiny_model

FAULTS = {
    "serve": (("engine-0", "engine-core"),),
    "up": (
        ("decode-0", "engine-core"),
        ("prefill-0", "engine-core"),
        ("decode-1", "engine-server"),
        ("sidecar-0", "sidecar"),
    ),
}
MEMORY_GROWTH_LIMIT = 768 << 20
QUICK = {"burst": 32, "requests": 64, "chaos_burst": 16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", choices=("serve", "up", "both"), default="both")
    p.add_argument("--burst", type=int, default=128, help="requests sent at once (64-256)")
    p.add_argument("--requests", type=int, default=512, help="requests of the load phase")
    p.add_argument("--chaos-burst", type=int, default=64, help="burst size under chaos")
    p.add_argument("--chaos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--chaos-rounds",
        type=int,
        default=1,
        help="the target's faults this many times over (a race at a kill shows in a few dozen)",
    )
    p.add_argument("--quick", action="store_true", help="a small scale: " + str(QUICK))
    p.add_argument("--model", help="checkpoint folder (default: the tiny Qwen3)")
    p.add_argument("--recovery-timeout", type=float, default=90.0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", help="where the servers log (default: a temp dir)")
    p.add_argument("--name", default="load", help="results file name")
    args = p.parse_args()
    if args.chaos_rounds < 1:
        p.error("--chaos-rounds must be at least 1")
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def start(kind: str, model: str, log_dir: Path):
    if kind == "serve":
        return ServeTarget(model, log_dir).start(timeout_s=300)
    return UpTarget(log_dir, prefill=1, decode=2, model=model).start(timeout_s=600)


def spec_for(target, model: str, seed: int) -> MixSpec:
    engine = target.engines()[0].url
    return MixSpec(model, served_model(engine), max_model_len(engine), seed=seed)


def load_phase(target, spec: MixSpec, args) -> tuple[list[Outcome], float]:
    units = build_units(spec, args.requests)
    t0 = time.monotonic()
    outcomes = asyncio.run(run_units(target.url, units, spec, args.burst, args.timeout))
    return outcomes, time.monotonic() - t0


def chaos_phase(target, spec: MixSpec, args) -> tuple[list[Outcome], list, float]:
    async def faults() -> list:
        return await asyncio.to_thread(
            inject_faults,
            target,
            FAULTS[target.name] * args.chaos_rounds,
            spec.model,
            args.recovery_timeout,
        )

    t0 = time.monotonic()
    outcomes, kills = asyncio.run(
        load_during(target.url, spec, args.chaos_burst, faults, args.seed + 1000, args.timeout)
    )
    return outcomes, kills, time.monotonic() - t0


def mib(value) -> object:
    return "-" if value is None else round(value / (1 << 20))


def run_target(kind: str, model: str, args, log_dir: Path) -> dict:
    target = start(kind, model, log_dir / kind)
    try:
        spec = spec_for(target, model, args.seed)
        idle, rss_before = blocks_in_use(target), memory(target)
        with HealthWatch(target.url) as watch:
            load, load_s = load_phase(target, spec, args)
            chaos, kills, chaos_s = chaos_phase(target, spec, args) if args.chaos else ([], [], 0)
        windows = outages(kills, no_path=target.alone())
        leaks = leaked_blocks(target, idle, 30.0)
        after_blocks = blocks_in_use(target)
        usage = {n.name: kv_blocks(n.url)["usage_perc"] for n in target.engines()}
        rss_after = memory(target)
        problems = outcome_problems(load + chaos, windows) + health_problems(watch, windows)
        problems += leaks
        problems += memory_problems(rss_before, rss_after, MEMORY_GROWTH_LIMIT)
        problems += [f"{k.node} did not serve again" for k in kills if k.recovered_s is None]
        errors = server_errors(sorted((log_dir / kind).rglob("*.log")))
        if errors:  # an exception that reached a server is a problem even when retried
            problems.append("the servers logged failures:\n" + errors)
        return {
            "target": kind,
            "url": target.url,
            "phases": {
                "load": summarize(load, load_s),
                **({"chaos": summarize(chaos, chaos_s)} if args.chaos else {}),
            },
            "kinds": by_kind(load + chaos),
            "faults": [k.row() for k in kills],
            "health": {
                "polls": len(watch.samples),
                "late": len(watch.late()),
                "not_200": len(watch.not_ok()),
                "worst_s": watch.worst_latency(),
            },
            "kv_blocks": {"idle": idle, "after": after_blocks, "usage_after": usage},
            "rss_mib": {
                name: {"before": mib(rss_before[name]), "after": mib(rss_after.get(name))}
                for name in rss_before
            },
            "problems": problems,
        }
    finally:
        target.stop()


def report(result: dict) -> None:
    kind = result["target"]
    rows = [{"phase": phase, **summary} for phase, summary in result["phases"].items()]
    print_table(rows, f"{kind}: requests by class, latencies, throughput")
    print_table(result["kinds"], f"{kind}: by request kind")
    print_table(result["faults"], f"{kind}: faults and recovery")
    print_table([result["health"]], f"{kind}: /health (1 s budget)")
    blocks = result["kv_blocks"]
    print_table(
        [
            {"engine": e, "idle": blocks["idle"][e], "after": v, "usage": blocks["usage_after"][e]}
            for e, v in blocks["after"].items()
        ],
        f"{kind}: KV blocks in use",
    )
    print_table([{"process": p, **v} for p, v in result["rss_mib"].items()], f"{kind}: RSS (MiB)")
    print(f"\n{kind}: problems:" if result["problems"] else f"\n{kind}: no problems")
    for problem in result["problems"]:
        print("  - " + problem.replace("\n", "\n    "))


def main() -> int:
    args = parse_args()
    model = args.model or ensure_tiny_model("qwen3")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdpool-load-"))
    kinds = ("serve", "up") if args.target == "both" else (args.target,)
    results = []
    for kind in kinds:
        result = run_target(kind, model, args, log_dir)
        report(result)
        results.append(result)
    scale = {
        k: getattr(args, k)
        for k in ("burst", "requests", "chaos_burst", "chaos", "chaos_rounds", "quick")
    }
    write_json(args.name, {"model": model, "scale": scale, "logs": str(log_dir), "runs": results})
    return 1 if any(r["problems"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
