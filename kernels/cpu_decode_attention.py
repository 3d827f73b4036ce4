"""Decode attention on CPU read straight from the paged cache: a small C function, built with
the system's C compiler on first use and loaded through ctypes.

The torch path (reference.py) first gathers every sequence's K/V blocks into a workspace and
then runs SDPA over it: K and V cross memory three times. This reads each key and value
once, where it lies, block by block: for each sequence and KV head, the scores of the query
heads that share it (up to 4 at a time, each key row read from memory once for all; with AVX2,
eight positions at once, their sums reduced together), a softmax per head, then the weighted
sum of the values into output rows held in registers (the head size is a compile-time
constant for 32, 64 and 128; any size up to 256 runs). A batch with enough key positions
is cut into runs of about equal positions, one per torch thread, run at once
(cpu_parallel.py). float32 only.
Measured on one layer, one thread, 34 decodes of 16-384 positions (the mix of
benchmarks/engine_vs_vllm.py): 8 query heads on 4 KV heads of 64, 0.37 ms (shared key
loads, one reduction per dot product: 0.52 ms; one query head per key load: 0.68-0.96 ms);
4 on 2 KV heads of 32, 0.11 ms (0.18; 0.28).

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

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define MAX_DIM 256

/* Sum of a[d] * b[d] in 16 independent lanes: vectorizes without reassociating. */
ALWAYS_INLINE float dot(const float *a, const float *b, int64_t n) {
    float acc[16] = {0};
    int64_t d = 0;
    for (; d + 16 <= n; d += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[d + j] * b[d + j];
    for (int w = 8; w > 0; w >>= 1) /* a tree, not a chain of 16 dependent adds */
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    float s = acc[0];
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DOT8 1
/* q against 8 key rows `stride` floats apart (dim a multiple of 8): lane i of the result is
   the dot product with row i. The 8 lane sums are reduced together by one transposing
   reduction (4 + 2 horizontal adds, 2 permutes, 1 add) instead of a reduction per row. */
ALWAYS_INLINE __m256 dot8(const float *q, const float *k, int64_t stride, int64_t dim) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
           a7 = a0;
    for (int64_t d = 0; d < dim; d += 8) {
        const __m256 x = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + d), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + stride + d), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 2 * stride + d), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 3 * stride + d), a3);
        a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 4 * stride + d), a4);
        a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 5 * stride + d), a5);
        a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 6 * stride + d), a6);
        a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 7 * stride + d), a7);
    }
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    /* u0 = [rows 0-3 over lanes 0-3 | rows 0-3 over lanes 4-7], u1 the same for rows 4-7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

/* Scores -> probabilities, in place (n >= 1; no infinities under fast-math). */
ALWAYS_INLINE void softmax(float *s, int64_t n) {
    float m = s[0], total = 0.0f;
    for (int64_t i = 1; i < n; i++) m = s[i] > m ? s[i] : m;
    for (int64_t i = 0; i < n; i++) {
        s[i] = expf(s[i] - m);
        total += s[i];
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int64_t i = 0; i < n; i++) s[i] *= inv;
}

/* Up to MAX_SHARE query heads that share one KV head, over one sequence: k and v already
   point at the KV head; positions [start, len) through `table`. Each key and value row is
   loaded once for all of them. With `dim` a constant (the callers below), the loops over it
   unroll and the output rows stay in registers while the positions stream by. */
#define MAX_SHARE 4
ALWAYS_INLINE void shared_heads(const float *q, int64_t nq, const float *k, const float *v,
                                int64_t sb, int64_t sp, const int32_t *table,
                                int64_t block_size, int64_t start, int64_t len, int64_t dim,
                                float scale, float *s, float *out) {
    const int64_t n = len - start;
    for (int64_t p = start; p < len;) {
        const int64_t block = p / block_size, end = (block + 1) * block_size;
        const float *kb = k + table[block] * sb;
#ifdef DOT8
        if (dim % 8 == 0) /* eight positions at a time while the block has them */
            for (; p + 8 <= end && p + 8 <= len; p += 8) {
                const float *kp = kb + (p - block * block_size) * sp;
                for (int64_t g = 0; g < nq; g++)
                    _mm256_storeu_ps(s + g * n + p - start,
                                     _mm256_mul_ps(dot8(q + g * dim, kp, sp, dim),
                                                   _mm256_set1_ps(scale)));
            }
#endif
        for (; p < end && p < len; p++) {
            const float *kp = kb + (p - block * block_size) * sp;
            for (int64_t g = 0; g < nq; g++)
                s[g * n + p - start] = dot(q + g * dim, kp, dim) * scale;
        }
    }
    for (int64_t g = 0; g < nq; g++) softmax(s + g * n, n);
    float o[MAX_SHARE][MAX_DIM];
    for (int64_t g = 0; g < nq; g++)
        for (int64_t d = 0; d < dim; d++) o[g][d] = 0.0f;
    for (int64_t p = start; p < len;) {
        const int64_t block = p / block_size, end = (block + 1) * block_size;
        const float *vb = v + table[block] * sb;
        for (; p < end && p < len; p++) {
            const float *vp = vb + (p - block * block_size) * sp;
            for (int64_t g = 0; g < nq; g++) {
                const float w = s[g * n + p - start];
                for (int64_t d = 0; d < dim; d++) o[g][d] += w * vp[d];
            }
        }
    }
    for (int64_t g = 0; g < nq; g++) memcpy(out + g * dim, o[g], dim * sizeof(float));
}

#define SHARED_HEADS_OF(D)                                                                   \
    static void shared_heads_##D(const float *q, int64_t nq, const float *k, const float *v, \
                                 int64_t sb, int64_t sp, const int32_t *t, int64_t bs,       \
                                 int64_t a, int64_t l, float sc, float *s, float *o) {       \
        shared_heads(q, nq, k, v, sb, sp, t, bs, a, l, D, sc, s, o);                         \
    }
SHARED_HEADS_OF(32)
SHARED_HEADS_OF(64)
SHARED_HEADS_OF(128)

/* q, out [B, H, D] contiguous; k, v [blocks, block_size, Hkv, D] with strides (in floats)
   sb, sp, sh and unit stride over D; tables [B, W] int32; seq_lens [B] int32;
   scratch >= H * max(seq_lens) floats; D <= MAX_DIM; window <= 0: none. */
void paged_decode_attention(const float *q, const float *k, const float *v,
                            int64_t sb, int64_t sp, int64_t sh, const int32_t *tables,
                            int64_t table_width, const int32_t *seq_lens, float *out,
                            int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                            int64_t block_size, float scale, int64_t window, float *scratch) {
    const int64_t group = heads / kv_heads;
    if (dim > MAX_DIM) return; /* refused by the caller; never write past o[] */
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = seq_lens[b];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        const int32_t *table = tables + b * table_width;
        for (int64_t h = 0, nq; h < heads; h += nq) {
            /* the query heads [h, h + nq) share KV head h / group */
            const int64_t in_group = group - h % group;
            nq = in_group < MAX_SHARE ? in_group : MAX_SHARE;
            const float *qh = q + (b * heads + h) * dim;
            float *oh = out + (b * heads + h) * dim;
            const float *kh = k + (h / group) * sh, *vh = v + (h / group) * sh;
            if (len - start <= 0)
                memset(oh, 0, nq * dim * sizeof(float));
            else if (dim == 64)
                shared_heads_64(qh, nq, kh, vh, sb, sp, table, block_size, start, len, scale,
                                scratch, oh);
            else if (dim == 128)
                shared_heads_128(qh, nq, kh, vh, sb, sp, table, block_size, start, len, scale,
                                 scratch, oh);
            else if (dim == 32)
                shared_heads_32(qh, nq, kh, vh, sb, sp, table, block_size, start, len, scale,
                                scratch, oh);
            else
                shared_heads(qh, nq, kh, vh, sb, sp, table, block_size, start, len, dim, scale,
                             scratch, oh);
        }
    }
}
"""

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
    return native_build.load("decode_attention", _SOURCE, _declare, _EXTRA_FLAGS, _LIBS)


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
