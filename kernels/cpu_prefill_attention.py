"""Attention of a mixed batch (prefill chunks and decodes) on CPU, read straight from the paged
cache: flash-style tiles in C (kernels/csrc/prefill_attention.c), built with the system's C
compiler on first use (kernels/native_build.py) and called through ctypes, one call per
layer for the whole batch.

The torch path (reference.py) gathers each sequence's K/V and runs SDPA with an explicit
[G*n, L] mask, one sequence at a time: 29-54 GFLOP/s on one Zen 4 core for prompts of
512-4096 tokens, where this runs at 74-83, about 0.8 of the core's matmul speed on the same
tokens (benchmarks/kernels_cpu_prefill_attention.py). A call's tiles are dealt out over
torch's threads (cpu_parallel.py): on two cores 143 GFLOP/s for a 3000-token prompt, 0.85
of the two cores' matmul. float32 only; head sizes up to 256 (32, 64 and
128 are compiled as constants). `PDPOOL_CPU_PREFILL_KERNEL=0` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from typing import Optional

import torch

from . import cpu_parallel, native_build

MAX_DIM = 256  # the C source's MAX_DIM
DISABLE_ENV = "PDPOOL_CPU_PREFILL_KERNEL"  # "0": always the torch path


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = lib.paged_prefill_attention
    fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, ptr]
    fn.argtypes += [i64, i64, i64, i64, ctypes.c_float, i64, i64, i64, i64]
    fn.restype = None
    lib.paged_prefill_tile_rows.argtypes = []
    lib.paged_prefill_tile_rows.restype = ctypes.c_int64


# Builds the tests run besides this CPU's own: the AVX2 path where AVX-512 is, the plain C.
TEST_BUILDS = {"avx2": "-DAVX2_ONLY", "portable": "-DPORTABLE_ONLY"}


def _library(build: str = "native") -> Optional[ctypes.CDLL]:
    """The built kernel: "native" takes the widest vectors this CPU has (AVX-512, AVX2),
    the TEST_BUILDS a narrower path on the same CPU (for tests)."""
    if build != "native":
        flags = (TEST_BUILDS[build],)
        return native_build.load("prefill_attention", _declare, flags, variant=build)
    return native_build.load("prefill_attention", _declare)


def available() -> bool:
    """Whether the kernel may run here: not disabled, and built (on first call)."""
    return native_build.available(DISABLE_ENV, _library)


def usable_for(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """float32 CPU tensors in the layouts the kernel reads, and built."""
    return (
        q.device.type == "cpu"
        and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and q.stride(2) == 1
        and k_cache.stride() == v_cache.stride()
        and k_cache.stride(3) == 1
        and q.shape[-1] <= MAX_DIM
        and available()
    )


def _validated(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
) -> torch.Tensor:
    """The int32 block tables, after the checks that keep C inside its buffers."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    batch = len(seq_lens)
    tables = block_tables.to(torch.int32).contiguous()
    if len(query_start_loc) != batch + 1 or tables.shape[0] != batch:
        raise ValueError(
            f"{batch} lengths, {len(query_start_loc)} query starts, {tables.shape[0]} tables"
        )
    if query_start_loc[0] != 0 or query_start_loc[-1] != q.shape[0]:
        raise ValueError(f"query starts must run from 0 to {q.shape[0]}")
    for b, seq_len in enumerate(seq_lens):
        q_len = query_start_loc[b + 1] - query_start_loc[b]
        if not 0 <= q_len <= seq_len:
            raise ValueError(f"sequence {b}: {q_len} queries for {seq_len} positions")
    if max(seq_lens, default=0) > tables.shape[1] * block_size:
        raise ValueError(f"a sequence of {max(seq_lens)} tokens outruns its block table")
    if tables.numel():
        lowest, highest = (int(x) for x in torch.aminmax(tables))
        if not 0 <= lowest <= highest < k_cache.shape[0]:
            raise ValueError(f"block ids must be in [0, {k_cache.shape[0]})")
    if dim > MAX_DIM or heads % max(kv_heads, 1):
        raise ValueError(f"head size {dim} (at most {MAX_DIM}), {heads} heads on {kv_heads}")
    return tables


# Fewer tiles than this per thread and handing them out costs more than it saves: a
# thread pool hand-off is ~50 us, a tile of 24 rows over 500 keys of 64 dims ~40 us (48 rows
# with AVX-512: twice that, so the bound errs towards fewer threads there).
MIN_TILES_PER_THREAD = 4


@functools.cache
def _tile_rows(build: str) -> int:
    """The query rows of a tile in `build` (the C source's TILE_ROWS: 48 with AVX-512)."""
    lib = _library(build)
    assert lib is not None
    return int(lib.paged_prefill_tile_rows())


def _parts(
    query_start_loc: list[int],
    heads: int,
    kv_heads: int,
    skip_single: bool,
    threads: Optional[int],
    tile_rows: int,
) -> int:
    """How many threads share a call: `threads` when given (at most one per tile); else
    torch's thread count, but each thread with enough tiles to pay for the hand-off."""
    group = heads // kv_heads
    slice_ = min(group, tile_rows)
    per_tile = tile_rows // slice_
    q_lens = [b - a for a, b in itertools.pairwise(query_start_loc)]
    tiles_per_head = sum(-(-n // per_tile) for n in q_lens if n > 1 or not skip_single)
    tiles = tiles_per_head * -(-group // slice_) * kv_heads
    if threads is not None:
        return max(1, min(threads, tiles))
    return max(1, min(cpu_parallel.kernel_threads(), tiles // MIN_TILES_PER_THREAD))


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    scale: float,
    sliding_window: Optional[int],
    build: str = "native",
    skip_single: bool = False,
    threads: Optional[int] = None,
) -> torch.Tensor:
    """Causal attention of q `[T, H, D]` (sequence b owns rows
    `query_start_loc[b]:query_start_loc[b+1]`, at the last positions of its `seq_lens[b]`)
    over caches `[blocks, block_size, H_kv, D]`; returns `[T, H, D]` float32. Check
    `usable_for` first. `build` picks a narrower build (tests). With `skip_single` the
    rows of one-query sequences are left unwritten, for the decode kernel. The tiles are
    shared out over `threads` threads (default: torch's thread count, when there is enough
    to share)."""
    lib = _library(build)
    assert lib is not None
    tables = _validated(q, k_cache, block_tables, query_start_loc, seq_lens)
    starts = torch.tensor(query_start_loc, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = torch.empty(q.shape, dtype=torch.float32)
    heads, dim = q.shape[1], q.shape[2]
    sb, sp, sh, _ = k_cache.stride()
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    parts = _parts(query_start_loc, heads, kv_heads, skip_single, threads, _tile_rows(build))

    def run_part(part: int) -> None:
        lib.paged_prefill_attention(
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            sb,
            sp,
            sh,
            tables.data_ptr(),
            tables.shape[1],
            starts.data_ptr(),
            lens.data_ptr(),
            len(seq_lens),
            out.data_ptr(),
            heads,
            kv_heads,
            dim,
            block_size,
            scale,
            sliding_window or 0,
            int(skip_single),
            part,
            parts,
        )

    cpu_parallel.run_parts(run_part, parts)
    return out
