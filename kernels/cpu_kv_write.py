"""The CPU scatter of new K/V rows into the paged caches (kernels/csrc/kv_write.c), for
float32 tensors; built on first use by kernels/native_build.py. Where it cannot be built, or
with PDPOOL_CPU_KV_WRITE_KERNEL=0, `usable` is False and ops.write_kv keeps the torch path.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import native_build

DISABLE_ENV = "PDPOOL_CPU_KV_WRITE_KERNEL"  # "0": always the torch path


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.write_kv_rows.argtypes = [ptr, ptr] + [i64] * 5 + [ptr, ptr] + [i64] * 4
    lib.write_kv_rows.argtypes += [ptr, i64, i64]
    lib.write_kv_rows.restype = None


def _library() -> Optional[ctypes.CDLL]:
    return native_build.load("kv_write", _declare)


def usable(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """float32 on CPU, head_dim contiguous everywhere, k and v laid out alike, and built."""
    tensors = (k, v, k_cache, v_cache)
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        and all(t.stride(-1) == 1 for t in tensors)
        and k.stride() == v.stride()
        and k_cache.stride() == v_cache.stride()
        and native_build.available(DISABLE_ENV, _library)
    )


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v `[T, H_kv, D]` into the caches `[blocks, block_size, H_kv, D]` at
    `slot_mapping[T]` (slot -1 skipped). The caller (ops.write_kv) checked the shapes;
    slots past the cache are refused here, before any write."""
    blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    slots = slot_mapping.to(torch.int64).contiguous()
    tokens, kv_heads, head_dim = k.shape
    if tokens and int(slots.max()) >= blocks * block_size:
        raise IndexError(f"slot_mapping points past the cache's {blocks * block_size} slots")
    lib = _library()
    assert lib is not None
    sb, sp, sh, _ = k_cache.stride()
    lib.write_kv_rows(  # on the calling thread: a copy of a few MB at most
        k.data_ptr(),
        v.data_ptr(),
        tokens,
        k.stride(0),
        k.stride(1),
        kv_heads,
        head_dim,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        sb,
        sp,
        sh,
        block_size,
        slots.data_ptr(),
        0,
        1,
    )
