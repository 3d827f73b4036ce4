"""Where a long-prompt step's time goes, against the matmul limit of this CPU.

    python benchmarks/long_prompt_profile.py                  # 16 prompts of the `long` shape
    python benchmarks/long_prompt_profile.py --requests 64    # the `burst` shape's 64 at once

Runs the engine in this process (no HTTP) on `engine_vs_vllm.py`'s long-prompt workload (the
large model, prompts of 1000-3000 random tokens, 32-64 greedy outputs, fresh prompts, all
added at once) with the thread counts `pdpool serve` gives (every core for steps of 256+
tokens, one fewer for decode steps), and splits the steps' wall time into: linear layers in
wide (prompt) and narrow (decode) steps, prefill attention (the prefill kernel), decode
attention (the decode kernel: in the wide steps beside the chunks too), the K/V scatter,
RMSNorm and rotary, and the rest (activation, residual adds, scheduler, sampling, Python
between ops). Each part is timed by wall clock around its calls (forward hooks on the
linears, wrappers around the kernels' entry points), so parts that run on several threads
count once, and nothing else runs in between.

The limits: the matmul peak (the engine's packed oneDNN linear on this model's projection
shapes at 2048 rows and a 2048^3 GEMM, on the prompt steps' threads) for the parts that
compute, and the rate at which the same threads stream memory (a sum over 256 MiB) for
decode attention, which reads each cached K and V once for a few FLOPs. `ideal` is every
part at its limit; the gap to it is printed per part. Each thread's CPU seconds per wall
second over the steps are printed too: where their sum stays below the thread count, a core
stood idle (the main thread's work alone: decode steps, norms, sampling, Python). Results:
benchmarks/results/long_prompt_profile.json.
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

from pdpool.engine.cpu_memory import keep_freed_memory
from pdpool.engine.cpu_threads import quiet_openmp_spin

# The OpenMP runtime reads its spin setting when torch loads: `pdpool serve`'s, as its engine
# process gets it, before the import.
quiet_openmp_spin()
keep_freed_memory()  # as `pdpool serve`'s engine process does

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import print_table, write_json  # noqa: E402
from benchmarks.proc_cpu import cpu_seconds_of  # noqa: E402
from benchmarks.engine_vs_vllm import WORKLOADS, model_for  # noqa: E402

PARTS = (
    "linear, wide steps",
    "linear, narrow steps",
    "prefill attention",
    "decode attention",
    "kv_write",
    "norm_rope",
)


def thread_cpu_seconds() -> dict[int, float]:
    """CPU seconds (user + system) of each thread of this process, by thread id."""
    return {
        int(tid): cpu_seconds_of(f"/proc/self/task/{tid}/stat")
        for tid in os.listdir("/proc/self/task")
    }


def busy_threads(before: dict[int, float], after: dict[int, float], wall: float) -> list[float]:
    """Each thread's CPU seconds per wall second between the two readings, busiest first
    (threads that did nothing left out): the cores the steps kept busy, thread by thread."""
    busy = [(cpu - before.get(tid, 0.0)) / wall for tid, cpu in after.items()]
    return sorted((round(b, 2) for b in busy if b >= 0.01), reverse=True)


class Clock:
    """Wall time, FLOPs and bytes per part."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.flops: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, float] = defaultdict(float)


class Timed:
    """Wraps a module's function: adds the wall time of each call (and its FLOPs and bytes,
    counted from its arguments) to a part of the clock."""

    def __init__(self, clock: Clock, owner, attr: str, part: str, flops=None, bytes_=None):
        self.clock, self.owner, self.attr, self.fn = clock, owner, attr, getattr(owner, attr)
        self.part, self.flops_of, self.bytes_of = part, flops, bytes_
        setattr(owner, attr, self)

    def __call__(self, *args, **kwargs):
        if self.flops_of is not None:
            self.clock.flops[self.part] += self.flops_of(*args, **kwargs)
        if self.bytes_of is not None:
            self.clock.bytes[self.part] += self.bytes_of(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.clock.seconds[self.part] += time.perf_counter() - t0

    def restore(self) -> None:
        setattr(self.owner, self.attr, self.fn)


def prefill_flops(q, k_cache, v_cache, tables, starts, lens, *a, skip_single=False, **kw):
    """QK^T and PV of causal attention: each new query at context c does 4 * c * D per head
    (sequences of one query are skipped when the decode kernel serves them)."""
    heads, dim = q.shape[1], q.shape[2]
    flops = 0.0
    for b, total in enumerate(lens):
        n = starts[b + 1] - starts[b]
        if skip_single and n == 1:
            continue
        first = total - n + 1  # context of the first new query
        flops += 4.0 * heads * dim * (first + total) * n / 2
    return flops


def decode_flops(q, k_cache, v_cache, tables, lens, *a, **kw):
    return 4.0 * q.shape[1] * q.shape[2] * sum(lens)


def decode_bytes(q, k_cache, v_cache, tables, lens, *a, **kw):
    """Every cached K and V row of every KV head, read once."""
    row = k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    return 2.0 * row * sum(lens)


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


def stream_rate(threads: int, mib: int = 256, repeat: int = 10) -> float:
    """GB/s at which torch's threads read memory (a sum over `mib` MiB)."""
    torch.set_num_threads(threads)
    x = torch.ones(mib << 18)
    x.sum()
    t0 = time.perf_counter()
    for _ in range(repeat):
        x.sum()
    return x.numel() * 4 * repeat / (time.perf_counter() - t0) / 1e9


def build_engine(args):
    from pdpool.engine.config import EngineConfig
    from pdpool.engine.cpu_threads import serving_cpu_threads, serving_prefill_threads
    from pdpool.engine.engine_core import LLMEngine

    spec = WORKLOADS["long"]
    threads = args.threads or serving_prefill_threads() or torch.get_num_threads()
    decode = args.threads or serving_cpu_threads() or threads
    config = EngineConfig(
        model=model_for(spec.model),
        device="cpu",
        max_model_len=spec.max_model_len,
        kv_cache_memory=(spec.kv_gib or 2) << 30,
        cpu_threads=decode,
        cpu_prefill_threads=threads,
    )
    return LLMEngine(config), threads


def add_requests(engine, rng: random.Random, count: int, tag: str) -> int:
    """Adds `count` fresh long prompts; returns their output tokens (ignore_eos: exact)."""
    from pdpool.engine.sampling_params import SamplingParams

    spec, vocab = WORKLOADS["long"], engine.info.config["vocab_size"]
    outputs = 0
    for n in range(count):
        prompt = [rng.randrange(3, vocab - 20) for _ in range(rng.randint(*spec.prompt))]
        params = SamplingParams(
            max_tokens=rng.randint(*spec.output), temperature=0, ignore_eos=True
        )
        engine.add_request(f"{tag}-{n}", prompt, params)
        outputs += params.max_tokens
    return outputs


def time_linears(model: nn.Module, clock: Clock, wide_rows: int) -> list:
    """Forward hooks on every linear layer (packed or not): wall time, and 2 * rows * in *
    out FLOPs, into the wide part for calls of `wide_rows` rows or more (a prompt step's
    layers; its LM head sees only the sampled rows), else the narrow part."""
    started: dict[int, tuple[str, float]] = {}

    def before(module, inputs):
        x = inputs[0]
        rows = x.numel() // x.shape[-1]
        part = "linear, wide steps" if rows >= wide_rows else "linear, narrow steps"
        clock.flops[part] += 2.0 * rows * module.in_features * module.out_features
        started[id(module)] = (part, time.perf_counter())

    def after(module, inputs, output):
        part, t0 = started.pop(id(module))
        clock.seconds[part] += time.perf_counter() - t0

    hooks = []
    for m in model.modules():
        if hasattr(m, "in_features") and hasattr(m, "out_features"):
            hooks += [m.register_forward_pre_hook(before), m.register_forward_hook(after)]
    return hooks


def run_engine(args):
    from pdpool.engine.cpu_threads import WIDE_STEP_TOKENS
    from pdpool.kernels import cpu_decode_attention, cpu_norm_rope, cpu_prefill_attention, ops

    engine, threads = build_engine(args)
    rng = random.Random(args.seed)
    add_requests(engine, rng, 1, "warm")
    while engine.has_unfinished():
        engine.step()
    clock = Clock()
    hooks = time_linears(engine.model, clock, WIDE_STEP_TOKENS)
    timed = [
        Timed(
            clock,
            cpu_prefill_attention,
            "paged_prefill_attention",
            "prefill attention",
            prefill_flops,
        ),
        Timed(
            clock,
            cpu_decode_attention,
            "paged_decode_attention",
            "decode attention",
            decode_flops,
            decode_bytes,
        ),
        Timed(clock, ops, "write_kv", "kv_write"),
        Timed(clock, cpu_norm_rope, "rms_norm", "norm_rope"),
        Timed(clock, cpu_norm_rope, "norm_rope_", "norm_rope"),
    ]
    outputs = add_requests(engine, rng, args.requests, "r")
    steps = {"wide": [0, 0.0], "narrow": [0, 0.0]}
    try:
        t0, cpu0 = time.perf_counter(), thread_cpu_seconds()
        while engine.has_unfinished():
            s0, prefill_s = time.perf_counter(), clock.seconds["prefill attention"]
            engine.step()
            # a wide step computed prompt chunks: it called the prefill kernel
            kind = "wide" if clock.seconds["prefill attention"] > prefill_s else "narrow"
            steps[kind][0] += 1
            steps[kind][1] += time.perf_counter() - s0
        wall = time.perf_counter() - t0
        busy = busy_threads(cpu0, thread_cpu_seconds(), wall)
    finally:
        for t in timed:
            t.restore()
        for h in hooks:
            h.remove()
    engine.close()
    return threads, steps, wall, clock, outputs, busy


def part_rows(clock: Clock, wall: float, peak: float, stream: float) -> list[dict]:
    """One row per part, then the rest: its wall time and share of the steps, what it did
    (GFLOP, or GB read for decode attention), its rate against its limit, and its time at
    that limit."""
    rows = []
    for part in (*PARTS, "rest"):
        seconds = clock.seconds.get(part, 0.0)
        if part == "rest":
            seconds = max(0.0, wall - sum(clock.seconds.values()))
        gflop, gb = clock.flops.get(part, 0.0) / 1e9, clock.bytes.get(part, 0.0) / 1e9
        if gb:  # memory-bound: its limit is the stream rate
            rate, limit, unit = gb / seconds, stream, f"{gb:.1f} GB"
        elif gflop:
            rate, limit, unit = gflop / seconds, peak, f"{gflop:.1f} GFLOP"
        else:
            rate, limit, unit = 0.0, 0.0, "-"
        rows.append(
            {
                "part": part,
                "seconds": round(seconds, 3),
                "share": round(seconds / wall, 3),
                "work": unit,
                "rate": f"{rate:.1f} {'GB/s' if gb else 'GFLOP/s'}" if rate else "-",
                "of limit": round(rate / limit, 2) if rate else "-",
                "seconds at limit": round((gb or gflop) / limit, 3) if limit else 0.0,
            }
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16, help="prompts added at once")
    ap.add_argument("--threads", type=int, help="one count for every step (default: serve's)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.requests < 1 or (args.threads is not None and args.threads < 1):
        ap.error("--requests and --threads must be at least 1")
    load_before = os.getloadavg()
    threads, steps, wall, clock, outputs, busy = run_engine(args)
    with open(os.path.join(model_for(WORKLOADS["long"].model), "config.json")) as fh:
        config = json.load(fh)
    limit = matmul_limit(config, threads)
    peak = max(limit.values())
    stream = stream_rate(threads)
    rows = part_rows(clock, wall, peak, stream)
    print_table(
        [{"shape": k, "GFLOP/s": round(v, 1)} for k, v in limit.items()],
        f"matmul limit: packed oneDNN linear at 2048 rows, {threads} threads; "
        f"memory stream {stream:.1f} GB/s",
    )
    print_table(
        rows,
        f"{args.requests} long prompts at once: {outputs} output tokens in {wall:.2f} s of "
        f"steps ({outputs / wall:.1f} tok/s); {steps['wide'][0]} wide steps "
        f"{steps['wide'][1]:.2f} s, {steps['narrow'][0]} narrow {steps['narrow'][1]:.2f} s",
    )
    compute = ("linear, wide steps", "linear, narrow steps", "prefill attention")
    compute_s = sum(clock.seconds.get(p, 0.0) for p in compute)
    ideal = sum(r["seconds at limit"] for r in rows)
    total_gflop = sum(clock.flops.values()) / 1e9
    print(
        f"\ncompute (linears, prefill attention) {compute_s:.2f} s = {compute_s / wall:.2f} "
        f"of the steps; all FLOPs {total_gflop:.1f} GFLOP = {total_gflop / peak:.2f} s at "
        f"the matmul peak ({peak:.0f} GFLOP/s), plus decode attention at the stream rate: "
        f"{ideal:.2f} s ideal vs {wall:.2f} s measured = {ideal / wall:.2f} of the limit "
        f"(at most {outputs / ideal:.0f} tok/s); cores busy over the steps {sum(busy):.2f} of "
        f"{threads} (by thread: {busy}); load average {load_before[0]:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after"
    )
    write_json(
        "long_prompt_profile",
        {
            "threads": threads,
            "requests": args.requests,
            "output_tokens": outputs,
            "steps": steps,
            "wall_s": wall,
            "parts": rows,
            "matmul_limit_gflops": limit,
            "stream_gb_s": stream,
            "total_gflop": total_gflop,
            "compute_share": compute_s / wall,
            "ideal_s": ideal,
            "fraction_of_limit": ideal / wall,
            "busy_by_thread": busy,
            "load_average": [load_before[0], os.getloadavg()[0]],
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
