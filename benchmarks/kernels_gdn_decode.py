"""Gated DeltaNet decode step: achieved bandwidth of the recurrent-state update, Triton vs torch.

A decode step reads and writes each request's fp32 state `[Hv, Dk, Dv]` once, so it is
memory bound: bytes = batch * Hv * Dk * Dv * 4 * 2. Shapes default to a Qwen3.5 linear-attention
layer (16 key heads, 32 value heads, 128 x 128), states in a pool addressed by state_indices.

    python benchmarks/kernels_gdn_decode.py            # on a GPU
    python benchmarks/kernels_gdn_decode.py --smoke    # interpreter check, no GPU
"""

from __future__ import annotations

import argparse
from functools import partial

from kernels_common import (
    HBM_PEAK_GBPS,
    device_name,
    lookup,
    print_table,
    setup,
    time_ms,
    write_json,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--k-heads", type=int, default=16)
    ap.add_argument("--v-heads", type=int, default=32)
    ap.add_argument("--k-dim", type=int, default=128)
    ap.add_argument("--v-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.batches, args.k_heads, args.v_heads, args.k_dim, args.v_dim = "1,2", 1, 2, 32, 32
        args.dtype = "float16"
    torch, device = setup(args.smoke)
    from pdpool.kernels.gated_delta import gated_delta_rule_decode_triton
    from pdpool.kernels.gdn_reference import gated_delta_rule_decode_reference

    dtype = getattr(torch, args.dtype)
    name = device_name(torch, device)
    peak = lookup(HBM_PEAK_GBPS, name) if device.type == "cuda" else None
    rows, points = [], []
    for batch in map(int, args.batches.split(",")):
        q = torch.randn(batch, args.k_heads, args.k_dim, dtype=dtype, device=device)
        k = torch.randn_like(q)
        v = torch.randn(batch, args.v_heads, args.v_dim, dtype=dtype, device=device)
        g = -torch.rand(batch, args.v_heads, device=device)
        beta = torch.rand(batch, args.v_heads, device=device).to(dtype)
        pool = torch.randn(batch * 2, args.v_heads, args.k_dim, args.v_dim, device=device) * 0.1
        indices = torch.randperm(batch * 2, device=device)[:batch]
        state_bytes = batch * args.v_heads * args.k_dim * args.v_dim * 4 * 2
        ms = time_ms(
            torch,
            device,
            partial(gated_delta_rule_decode_triton, q, k, v, g, beta, pool, state_indices=indices),
        )
        torch_ms = time_ms(
            torch,
            device,
            partial(
                gated_delta_rule_decode_reference, q, k, v, g, beta, pool, state_indices=indices
            ),
        )
        gbps = state_bytes / (ms * 1e-3) / 1e9
        point = {
            "batch": batch,
            "state_mb": state_bytes / 1e6,
            "triton_us": ms * 1e3,
            "gbps": gbps,
            "pct_peak": None if peak is None else 100 * gbps / peak,
            "torch_us": torch_ms * 1e3,
            "speedup": torch_ms / ms,
        }
        points.append(point)
        rows.append(
            [
                batch,
                f"{point['state_mb']:.1f}",
                f"{ms * 1e3:.1f}",
                f"{gbps:.0f}",
                "-" if peak is None else f"{point['pct_peak']:.0f}%",
                f"{torch_ms * 1e3:.1f}",
                f"{point['speedup']:.1f}x",
            ]
        )
    print(
        f"gated delta rule decode on {name}: Hk={args.k_heads} Hv={args.v_heads} "
        f"Dk={args.k_dim} Dv={args.v_dim} {args.dtype}, fp32 state pool; HBM peak "
        f"{peak or '?'} GB/s (datasheet)\n"
    )
    print_table(
        ["batch", "state MB (r+w)", "triton us", "GB/s", "%peak", "torch us", "speedup"], rows
    )
    write_json(
        "kernels_gdn_decode",
        {"device": name, "smoke": args.smoke, "peak_gbps": peak, "points": points},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
