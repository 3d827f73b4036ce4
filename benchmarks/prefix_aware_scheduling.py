"""Prefix-cache-aware admission on vs off (the seed's comparison), same KV cache size.

A prefill-heavy workload where ~70% of every prompt is one of a few shared prefixes.
Reports throughput, KV blocks used/total per step (peak and mean utilization) and
preemptions for each mode.

    python benchmarks/prefix_aware_scheduling.py [--requests 96] [--blocks 160]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_json


def workload(n: int, prompt_len: int, shared_frac: float, groups: int, seed: int = 0):
    rng = random.Random(seed)
    shared_len = int(prompt_len * shared_frac)
    prefixes = [[rng.randrange(3, 500) for _ in range(shared_len)] for _ in range(groups)]
    return [
        rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(prompt_len - shared_len)]
        for _ in range(n)
    ]


def run(model_dir: Path, prompts, aware: bool, blocks: int, budget: int, max_tokens: int):
    from pdpool.engine.config import EngineConfig
    from pdpool.engine.engine_core import LLMEngine
    from pdpool.engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device="cpu",
            num_kv_blocks=blocks,
            max_num_batched_tokens=budget,
            max_num_seqs=64,
            prefix_aware_admission=aware,
        )
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate([[5] * 300, [6] * 40], params)  # warm-up, then drop its cache
    engine.kv.pool.reset_prefix_cache()
    engine.stats["computed_tokens"] = engine.stats["steps"] = 0
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    usage, out_tokens = [], 0
    t = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        out_tokens += sum(len(o.new_token_ids) for o in outs)
        usage.append(engine.kv.pool.num_used_blocks / blocks)
    elapsed = time.perf_counter() - t
    return {
        "prefix_aware": aware,
        "seconds": elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "output_tok_per_s": out_tokens / elapsed,
        "steps": engine.stats["steps"],
        "kv_util_peak": max(usage),
        "kv_util_mean": sum(usage) / len(usage),
        "preemptions": engine.scheduler.num_preemptions,
        "computed_tokens": engine.stats["computed_tokens"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--shared", type=float, default=0.7)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=160)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=2, help="layers of the generated model")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size of the generated model")
    args = ap.parse_args()
    model_dir = args.model
    if model_dir is None:
        from pdpool.engine.tiny_model import TinyModelSpec, write_tiny_model

        model_dir = write_tiny_model(
            Path(tempfile.mkdtemp()) / "tiny",
            TinyModelSpec(
                num_layers=args.layers,
                hidden_size=args.hidden,
                intermediate_size=3 * args.hidden,
                num_heads=max(4, args.hidden // 32),
                num_kv_heads=max(2, args.hidden // 64),
                head_dim=max(16, min(32, args.hidden // 8)),
            ),
        )
    prompts = workload(args.requests, args.prompt_len, args.shared, args.groups)
    # Alternate the modes and keep each one's best run: this machine's load varies.
    best: dict[bool, dict] = {}
    for _ in range(args.repeats):
        for aware in (False, True):
            r = run(model_dir, prompts, aware, args.blocks, args.budget, args.max_tokens)
            if aware not in best or r["seconds"] < best[aware]["seconds"]:
                best[aware] = r
    rows = [best[False], best[True]]
    print_table(
        rows,
        f"{args.requests} requests of {args.prompt_len} tokens, "
        f"{args.shared:.0%} shared ({args.groups} prefixes), "
        f"{args.blocks} KV blocks, budget {args.budget}",
    )
    gain = rows[1]["requests_per_s"] / rows[0]["requests_per_s"] - 1
    print(
        f"\nthroughput gain with awareness: {gain:+.1%} (seed: +20-30%); "
        f"mean KV utilization {rows[0]['kv_util_mean']:.0%} -> {rows[1]['kv_util_mean']:.0%}"
    )
    write_json(
        "prefix_aware_scheduling",
        {"args": vars(args) | {"model": str(model_dir)}, "rows": rows, "throughput_gain": gain},
    )


if __name__ == "__main__":
    main()
