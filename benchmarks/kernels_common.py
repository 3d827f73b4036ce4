"""Helpers shared by the kernel benchmarks: device setup, timing, peaks, tables, JSON output.

`--smoke` runs tiny shapes under TRITON_INTERPRET=1 on a machine without a GPU: it checks
that a script works end to end; its numbers mean nothing and are labelled so.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

# Datasheet HBM bandwidth, GB/s (1e9 bytes/s), matched against torch's device name.
HBM_PEAK_GBPS = [
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("H800", 3350.0),
    ("GH200", 4000.0),
    ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("A10", 600.0),
    ("RTX 4090", 1008.0),
]
# Datasheet dense bf16 tensor-core TFLOP/s.
BF16_PEAK_TFLOPS = [
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
]


def setup(smoke: bool):
    """Returns (torch, device). Without CUDA only --smoke runs, under the Triton interpreter."""
    import torch

    if torch.cuda.is_available() and not smoke:
        return torch, torch.device("cuda")
    if not smoke:
        sys.exit("needs a CUDA GPU (run with --smoke for an interpreter check of the script)")
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
    return torch, torch.device("cpu")


def device_name(torch, device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu (Triton interpreter: smoke numbers only)"


def lookup(table, name: str):
    for key, value in table:
        if key.lower() in name.lower():
            return value
    return None


def time_ms(torch, device, fn, warmup: int = 5, iters: int = 20) -> float:
    """Median milliseconds per call (CUDA events through triton's do_bench on a GPU)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup * 5, rep=max(iters * 5, 50), return_mode="median"))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def measured_copy_gbps(torch, device, megabytes: int = 2048) -> float | None:
    """Device-to-device copy bandwidth (read + write), a practical ceiling for the roofline."""
    if device.type != "cuda":
        return None
    n = megabytes * (1 << 20) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(torch, device, lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e9


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {path}")
    return path
