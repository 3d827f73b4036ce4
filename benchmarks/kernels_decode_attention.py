"""Decode paged attention: achieved memory bandwidth vs the GPU's HBM peak (a roofline table).

Decode attention is memory bound: each step reads every cached K/V row of every sequence once.
Bytes = batch * context * H_kv * D * 2 (K and V) * element size (q, out, tables are noise).
Shapes default to one Qwen3-0.6B layer: 16 query heads, 8 KV heads, head dim 128, bf16,
block size 16, block tables scattered at random over the cache.

    python benchmarks/kernels_decode_attention.py            # on a GPU
    python benchmarks/kernels_decode_attention.py --smoke    # interpreter check, no GPU
"""

from __future__ import annotations

import argparse
from functools import partial

from kernels_common import (  # noqa: F401
    BF16_PEAK_TFLOPS,
    HBM_PEAK_GBPS,
    device_name,
    lookup,
    measured_copy_gbps,
    print_table,
    setup,
    time_ms,
    write_json,
)


def build(torch, device, dtype, batch, context, heads, kv_heads, head_dim, block_size):
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks - 1, device=device)[: batch * blocks_per_seq]
    tables = tables.view(batch, blocks_per_seq).to(torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)
    return q, k_cache, v_cache, tables, starts, lens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--contexts", default="512,2048,8192,32768")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--peak-gbps", type=float, help="HBM peak; default: datasheet by GPU name")
    ap.add_argument("--max-cache-gb", type=float, default=24.0, help="skip bigger points")
    ap.add_argument(
        "--torch",
        action="store_true",
        help="also time the torch reference (the CPU path) where it is affordable",
    )
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.batches, args.contexts = "1,2", "64,160"
        args.heads, args.kv_heads, args.head_dim = 4, 2, 64
        args.dtype = "float16"
    torch, device = setup(args.smoke)
    from pdpool.kernels.paged_attention_kernel import paged_attention_triton
    from pdpool.kernels.reference import paged_attention_reference

    dtype = getattr(torch, args.dtype)
    name = device_name(torch, device)
    peak = args.peak_gbps or lookup(HBM_PEAK_GBPS, name)
    copy_gbps = measured_copy_gbps(torch, device)
    elem = torch.finfo(dtype).bits // 8
    scale = args.head_dim**-0.5
    rows, points = [], []
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            kv_bytes = batch * context * args.kv_heads * args.head_dim * 2 * elem
            if kv_bytes / 1e9 > args.max_cache_gb:
                continue
            q, kc, vc, tables, starts, lens = build(
                torch,
                device,
                dtype,
                batch,
                context,
                args.heads,
                args.kv_heads,
                args.head_dim,
                args.block_size,
            )

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
                max_query_len=1,
                max_seq_len=context,
            )

            expected = paged_attention_reference(
                q[:1], kc, vc, tables[:1], starts[:2], lens[:1], scale
            )
            err = (run()[:1].float() - expected.float()).abs().max().item()
            ms = time_ms(torch, device, run)
            gbps = kv_bytes / (ms * 1e-3) / 1e9
            torch_ms = None
            if args.torch and batch * context <= 64 * 8192:
                torch_ms = time_ms(
                    torch,
                    device,
                    partial(paged_attention_reference, q, kc, vc, tables, starts, lens, scale),
                    warmup=1,
                    iters=3,
                )
            point = {
                "batch": batch,
                "context": context,
                "kv_mb": kv_bytes / 1e6,
                "triton_us": ms * 1e3,
                "gbps": gbps,
                "pct_peak": None if peak is None else 100 * gbps / peak,
                "pct_copy": None if copy_gbps is None else 100 * gbps / copy_gbps,
                "torch_us": None if torch_ms is None else torch_ms * 1e3,
                "max_abs_err_seq0": err,
            }
            points.append(point)
            rows.append(
                [
                    batch,
                    context,
                    f"{point['kv_mb']:.1f}",
                    f"{point['triton_us']:.1f}",
                    f"{gbps:.0f}",
                    "-" if peak is None else f"{point['pct_peak']:.0f}%",
                    "-" if copy_gbps is None else f"{point['pct_copy']:.0f}%",
                    "-" if torch_ms is None else f"{torch_ms * 1e3:.0f}",
                    f"{err:.1e}",
                ]
            )
            q = kc = vc = tables = None  # free the cache before the next shape
    print(
        f"decode paged attention on {name}: H={args.heads} H_kv={args.kv_heads} "
        f"D={args.head_dim} {args.dtype} block={args.block_size}; HBM peak "
        f"{peak or '?'} GB/s (datasheet), "
        f"copy {copy_gbps and round(copy_gbps)} GB/s (measured)\n"
    )
    print_table(
        ["batch", "context", "KV MB", "triton us", "GB/s", "%peak", "%copy", "torch us", "err"],
        rows,
    )
    write_json(
        "kernels_decode_attention",
        {
            "device": name,
            "smoke": args.smoke,
            "peak_gbps": peak,
            "copy_gbps": copy_gbps,
            "shape": {
                "heads": args.heads,
                "kv_heads": args.kv_heads,
                "head_dim": args.head_dim,
                "block_size": args.block_size,
                "dtype": args.dtype,
            },
            "points": points,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
