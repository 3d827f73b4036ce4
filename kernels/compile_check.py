"""Compiles every Triton kernel for a CUDA architecture WITHOUT a GPU (Triton's bundled ptxas).

The interpreter used by the CPU tests is lenient: it runs Python semantics, so a kernel can
pass there and still fail to compile for a GPU (loop-carried types, constexpr misuse, dot
shapes). This compiles the configurations the launchers actually produce (through the same
pure planning helpers) down to cubin for the target, and reports each one.

    python -m pdpool.kernels.compile_check [--arch 90] [--quick]

Must run in a process where TRITON_INTERPRET is unset (the kernels are decorated at import).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PTR = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16"}
# At launch Triton specialises integer arguments equal to 1 into constants and marks pointers
# and integers divisible by 16; the head-dim strides are 1 for the engine's tensors.
# Compiling with the
# same specialisation checks the code the GPU will really run (vectorised loads included).
UNIT_STRIDES = (
    "stride_qd",
    "stride_kd",
    "stride_vd",
    "stride_od",
    "stride_kcd",
    "stride_vcd",
    "stride_sv",
)


def _specialise(fn, signature: dict, constexprs: dict):
    """Runtime-like specialisation: unit strides become constants, pointers 16-byte aligned."""
    signature, constexprs = dict(signature), dict(constexprs)
    for name in UNIT_STRIDES:
        if signature.get(name) == "i32":
            signature[name] = "constexpr"
            constexprs[name] = 1
    # strides of the engine's tensors are multiples of 16 (head dims are), which Triton
    # also detects at launch; it is what lets loads along the head dim vectorise
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if signature[name].startswith("*")
        or (name.startswith("stride") and signature[name] == "i32")
    }
    return signature, constexprs, attrs


def _signature(fn, constexprs: dict, pointers: dict, floats=()) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _attention_configs(quick: bool):
    import torch

    from .paged_attention_kernel import plan_attention

    shapes = [  # (label, dtype, H, H_kv, D, block, max_query_len, max_seq_len, window)
        ("prefill bf16 D128 gqa2", torch.bfloat16, 16, 8, 128, 16, 512, 4096, None),
        ("decode bf16 D128 gqa2 split", torch.bfloat16, 16, 8, 128, 16, 1, 32768, None),
        ("prefill fp16 D256 gqa4 window", torch.float16, 16, 4, 256, 32, 512, 4096, 1024),
        ("decode fp16 D64 gqa1 window split", torch.float16, 8, 8, 64, 16, 1, 8192, 512),
        ("prefill fp32 D128 gqa1", torch.float32, 4, 4, 128, 16, 64, 512, None),
        ("decode bf16 D256 gqa8 no split", torch.bfloat16, 32, 4, 256, 16, 1, 64, None),
    ]
    if quick:
        shapes = shapes[:2]
    for label, dtype, heads, kv_heads, dim, block, mql, msl, window in shapes:
        plan = plan_attention(
            num_tokens=4096,
            num_seqs=1 if mql > 1 else 4,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=dim,
            block_size=block,
            dtype=dtype,
            max_query_len=mql,
            max_seq_len=msl,
            sliding_window=window,
            sms=132,
        )
        yield label, dtype, plan


def _jobs(quick: bool):
    """(label, kernel, signature, constexprs, options) for every configuration to compile."""
    import torch

    from . import gated_delta, kv_write
    from . import paged_attention_kernel as paged_attention

    for label, dtype, plan in _attention_configs(quick):
        name = str(dtype).split(".")[-1]
        pointers = {n: PTR[name] for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
        pointers.update({n: "*fp32" for n in ("part_out_ptr", "part_max_ptr", "part_sum_ptr")})
        pointers.update(
            {n: "*i32" for n in ("block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr")}
        )
        kernel = paged_attention._paged_attention_kernel
        yield (
            f"paged_attention: {label} (splits={plan.num_splits})",
            kernel,
            _signature(kernel, plan.constexprs, pointers, ("scale_log2",)),
            plan.constexprs,
            {"num_warps": plan.num_warps, "num_stages": plan.num_stages},
        )
        if plan.num_splits > 1:
            merge = paged_attention._merge_splits_kernel
            ce = dict(
                HEAD_DIM=plan.constexprs["HEAD_DIM"],
                D_PAD=plan.constexprs["D_PAD"],
                NUM_SPLITS=plan.num_splits,
            )
            merge_ptrs = {
                "out_ptr": PTR[name],
                "part_out_ptr": "*fp32",
                "part_max_ptr": "*fp32",
                "part_sum_ptr": "*fp32",
            }
            yield (
                f"merge_splits: {label}",
                merge,
                _signature(merge, ce, merge_ptrs),
                ce,
                {"num_warps": 4},
            )
    for dtype, kv_heads, dim in (("bfloat16", 8, 128), ("float16", 4, 256)):
        ce = kv_write.write_kv_constexprs(kv_heads, dim, 16)
        ptrs = {n: PTR[dtype] for n in ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")}
        ptrs["slot_mapping_ptr"] = "*i64"
        kernel = kv_write._write_kv_kernel
        yield (
            f"write_kv: {dtype} H_kv={kv_heads} D={dim}",
            kernel,
            _signature(kernel, ce, ptrs),
            ce,
            {"num_warps": 4},
        )
        if quick:
            break
    for dtype, has_indices in (("bfloat16", True), ("float32", False)):
        ce = gated_delta.conv_update_constexprs(3, 4, True, True, has_indices)
        ptrs = {n: PTR[dtype] for n in ("x_ptr", "state_ptr", "weight_ptr", "bias_ptr", "out_ptr")}
        ptrs["indices_ptr"] = "*i32"
        kernel = gated_delta._conv1d_update_kernel
        yield (
            f"conv1d_update: {dtype} indices={has_indices}",
            kernel,
            _signature(kernel, ce, ptrs),
            ce,
            {"num_warps": 4},
        )
        ce = gated_delta.gdn_decode_constexprs(16, 32, 128, 128, True, has_indices)
        ptrs = {n: PTR[dtype] for n in ("q_ptr", "k_ptr", "v_ptr", "beta_ptr", "out_ptr")}
        ptrs.update({"g_ptr": "*fp32", "state_ptr": "*fp32", "indices_ptr": "*i32"})
        kernel = gated_delta._gated_delta_decode_kernel
        yield (
            f"gated_delta_decode: {dtype} 16/32 heads 128x128 indices={has_indices}",
            kernel,
            _signature(kernel, ce, ptrs, ("scale",)),
            ce,
            {"num_warps": 4},
        )
        if quick:
            break
    del torch


def _ptxas_info(ptx: str, arch: int) -> str:
    """Registers and spills of one kernel, from `ptxas -v` on its PTX (best effort)."""
    import subprocess
    import tempfile

    from triton import knobs

    suffix = "a" if arch >= 90 else ""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        for tool in ("ptxas_blackwell", "ptxas"):
            path = getattr(getattr(knobs.nvidia, tool, None), "path", None)
            if not path:
                continue
            run = subprocess.run(
                [path, "-v", "--gpu-name", f"sm_{arch}{suffix}", f.name, "-o", os.devnull],
                capture_output=True,
                text=True,
            )
            if run.returncode == 0:
                lines = [
                    line.split("info    : ")[-1].strip()
                    for line in run.stderr.splitlines()
                    if "registers" in line or "spill" in line
                ]
                return "; ".join(lines)
        return "ptxas unavailable"
    finally:
        os.unlink(f.name)


def check(arch: int, quick: bool = False, ptxas_info: bool = False) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = []
    target = GPUTarget("cuda", arch, 32)
    for label, kernel, signature, constexprs, options in _jobs(quick):
        start = time.perf_counter()
        try:
            signature, constexprs, attrs = _specialise(kernel, signature, constexprs)
            compiled = triton.compile(
                ASTSource(kernel, signature, constexprs, attrs), target=target, options=options
            )
            results.append(
                {
                    "kernel": label,
                    "ok": True,
                    "shared_bytes": compiled.metadata.shared,
                    "seconds": round(time.perf_counter() - start, 2),
                }
            )
            if ptxas_info:
                results[-1]["ptxas"] = _ptxas_info(compiled.asm["ptx"], arch)
        except Exception as exc:  # report every failure, keep compiling the rest
            first = str(exc).strip().splitlines()
            results.append(
                {
                    "kernel": label,
                    "ok": False,
                    "error": f"{type(exc).__name__}: {first[0] if first else ''}"[:2000],
                }
            )
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    ap.add_argument("--quick", action="store_true", help="one configuration per kernel")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--ptxas-info", action="store_true", help="registers and spills per kernel")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter cannot compile for a GPU", file=sys.stderr)
        return 2
    results = check(args.arch, args.quick, args.ptxas_info)
    if args.json:
        print(json.dumps(results))
    else:
        for r in results:
            status = f"ok  smem={r['shared_bytes']}" if r["ok"] else f"FAIL {r['error']}"
            if r.get("ptxas"):
                status += f"  [{r['ptxas']}]"
            print(f"sm_{args.arch}  {r['kernel']}: {status}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
