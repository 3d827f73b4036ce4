"""LoRA serving cost: 8 adapters mixed in every batch vs the base model alone, same
workload, same engine (in process, CPU), in alternating rounds so that the machine's load
hits both alike. Goal: mixed adapters >= 0.8x the base model's output throughput.

    python benchmarks/lora.py [--requests 64] [--prompt-len 128] [--max-tokens 32]
                              [--rounds 3] [--hidden 512] [--rank 8]

Prints a table and writes benchmarks/results/lora.json (with the load average).

    python benchmarks/lora.py --routing [lora_routing.py's flags]

runs the routing comparison instead (adapter-aware routing vs round-robin over 4 engines
with --max-loras 2: lora_routing.py).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from common import print_table, write_json

NUM_ADAPTERS = 8


def make_model_and_adapters(root: Path, hidden: int, rank: int):
    from devtools.lora_maker import make_adapter
    from pdpool.engine.tiny_model import TinyModelSpec, write_tiny_model

    model = root / "model"
    heads = max(hidden // 64, 2)
    spec = TinyModelSpec(
        arch="qwen3",
        num_layers=4,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_heads=heads,
        num_kv_heads=max(heads // 2, 1),
        head_dim=64,
    )
    write_tiny_model(model, spec)
    adapters = [make_adapter(model, root / f"a{i}", seed=i, rank=rank) for i in range(NUM_ADAPTERS)]
    return model, adapters


def build_engine(model: Path, rank: int):
    from pdpool.engine.config import EngineConfig
    from pdpool.engine.engine_core import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=str(model),
            device="cpu",
            num_kv_blocks=2048,
            max_num_seqs=64,
            enable_prefix_caching=False,
            enable_lora=True,
            cpu_threads=1,  # one thread: steadier on a shared machine, same for both modes
            max_loras=NUM_ADAPTERS,
            max_lora_rank=rank,
        )
    )


def run_round(engine, prompts, refs, max_tokens: int, tag: str) -> float:
    from pdpool.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params, lora=refs[i % len(refs)] if refs else None)
    tokens = 0
    t = time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - t)


def main() -> int:
    if "--routing" in sys.argv[1:]:
        import lora_routing

        return lora_routing.main([a for a in sys.argv[1:] if a != "--routing"])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--rank", type=int, default=8)
    args = ap.parse_args()

    from pdpool.engine.lora.adapter_dir import read_adapter
    from pdpool.engine.lora.registry import LoRARef

    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, 500) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model, adapter_dirs = make_model_and_adapters(Path(tmp), args.hidden, args.rank)
        refs = []
        for i, d in enumerate(adapter_dirs):
            files = read_adapter(str(d), args.rank)
            refs.append(LoRARef(f"a{i}", i + 1, files.path, files.digest))
        engine = build_engine(model, args.rank)
        try:
            run_round(engine, prompts[:8], refs, 4, "warm")  # loads every adapter once
            run_round(engine, prompts[:8], [], 4, "warm-base")
            rates: dict[str, list[float]] = {"base": [], "lora8": []}
            for r in range(args.rounds):  # alternating: base, mixed, base, mixed, ...
                rates["base"].append(run_round(engine, prompts, [], args.max_tokens, f"b{r}"))
                rates["lora8"].append(run_round(engine, prompts, refs, args.max_tokens, f"l{r}"))
        finally:
            engine.close()
    load = os.getloadavg()
    base, mixed = statistics.median(rates["base"]), statistics.median(rates["lora8"])
    # Each mixed round against the base round just before it: the load swings between
    # rounds on a shared machine, less within a pair.
    ratio = statistics.median(m / b for b, m in zip(rates["base"], rates["lora8"], strict=True))
    rows = [
        {"mode": "base model only", "out_tok_s": base, "ratio": 1.0},
        {"mode": f"{NUM_ADAPTERS} adapters mixed", "out_tok_s": mixed, "ratio": ratio},
    ]
    print_table(
        rows,
        f"LoRA: {args.requests} requests x {args.prompt_len}+{args.max_tokens} "
        f"tokens, hidden {args.hidden}, rank {args.rank} (median of {args.rounds} paired rounds)",
    )
    print(f"goal >= 0.8x: {'met' if ratio >= 0.8 else 'NOT met'}; load average {load}")
    write_json(
        "lora",
        {
            "args": vars(args),
            "rates": rates,
            "rows": rows,
            "ratio": ratio,
            "goal_met": ratio >= 0.8,
            "loadavg": load,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
