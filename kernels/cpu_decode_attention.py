"""Decode attention on CPU read straight from the paged cache: a small C function, built with
the system's C compiler on first use and loaded through ctypes.

The torch path (reference.py) first gathers every sequence's K/V blocks into a workspace and
then runs SDPA over it: K and V cross memory three times. This reads each key and value
once, where it lies, block by block: for each sequence, the scores of every query head
(with AVX2, eight positions at once, their sums reduced together), a softmax per head, then
the weighted sum of the values into output rows that stay in L1 (the head size is a
compile-time constant for 32, 64 and 128; any size up to 256 runs). A block's rows hold all
KV heads side by side, and all heads are done together, so each block is read front to back;
blocks lie anywhere in the cache, so the next block's rows are prefetched while one is read.
A batch with enough key positions is cut into runs of about equal positions, one per torch
thread, run at once (cpu_parallel.py). float32 only.
On the AVX-512 Xeon, 2 threads, 64 decodes of ~1900 positions with 8 query heads on 4 KV
heads of 64 (`python benchmarks/long_prompt_profile.py`): 15.5 GB/s against
11.9 GB/s with one pass per KV head and no prefetch (a 2-thread read of memory: 22 GB/s).

The shared library is built and cached by native_build.py (per source and CPU,
`-march=native`, under $PDPOOL_KERNEL_CACHE, else ~/.cache/pdpool/cpu-kernels); without a
compiler (or if the build fails) `available()` is False and the torch path runs.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import cpu_parallel, native_build
from .native_build import CACHE_ENV  # noqa: F401 (where the libraries are cached)

MAX_DIM = 256  # the C source's MAX_DIM: the head sizes it serves
DISABLE_ENV = "PDPOOL_CPU_DECODE_KERNEL"  # "0": always the torch path


# Compiled with -ffast-math (vectorized expf from libmvec, reassociated sums) but linked
# without it: linking with it would add crtfastmath, which sets flush-to-zero for the whole
# process when the library loads.
_EXTRA_FLAGS = ("-ffast-math",)
_LIBS = ("-lmvec", "-lm")


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.paged_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, i64, ptr, ptr]
    fn.argtypes += [i64, i64, i64, i64, i64, ctypes.c_float, i64, ptr]
    fn.restype = None


def _library() -> Optional[ctypes.CDLL]:
    return native_build.load("decode_attention", _declare, _EXTRA_FLAGS, _LIBS)


def available() -> bool:
    """Whether the kernel may run here: not disabled, and built (on first call)."""
    return native_build.available(DISABLE_ENV, _library)


def usable_for(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """float32 CPU tensors in the layouts the kernel reads, and built."""
    return (
        q.device.type == "cpu"
        and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and k_cache.stride() == v_cache.stride()
        and k_cache.stride(3) == 1
        and q.shape[-1] <= MAX_DIM
        and available()
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    scale: float,
    sliding_window: Optional[int],
    threads: Optional[int] = None,
) -> torch.Tensor:
    """One query per sequence, q `[B, H, D]`, over caches `[blocks, block_size, H_kv, D]`;
    returns `[B, H, D]` float32. Check `usable_for` first. Runs of the batch are shared out
    over `threads` threads (default: torch's thread count) when there is enough to share."""
    lib = _library()
    assert lib is not None
    batch, heads, dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    longest_seq = max(seq_lens, default=0)
    # C reads what it is told to: out-of-range blocks or lengths would read past the cache.
    if longest_seq > tables.shape[1] * block_size:
        raise ValueError(f"a sequence of {longest_seq} tokens outruns its block table")
    if tables.numel():
        lowest, highest = (int(x) for x in torch.aminmax(tables))
        if not 0 <= lowest <= highest < k_cache.shape[0]:
            raise ValueError(f"block ids must be in [0, {k_cache.shape[0]})")
    if len(seq_lens) != batch or tables.shape[0] != batch:
        raise ValueError(f"{batch} queries, {len(seq_lens)} lengths, {tables.shape[0]} tables")
    if dim > MAX_DIM or heads % max(kv_heads, 1):
        raise ValueError(f"head size {dim} (at most {MAX_DIM}), {heads} heads on {kv_heads}")
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = torch.empty_like(q)
    window = sliding_window or 0
    longest = longest_seq if window <= 0 else min(longest_seq, window)
    bounds = _batch_parts(seq_lens, threads)
    scratch = torch.empty(len(bounds) - 1, heads * max(longest, 1), dtype=torch.float32)
    sb, sp, sh, _ = k_cache.stride()

    def run_part(part: int) -> None:
        lo, hi = bounds[part], bounds[part + 1]
        lib.paged_decode_attention(
            q[lo:hi].data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            sb,
            sp,
            sh,
            tables[lo:hi].data_ptr(),
            tables.shape[1],
            lens[lo:hi].data_ptr(),
            out[lo:hi].data_ptr(),
            hi - lo,
            heads,
            kv_heads,
            dim,
            block_size,
            scale,
            window,
            scratch[part].data_ptr(),
        )

    cpu_parallel.run_parts(run_part, len(bounds) - 1)
    return out


# Below this many key positions in the batch one thread does it: ~0.1 us a position against
# ~50 us to hand a part to another thread.
MIN_POSITIONS_TO_SPLIT = 4096
# A batch of this many key positions is a big call (cpu_parallel.kernel_threads): its K and
# V (64 MiB at 4 KV heads of 64) take milliseconds to stream from memory, so it may use the
# cores a decode step otherwise leaves to the server.
BIG_CALL_POSITIONS = 32768


def _batch_parts(seq_lens: list[int], threads: Optional[int]) -> list[int]:
    """Bounds of contiguous runs of the batch with about equal key positions each,
    [0, b1, ..., batch]: `threads` runs when given (at most one per sequence); else one per
    torch thread when the batch has enough positions to share."""
    total = sum(seq_lens)
    if threads is None:
        big = total >= BIG_CALL_POSITIONS
        threads = cpu_parallel.kernel_threads(big) if total >= MIN_POSITIONS_TO_SPLIT else 1
    parts = min(max(1, threads), len(seq_lens))
    bounds, seen = [0], 0
    for b, n in enumerate(seq_lens[:-1]):
        seen += n
        if len(bounds) < parts and seen * parts >= total * len(bounds):
            bounds.append(b + 1)
    bounds.append(len(seq_lens))
    return bounds
