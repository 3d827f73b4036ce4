"""Where a long-prompt step's time goes, against the matmul limit of this CPU.

    python benchmarks/long_prompt_profile.py                 # the engine_vs_vllm `long` shape
    python benchmarks/long_prompt_profile.py --requests 8 --threads 2

Runs the engine in this process (no HTTP) on `engine_vs_vllm.py`'s long-prompt workload (the
large model, prompts of 1000-3000 random tokens, 32-64 greedy outputs, fresh prompts) with
the thread count `pdpool serve` gives prompt steps, and splits the steps' wall time into:
linear layers (oneDNN), attention, the K/V scatter, RMSNorm and rotary, the MLP activation,
residual adds, and the rest (scheduler, sampling, Python between ops). The C kernels are
invisible to torch's profiler, so their Python entry points are labelled with
`record_function`; linear and attention FLOPs are counted from the shapes of each call.

The matmul limit: the same oneDNN linear the engine uses, on this model's projection shapes
at 2048 rows, and a 2048^3 GEMM, with the same threads. `ideal` is the step's FLOPs at that
rate; the gap to it is printed per category. Results: benchmarks/results/long_prompt_profile.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.common import print_table, write_json
from benchmarks.engine_vs_vllm import WORKLOADS, model_for

# torch profiler op names per category (self time); the labelled C kernels by label
CATEGORIES = {
    "linear": ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm"),
    "attention": ("pdpool::attention",),
    "kv_write": ("pdpool::kv_write",),
    "norm_rope": ("pdpool::rms_norm", "pdpool::norm_rope"),
    "activation": ("aten::silu_", "aten::mul_"),
    "residual_add": ("aten::add",),
}


class Counted:
    """Wraps a function: labels it for the profiler and counts FLOPs from its arguments."""

    def __init__(self, owner, attr: str, label: str, flops=None):
        self.owner, self.attr, self.fn = owner, attr, getattr(owner, attr)
        self.label, self.flops_of, self.flops = label, flops, 0.0
        setattr(owner, attr, self)

    def __call__(self, *args, **kwargs):
        if self.flops_of is not None:
            self.flops += self.flops_of(*args, **kwargs)
        with record_function(self.label):
            return self.fn(*args, **kwargs)

    def restore(self) -> None:
        setattr(self.owner, self.attr, self.fn)


def attention_flops(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, *a, **kw):
    """QK^T and PV of causal attention: each new query at context c does 4 * c * D per head."""
    heads, dim = q.shape[1], q.shape[2]
    flops = 0.0
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, total in enumerate(lens):
        n = starts[b + 1] - starts[b]
        first = total - n + 1  # context of the first new query
        flops += 4.0 * heads * dim * (first + total) * n / 2
    return flops


def gemm_rate(m: int, k: int, n: int, threads: int, repeat: int = 20) -> float:
    """GFLOP/s of the engine's packed oneDNN linear at [m, k] x [k, n]."""
    from pdpool.engine.models.cpu_linear import PackedLinear, packing_works

    torch.set_num_threads(threads)
    linear = nn.Linear(k, n, bias=False)
    layer = PackedLinear(linear) if packing_works() else linear
    x = torch.randn(m, k)
    with torch.no_grad():
        for _ in range(3):
            layer(x)
        t0 = time.perf_counter()
        for _ in range(repeat):
            layer(x)
        wall = (time.perf_counter() - t0) / repeat
    return 2.0 * m * k * n / wall / 1e9


def matmul_limit(config: dict, threads: int) -> dict:
    h, i = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"q/o": (h, q), "k/v": (h, kv), "gate/up": (h, i), "down": (i, h)}
    rates = {name: gemm_rate(2048, k, n, threads) for name, (k, n) in shapes.items()}
    rates["2048^3"] = gemm_rate(2048, 2048, 2048, threads, repeat=5)
    return rates


def build_engine(args):
    from pdpool.engine.config import EngineConfig
    from pdpool.engine.cpu_threads import serving_prefill_threads
    from pdpool.engine.engine_core import LLMEngine

    spec = WORKLOADS["long"]
    threads = args.threads or serving_prefill_threads() or torch.get_num_threads()
    config = EngineConfig(
        model=model_for(spec.model),
        device="cpu",
        max_model_len=spec.max_model_len,
        kv_cache_memory=(spec.kv_gib or 2) << 30,
        cpu_threads=threads,
        cpu_prefill_threads=threads,
    )
    return LLMEngine(config), threads


def add_requests(engine, rng: random.Random, count: int, tag: str) -> None:
    from pdpool.engine.sampling_params import SamplingParams

    spec, vocab = WORKLOADS["long"], engine.info.config["vocab_size"]
    for n in range(count):
        prompt = [rng.randrange(3, vocab - 20) for _ in range(rng.randint(*spec.prompt))]
        params = SamplingParams(
            max_tokens=rng.randint(*spec.output), temperature=0, ignore_eos=True
        )
        engine.add_request(f"{tag}-{n}", prompt, params)


def count_linear_flops(model: nn.Module, flops: dict) -> list:
    """Forward pre-hooks on every linear layer (packed or not) adding 2 * rows * in * out."""

    def hook(module, inputs):
        x = inputs[0]
        rows = x.numel() // x.shape[-1]
        flops["linear"] += 2.0 * rows * module.in_features * module.out_features

    return [
        m.register_forward_pre_hook(hook)
        for m in model.modules()
        if hasattr(m, "in_features") and hasattr(m, "out_features")
    ]


def run_engine(args):
    from pdpool.kernels import cpu_norm_rope, ops

    engine, threads = build_engine(args)
    rng = random.Random(args.seed)
    add_requests(engine, rng, 1, "warm")
    while engine.has_unfinished():
        engine.step()
    flops = {"linear": 0.0}
    hooks = count_linear_flops(engine.model, flops)
    counted = [
        Counted(ops, "paged_attention", "pdpool::attention", attention_flops),
        Counted(ops, "write_kv", "pdpool::kv_write"),
        Counted(cpu_norm_rope, "rms_norm", "pdpool::rms_norm"),
        Counted(cpu_norm_rope, "norm_rope_", "pdpool::norm_rope"),
    ]
    add_requests(engine, rng, args.requests, "r")
    steps = 0
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
                steps += 1
            wall = time.perf_counter() - t0
    finally:
        for c in counted:
            c.restore()
        for h in hooks:
            h.remove()
    flops["attention"] = counted[0].flops
    engine.close()
    return threads, steps, wall, category_seconds(prof), flops


def category_seconds(prof) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        for category, names in CATEGORIES.items():
            if event.key in names:
                # a label's children are C calls that torch does not see: its total is its own
                label = event.key.startswith("pdpool::")
                us = event.cpu_time_total if label else event.self_cpu_time_total
                totals[category] += us / 1e6
    return dict(totals)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--threads", type=int, help="default: what pdpool serve gives prompt steps")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    load_before = os.getloadavg()
    threads, steps, wall, totals, flops = run_engine(args)
    with open(os.path.join(model_for(WORKLOADS["long"].model), "config.json")) as fh:
        config = json.load(fh)
    limit = matmul_limit(config, threads)
    peak = max(limit.values())
    # Profiler totals add up the CPU time of the thread that called each op; ops that run
    # on several threads count once, with their wall time.
    other = max(0.0, wall - sum(totals.values()))
    rows = []
    for category in [*CATEGORIES, "other"]:
        seconds = other if category == "other" else totals.get(category, 0.0)
        gflop = flops.get(category, 0.0) / 1e9
        rows.append(
            {
                "part": category,
                "seconds": round(seconds, 3),
                "share": round(seconds / wall, 3),
                "GFLOP": round(gflop, 1),
                "GFLOP/s": round(gflop / seconds, 1) if seconds and gflop else "-",
                "of peak": round(gflop / seconds / peak, 2) if seconds and gflop else "-",
                "seconds at peak": round(gflop / peak, 3),
            }
        )
    total_gflop = sum(flops.values()) / 1e9
    print_table(
        [{"shape": k, "GFLOP/s": round(v, 1)} for k, v in limit.items()],
        f"matmul limit: packed oneDNN linear at 2048 rows, {threads} threads",
    )
    print_table(rows, f"{args.requests} long prompts, {steps} steps, {wall:.2f} s of steps")
    ideal = total_gflop / peak
    print(
        f"\nall FLOPs {total_gflop:.1f} GFLOP: {ideal:.2f} s at the matmul peak "
        f"({peak:.0f} GFLOP/s) vs {wall:.2f} s measured = {ideal / wall:.2f} of the limit; "
        f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    write_json(
        "long_prompt_profile",
        {
            "threads": threads,
            "requests": args.requests,
            "steps": steps,
            "wall_s": wall,
            "parts": rows,
            "matmul_limit_gflops": limit,
            "total_gflop": total_gflop,
            "fraction_of_limit": ideal / wall,
            "load_average": [load_before[0], os.getloadavg()[0]],
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
