"""RMSNorm and the neox rotary embedding as one pass per row on CPU (kernels/csrc/norm_rope.c),
for float32 tensors. Built on first use by kernels/native_build.py; where it cannot be built,
or with PDPOOL_CPU_NORM_KERNEL=0, `usable` is False and the model keeps its torch path.

A call runs on the calling thread: these passes are memory-bound and take well under a
millisecond at prompt-sized steps, less than handing rows to another thread while torch's
OpenMP workers still spin on the cores.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import native_build

DISABLE_ENV = "PDPOOL_CPU_NORM_KERNEL"  # "0": always the torch path
# Flags of the build: `omp simd` pragmas without the OpenMP runtime (torch brings its own),
# and no fused multiply-adds where torch rounds twice.
BUILD_FLAGS = ("-fopenmp-simd", "-ffp-contract=off")


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.rms_norm_rows.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, f32, i64, i64]
    lib.rms_norm_rows.restype = None
    lib.norm_rope_heads.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, f32, ptr, ptr, ptr]
    lib.norm_rope_heads.argtypes += [i64, i64, i64, i64]
    lib.norm_rope_heads.restype = None


def _library() -> Optional[ctypes.CDLL]:
    return native_build.load("norm_rope", _declare, BUILD_FLAGS)


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernel may run on these tensors: float32 on CPU, and built here."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and (
        native_build.available(DISABLE_ENV, _library)
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) * weight, a new tensor of x's shape. Check `usable`."""
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"weight must be [{dim}], got {tuple(weight.shape)}")
    rows_in = x.reshape(-1, dim)
    if rows_in.stride(-1) != 1:
        rows_in = rows_in.contiguous()
    w = weight.contiguous()
    out = torch.empty(rows_in.shape, dtype=torch.float32)
    rows = rows_in.shape[0]
    lib = _library()
    assert lib is not None
    lib.rms_norm_rows(
        rows_in.data_ptr(),
        rows_in.stride(0),
        out.data_ptr(),
        dim,
        w.data_ptr(),
        rows,
        dim,
        eps,
        0,
        1,
    )
    return out.view(x.shape)


def norm_rope_(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int,
) -> torch.Tensor:
    """In place on x `[T, heads, head_dim]` (head_dim contiguous): each head RMS-normalised
    with `weight` (skipped when None), then its first `rotary_dim` values rotated neox style
    at `positions[T]` with the `[max_positions, rotary_dim]` cos/sin tables. Returns x."""
    tokens, heads, head_dim = x.shape
    if x.stride(-1) != 1:
        raise ValueError("norm_rope_: head_dim must be contiguous")
    if weight is not None and weight.shape != (head_dim,):
        raise ValueError(f"weight must be [{head_dim}], got {tuple(weight.shape)}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim or cos.shape[-1] != rotary_dim:
        raise ValueError(f"rotary_dim {rotary_dim} does not fit head_dim {head_dim}")
    if positions.shape != (tokens,):
        raise ValueError(f"positions must be [{tokens}], got {tuple(positions.shape)}")
    pos = positions.to(torch.int64).contiguous()
    if tokens and (int(pos.min()) < 0 or int(pos.max()) >= cos.shape[0]):
        raise ValueError(f"positions must lie in [0, {cos.shape[0]})")
    w = weight.contiguous() if weight is not None else None
    cos_t, sin_t = cos.contiguous(), sin.contiguous()
    lib = _library()
    assert lib is not None
    lib.norm_rope_heads(
        x.data_ptr(),
        tokens,
        heads,
        x.stride(0),
        x.stride(1),
        head_dim,
        w.data_ptr() if w is not None else None,
        eps,
        pos.data_ptr(),
        cos_t.data_ptr(),
        sin_t.data_ptr(),
        rotary_dim,
        rotary_dim,
        0,
        1,
    )
    return x
