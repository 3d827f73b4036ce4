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

/* The cache lines of `floats` floats from `row`, requested ahead of their use into L2 (not
   L1: a core has few L1 fill buffers, and requests to L2 keep more lines in flight; 18 ->
   21 GB/s over 64 sequences of 2000 positions on two cores). */
ALWAYS_INLINE void prefetch(const float *row, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(row + i, 0, 2);
}

/* Every query head of one sequence, over positions [start, len) through `table`; k and v
   point at the cache, `sh` floats between KV heads. Query head h reads KV head h / group.
   A block's rows hold every KV head side by side, so each block's keys (then values) are
   read front to back for all heads at once: memory streams the block in order, where a
   pass per KV head would read a quarter of every row, strided. `out` rows (heads x dim,
   a few KiB) stay in L1 while the positions go by; with `dim` a constant (the callers
   below) the loops over it unroll. */
ALWAYS_INLINE void sequence_heads(const float *q, int64_t heads, int64_t group, const float *k,
                                  const float *v, int64_t sb, int64_t sp, int64_t sh,
                                  const int32_t *table, int64_t block_size, int64_t start,
                                  int64_t len, int64_t dim, float scale, float *s, float *out) {
    const int64_t n = len - start, row = (heads / group - 1) * sh + dim;
    for (int64_t p = start; p < len;) {
        const int64_t block = p / block_size, end = (block + 1) * block_size;
        const int64_t stop = end < len ? end : len;
        const float *kb = k + table[block] * sb;
        /* Blocks lie anywhere: the next one is fetched while this one is read, row by row. */
        const float *next = end < len ? k + table[block + 1] * sb : NULL;
#ifdef DOT8
        if (dim % 8 == 0) /* eight positions at a time while the block has them */
            for (; p + 8 <= stop; p += 8) {
                const float *kp = kb + (p - block * block_size) * sp;
                if (next)
                    for (int64_t r = 0; r < 8; r++)
                        prefetch(next + (p - block * block_size + r) * sp, row);
                for (int64_t h = 0; h < heads; h++)
                    _mm256_storeu_ps(s + h * n + p - start,
                                     _mm256_mul_ps(dot8(q + h * dim, kp + (h / group) * sh,
                                                        sp, dim),
                                                   _mm256_set1_ps(scale)));
            }
#endif
        for (; p < stop; p++) {
            const float *kp = kb + (p - block * block_size) * sp;
            if (next) prefetch(next + (p - block * block_size) * sp, row);
            for (int64_t h = 0; h < heads; h++)
                s[h * n + p - start] = dot(q + h * dim, kp + (h / group) * sh, dim) * scale;
        }
    }
    for (int64_t h = 0; h < heads; h++) softmax(s + h * n, n);
    memset(out, 0, heads * dim * sizeof(float));
    for (int64_t p = start; p < len;) {
        const int64_t block = p / block_size, end = (block + 1) * block_size;
        const float *vb = v + table[block] * sb;
        const float *next = end < len ? v + table[block + 1] * sb : NULL;
        for (; p < end && p < len; p++) {
            const float *vp = vb + (p - block * block_size) * sp;
            if (next) prefetch(next + (p - block * block_size) * sp, row);
            for (int64_t h = 0; h < heads; h++) {
                const float w = s[h * n + p - start], *vh = vp + (h / group) * sh;
                float *o = out + h * dim;
                for (int64_t d = 0; d < dim; d++) o[d] += w * vh[d];
            }
        }
    }
}

#define SEQUENCE_HEADS_OF(D)                                                                 \
    static void sequence_heads_##D(const float *q, int64_t nh, int64_t g, const float *k,    \
                                   const float *v, int64_t sb, int64_t sp, int64_t sh,       \
                                   const int32_t *t, int64_t bs, int64_t a, int64_t l,       \
                                   float sc, float *s, float *o) {                           \
        sequence_heads(q, nh, g, k, v, sb, sp, sh, t, bs, a, l, D, sc, s, o);                \
    }
SEQUENCE_HEADS_OF(32)
SEQUENCE_HEADS_OF(64)
SEQUENCE_HEADS_OF(128)

/* q, out [B, H, D] contiguous; k, v [blocks, block_size, Hkv, D] with strides (in floats)
   sb, sp, sh and unit stride over D; tables [B, W] int32; seq_lens [B] int32;
   scratch >= H * max(seq_lens) floats; D <= MAX_DIM; window <= 0: none. */
void paged_decode_attention(const float *q, const float *k, const float *v,
                            int64_t sb, int64_t sp, int64_t sh, const int32_t *tables,
                            int64_t table_width, const int32_t *seq_lens, float *out,
                            int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                            int64_t block_size, float scale, int64_t window, float *scratch) {
    const int64_t group = heads / kv_heads;
    if (dim > MAX_DIM) return; /* refused by the caller */
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = seq_lens[b];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        const int32_t *table = tables + b * table_width;
        const float *qb = q + b * heads * dim;
        float *ob = out + b * heads * dim;
        if (len - start <= 0)
            memset(ob, 0, heads * dim * sizeof(float));
        else if (dim == 64)
            sequence_heads_64(qb, heads, group, k, v, sb, sp, sh, table, block_size, start, len,
                              scale, scratch, ob);
        else if (dim == 128)
            sequence_heads_128(qb, heads, group, k, v, sb, sp, sh, table, block_size, start,
                               len, scale, scratch, ob);
        else if (dim == 32)
            sequence_heads_32(qb, heads, group, k, v, sb, sp, sh, table, block_size, start, len,
                              scale, scratch, ob);
        else
            sequence_heads(qb, heads, group, k, v, sb, sp, sh, table, block_size, start, len,
                           dim, scale, scratch, ob);
    }
}
