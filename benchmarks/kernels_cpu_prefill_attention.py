"""CPU prefill attention GFLOP/s against the same core's matmul GFLOP/s on the same tokens.

    python benchmarks/kernels_cpu_prefill_attention.py                 # 512-4096 tokens
    python benchmarks/kernels_cpu_prefill_attention.py --prompts 1024 --prefix 0 --repeats 3
    python benchmarks/kernels_cpu_prefill_attention.py --threads 2    # kernel and matmul on 2
    python benchmarks/kernels_cpu_prefill_attention.py --build avx2   # the AVX2 path here

One sequence per call, its prompt of N new tokens over a cached prefix of P tokens (0: a
prompt from scratch), on --threads torch threads (the kernel deals its tiles over as many),
shape of the engine_vs_vllm
"large" model by default (8 query heads on 4 KV heads of 64, block size 16, block tables
scattered over the cache). FLOPs count the causal work only: 4 * H * D per visible
(query, key) pair. Columns:
  kernel   kernels/cpu_prefill_attention.py (what the engine runs now);
  torch    the engine's torch path before it (gather + SDPA with an explicit mask, per
           sequence): what the engine ran before the kernel, and its fallback;
  blocked  a blocked torch alternative (gather, then per 256-query block one bmm for the
           scores, softmax, one bmm for the values; fully masked keys never computed);
  matmul   torch.mm of [N, H*D] x [H*D, 3*H*D] (a QKV projection over the same tokens).
Times are the minimum over the repeats (wall clock; the process's CPU time is in the JSON
too: on a shared machine it is the steadier figure). Results go to
benchmarks/results/kernels_cpu_prefill_attention.json (_Nthreads.json for N > 1, _avx2 or
_portable for another build).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_json

from pdpool.kernels import cpu_prefill_attention as kernel
from pdpool.kernels import reference


def causal_pairs(q_len: int, prefix: int) -> int:
    """Visible (query, key) pairs: query i of the prompt sees prefix + i + 1 keys."""
    return q_len * prefix + q_len * (q_len + 1) // 2


def timed(fn, repeats: int) -> tuple[float, float]:
    """Minimum wall and thread-CPU seconds of a call, after one warm-up call."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - w)
    return min(wall), min(cpu)


def blocked_torch(q, k, v, prefix: int, scale: float, block: int = 256) -> torch.Tensor:
    """q [N, H, D] over gathered k, v [H_kv, L, D]: per block of queries, scores by bmm over
    the keys it may see, masked softmax on the diagonal part, values by bmm."""
    n, heads, dim = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    out = torch.empty_like(q)
    qg = q.view(n, kv_heads, group, dim).permute(1, 2, 0, 3)  # [H_kv, G, N, D]
    for lo in range(0, n, block):
        hi = min(lo + block, n)
        keys = prefix + hi  # the last query of the block sees this many
        qb = qg[:, :, lo:hi].reshape(kv_heads, group * (hi - lo), dim)
        s = torch.bmm(qb, k[:, :keys].transpose(1, 2)).mul_(scale)
        s = s.view(kv_heads, group, hi - lo, keys)
        q_pos = torch.arange(prefix + lo, prefix + hi)[:, None]
        s.masked_fill_(torch.arange(keys)[None, :] > q_pos, float("-inf"))
        p = torch.softmax(s, dim=-1).view(kv_heads, group * (hi - lo), keys)
        o = torch.bmm(p, v[:, :keys]).view(kv_heads, group, hi - lo, dim)
        out[lo:hi] = o.permute(2, 0, 1, 3).reshape(hi - lo, heads, dim)
    return out


def setup(prompt: int, prefix: int, heads: int, kv_heads: int, dim: int, block_size: int):
    total = prompt + prefix
    per_seq = -(-total // block_size)
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(per_seq + 1, 2, 2, block_size, kv_heads, dim, generator=gen)
    tables = torch.randperm(per_seq + 1, generator=gen)[:per_seq].view(1, -1).to(torch.int32)
    q = torch.randn(prompt, heads, dim, generator=gen)
    return q, kv[:, 1, 0], kv[:, 1, 1], tables


def measure(args, prompt: int, prefix: int) -> dict:
    heads, kv_heads, dim = args.heads, args.kv_heads, args.head_dim
    q, k_cache, v_cache, tables = setup(prompt, prefix, heads, kv_heads, dim, args.block_size)
    total, scale = prompt + prefix, dim**-0.5
    starts, lens = [0, prompt], [total]
    flops = 4 * heads * dim * causal_pairs(prompt, prefix)
    gflops = {}
    cpu_gflops = {}

    def record(name, fn, repeats):
        wall, cpu = timed(fn, repeats)
        gflops[name], cpu_gflops[name] = flops / wall / 1e9, flops / cpu / 1e9
        return wall

    ms = 1e3 * record(
        "kernel",
        lambda: kernel.paged_prefill_attention(
            q, k_cache, v_cache, tables, starts, lens, scale, None, build=args.build
        ),
        args.repeats,
    )
    if not args.no_torch:
        record(
            "torch",
            lambda: reference.paged_attention_reference(
                q,
                k_cache,
                v_cache,
                tables,
                torch.tensor(starts, dtype=torch.int32),
                torch.tensor(lens, dtype=torch.int32),
                scale,
            ),
            max(1, args.repeats // 3),
        )
        k, v = reference._gather_sequence(k_cache, v_cache, tables[0], total)
        record(
            "blocked",
            lambda: blocked_torch(q, k, v, prefix, scale),
            max(1, args.repeats // 2),
        )
    a = torch.randn(prompt, heads * dim)
    w = torch.randn(heads * dim, 3 * heads * dim)
    mm_wall, mm_cpu = timed(lambda: torch.mm(a, w), args.repeats)
    mm_flops = 2 * prompt * heads * dim * 3 * heads * dim
    matmul, matmul_cpu = mm_flops / mm_wall / 1e9, mm_flops / mm_cpu / 1e9
    return {
        "prompt": prompt,
        "prefix": prefix,
        "kernel_ms": ms,
        "gflops": gflops,
        "cpu_gflops": cpu_gflops,
        "matmul_gflops": matmul,
        "matmul_cpu_gflops": matmul_cpu,
        "kernel_vs_matmul": gflops["kernel"] / matmul,
        "kernel_vs_matmul_cpu": cpu_gflops["kernel"] / matmul_cpu,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="512,1024,2048,4096", help="new tokens per sequence")
    ap.add_argument("--prefix", default="0,1024", help="cached prefix lengths to try")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads, and the kernel's (results file _Nthreads)",
    )
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--no-torch", action="store_true", help="skip the slow torch paths")
    ap.add_argument(
        "--build",
        default="native",
        choices=["native", *kernel.TEST_BUILDS],
        help="the kernel's build: this CPU's widest vectors, or a narrower path",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not kernel.usable_for(*setup(16, 0, args.heads, args.kv_heads, args.head_dim, 16)[:3]):
        sys.exit("the kernel does not run here (no C compiler, or PDPOOL_CPU_PREFILL_KERNEL=0)")
    points, rows = [], []
    for prefix in map(int, args.prefix.split(",")):
        for prompt in map(int, args.prompts.split(",")):
            p = measure(args, prompt, prefix)
            points.append(p)
            g = p["gflops"]
            rows.append(
                {
                    "prompt": prompt,
                    "prefix": prefix,
                    "kernel ms": round(p["kernel_ms"], 1),
                    "kernel GF/s": round(g["kernel"], 1),
                    "torch GF/s": round(g["torch"], 1) if "torch" in g else "-",
                    "blocked GF/s": round(g["blocked"], 1) if "blocked" in g else "-",
                    "matmul GF/s": round(p["matmul_gflops"], 1),
                    "kernel/matmul": round(p["kernel_vs_matmul"], 2),
                    "(cpu time)": round(p["kernel_vs_matmul_cpu"], 2),
                }
            )
    print_table(
        rows,
        f"CPU prefill attention, {args.heads} heads on {args.kv_heads} KV heads of "
        f"{args.head_dim}, block {args.block_size}, {args.threads} thread(s), {args.build} build; "
        f"GFLOP/s from the best of {args.repeats} (wall); load average {os.getloadavg()[0]:.1f}",
    )
    write_json(
        "kernels_cpu_prefill_attention"
        + ("" if args.threads == 1 else f"_{args.threads}threads")
        + ("" if args.build == "native" else f"_{args.build}"),
        {
            "shape": {
                "heads": args.heads,
                "kv_heads": args.kv_heads,
                "head_dim": args.head_dim,
                "block_size": args.block_size,
                "threads": args.threads,
            },
            "load_average": os.getloadavg(),
            "points": points,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
