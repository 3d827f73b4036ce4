"""Prefill paged attention throughput (TFLOP/s), with and without a cached prefix.

FLOPs count the causal work only: 4 * H * D per (query, visible key) pair (QK^T and PV).
The baseline is torch's scaled_dot_product_attention (flash) on contiguous, non-paged
tensors of the same shape: a ceiling for what the paged kernel pays for its indirection.

    python benchmarks/kernels_prefill_attention.py            # on a GPU
    python benchmarks/kernels_prefill_attention.py --smoke    # interpreter check, no GPU

The CPU kernel (kernels/cpu_prefill_attention.py) has its own benchmark, in GFLOP/s against
the core's matmul: benchmarks/kernels_cpu_prefill_attention.py.
"""

from __future__ import annotations

import argparse
from functools import partial

from kernels_common import (
    BF16_PEAK_TFLOPS,
    device_name,
    lookup,
    print_table,
    setup,
    time_ms,
    write_json,
)


def causal_pairs(q_len: int, context: int) -> int:
    """Visible (query, key) pairs of one sequence: query i sees context + i + 1 keys."""
    return q_len * context + q_len * (q_len + 1) // 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", default="512,1024,2048,4096,8192")
    ap.add_argument("--tokens", type=int, default=16384, help="new tokens per batch")
    ap.add_argument("--prefix", default="0,2048", help="cached prefix lengths to try")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dims", default="128,256")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.seq_lens, args.tokens, args.prefix = "32,64", 64, "0,16"
        args.heads, args.kv_heads, args.head_dims, args.dtype = 2, 1, "64", "float16"
    torch, device = setup(args.smoke)
    import torch.nn.functional as F

    from pdpool.kernels.paged_attention_kernel import paged_attention_triton

    dtype = getattr(torch, args.dtype)
    name = device_name(torch, device)
    peak = lookup(BF16_PEAK_TFLOPS, name) if device.type == "cuda" else None
    rows, points = [], []
    for head_dim in map(int, args.head_dims.split(",")):
        scale = head_dim**-0.5
        for seq_len in map(int, args.seq_lens.split(",")):
            batch = max(1, args.tokens // seq_len)
            for prefix in map(int, args.prefix.split(",")):
                total = prefix + seq_len
                per_seq = -(-total // args.block_size)
                kc = torch.randn(
                    batch * per_seq,
                    args.block_size,
                    args.kv_heads,
                    head_dim,
                    dtype=dtype,
                    device=device,
                )
                vc = torch.randn_like(kc)
                tables = torch.randperm(batch * per_seq, device=device).view(batch, per_seq)
                tables = tables.to(torch.int32)
                starts = torch.arange(batch + 1, dtype=torch.int32, device=device) * seq_len
                lens = torch.full((batch,), total, dtype=torch.int32, device=device)
                q = torch.randn(batch * seq_len, args.heads, head_dim, dtype=dtype, device=device)
                flops = 4 * args.heads * head_dim * batch * causal_pairs(seq_len, prefix)

                # partial, not a closure: it holds this iteration's tensors.
                run = partial(
                    paged_attention_triton,
                    q,
                    kc,
                    vc,
                    tables,
                    starts,
                    lens,
                    scale,
                    max_query_len=seq_len,
                    max_seq_len=total,
                )

                ms = time_ms(torch, device, run)
                tflops = flops / (ms * 1e-3) / 1e12
                sdpa_tflops = None
                if prefix == 0 and device.type == "cuda":
                    qs = q.view(batch, seq_len, args.heads, head_dim).transpose(1, 2)
                    ks = torch.randn(
                        batch, args.kv_heads, seq_len, head_dim, dtype=dtype, device=device
                    )
                    vs = torch.randn_like(ks)
                    sdpa_ms = time_ms(
                        torch,
                        device,
                        partial(
                            F.scaled_dot_product_attention,
                            qs,
                            ks,
                            vs,
                            is_causal=True,
                            scale=scale,
                            enable_gqa=True,
                        ),
                    )
                    sdpa_tflops = flops / (sdpa_ms * 1e-3) / 1e12
                point = {
                    "head_dim": head_dim,
                    "seq_len": seq_len,
                    "batch": batch,
                    "prefix": prefix,
                    "ms": ms,
                    "tflops": tflops,
                    "pct_peak": None if peak is None else 100 * tflops / peak,
                    "sdpa_tflops": sdpa_tflops,
                }
                points.append(point)
                rows.append(
                    [
                        head_dim,
                        seq_len,
                        batch,
                        prefix,
                        f"{ms:.3f}",
                        f"{tflops:.1f}",
                        "-" if peak is None else f"{point['pct_peak']:.0f}%",
                        "-" if sdpa_tflops is None else f"{sdpa_tflops:.1f}",
                    ]
                )
                kc = vc = q = None  # free the cache before the next shape
    print(
        f"prefill paged attention on {name}: H={args.heads} H_kv={args.kv_heads} "
        f"{args.dtype} block={args.block_size}, {args.tokens} new tokens per batch; "
        f"bf16 dense peak {peak or '?'} TFLOP/s (datasheet)\n"
    )
    print_table(["D", "seq", "batch", "prefix", "ms", "TFLOP/s", "%peak", "sdpa TFLOP/s"], rows)
    write_json(
        "kernels_prefill_attention",
        {"device": name, "smoke": args.smoke, "peak_tflops": peak, "points": points},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
