/* CPU prefill attention over the paged cache (kernels/cpu_prefill_attention.py builds
 * and calls it).
 *
 * The layout that makes it run at matmul speed: a tile holds up to 3 vectors of query rows
 * (48 with AVX-512's 16 lanes, 24 with AVX2's 8; a row is a token and one query head of a KV
 * head's group) of one sequence, and the rows lie on the vector lanes. Q is packed once per
 * tile, transposed and pre-scaled, `qt[d][row]`. Then for every chunk of 48 key positions:
 *   scores   st[key][row] = sum_d K[key][d] * qt[d][row]: a register-blocked matmul (ACCS
 *            accumulators, 24 zmm or 12 ymm: ACCS / v keys x v row vectors), each key element
 *            broadcast where it lies (no transpose of K): in the cache, through the block
 *            table, or in a copy of the KV head's rows one after another, which a call with
 *            three or more tiles of a KV head makes first (see rows_together);
 *   softmax  online, per row, all of it lane-wise (no horizontal reductions): running max m,
 *            sum l, rescale alpha = 2^(m_old - m_new); exp2 is a polynomial on the lanes;
 *   values   ot[d][row] = ot[d][row] * alpha[row] + sum_key V[key][d] * p[key][row]: the
 *            same register blocking (ACCS / 3 dims x 3 row vectors), V broadcast in place.
 * Each K/V row is read once per tile for all its rows (all query heads of the group). Key
 * chunks past a tile's last position (causal) or before its window are never read; only the
 * chunks that cross the diagonal or the window edge are masked. A masked score is a large
 * negative finite number, so a row that has seen only masked keys never computes inf - inf.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
/* PORTABLE_ONLY: the tests build the portable path on a vector machine too; AVX2_ONLY: the
   AVX2 path on an AVX-512 machine */
#if defined(__AVX512F__) && defined(__FMA__) && !defined(PORTABLE_ONLY) && !defined(AVX2_ONLY)
#define HAVE_AVX512 1
#define LANES 16                      /* query rows per vector */
#elif defined(__AVX2__) && defined(__FMA__) && !defined(PORTABLE_ONLY)
#define HAVE_AVX2 1
#define LANES 8
#else
#define LANES 8
#endif
#define MAX_VECS 3                    /* row vectors per tile */
#define TILE_ROWS (LANES * MAX_VECS)  /* 48 with AVX-512, else 24 */
#define CHUNK 48                      /* keys per softmax step: a multiple of every KEY_STEP */
#define ALIGNED __attribute__((aligned(64)))
#define MAX_DIM 256
#define MASKED (-1.0e30f)             /* the score of a key a row may not see */
#define LOG2E 1.4426950408889634f

typedef struct {
    const float *k, *v;       /* this KV head's caches */
    int64_t sb, sp;           /* strides (floats) of a block and a position */
    const int32_t *table;     /* this sequence's block table */
    int64_t block_size, window, dim;
} Keys;

ALWAYS_INLINE const float *key_row(const Keys *ks, const float *base, int64_t pos) {
    return base + ks->table[pos / ks->block_size] * ks->sb + (pos % ks->block_size) * ks->sp;
}

/* ---------------------------------------------------------------- exp2 on lanes */
/* 2^x for x <= 0: 2^round(x) from the exponent bits times 2^f, f = x - round(x) in
   [-1/2, 1/2], by a degree-6 polynomial fitted to 2^f's relative error (1.9e-9; ~1e-7 as
   evaluated in float). The scores are already in base 2, so f needs no scaling by ln 2, and
   the polynomial is one FMA shorter than e^r's Taylor series to the same accuracy: with a
   head size of 64 the exponentials cost half as much as the score product, so each
   operation in them counts. Below -126 the result is 0 (a masked key's weight is exactly
   zero, and no denormal reaches the sums). */
#define EXP_C1 0.6931471824645996f
#define EXP_C2 0.24022646248340607f
#define EXP_C3 0.05550328642129898f
#define EXP_C4 0.009618489071726799f
#define EXP_C5 0.0013399930903688073f
#define EXP_C6 0.00015345810970757157f

ALWAYS_INLINE float exp2_scalar(float x) {
    if (x < -126.0f) return 0.0f;
    const float n = __builtin_roundf(x), f = x - n;
    float p = EXP_C6;
    p = p * f + EXP_C5; p = p * f + EXP_C4; p = p * f + EXP_C3; p = p * f + EXP_C2;
    p = p * f + EXP_C1; p = p * f + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#if defined(HAVE_AVX512) || defined(HAVE_AVX2)
#include <immintrin.h>
#define HAVE_VECTORS 1
/* Keeps a loaded vector in a register: without it GCC folds the load into every FMA that
   uses it (one load per FMA instead of one per row vector, and the loop waits on loads). */
#define PIN(x) __asm__("" : "+v"(x))
/* The operations on `vec`, named by width: V(fmadd) is _mm512_fmadd_ps or _mm256_fmadd_ps. */
#ifdef HAVE_AVX512
/* Accumulators of a register tile: 24 of the 32 zmm registers, the rest hold the row
   vectors and a broadcast. */
#define ACCS 24
#define WIDTH 512
typedef __m512 vec;
typedef __m512i ivec;
#define V_BCAST(p) _mm512_set1_ps(*(p))
#define V_ROUND(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* y where x >= limit, else 0 */
#define V_WHERE_GE(x, limit, y) _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, limit, _CMP_GE_OQ), y)
#else
/* 12 of the 16 ymm registers. (24 of the 32 that AVX-512VL gives measured no faster on
   Zen 4 at 8 lanes; an Intel core with 512-bit FMA units takes the path above.) */
#define ACCS 12
#define WIDTH 256
typedef __m256 vec;
typedef __m256i ivec;
#define V_BCAST(p) _mm256_broadcast_ss(p)
#define V_ROUND(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define V_WHERE_GE(x, limit, y) _mm256_and_ps(_mm256_cmp_ps(x, limit, _CMP_GE_OQ), y)
#endif
#define JOIN3(a, b, c) a##b##c
#define NAMED(w, op) JOIN3(_mm, w, op)
#define V(op) NAMED(WIDTH, _##op##_ps)
#define VI(op) NAMED(WIDTH, _##op##_epi32)
#define V_LOAD V(load)
#define V_STORE V(store)
#define V_ZERO V(setzero)
#define V_SET1 V(set1)
#define V_FMA V(fmadd)
#define V_MUL V(mul)
#define V_ADD V(add)
#define V_SUB V(sub)
#define V_MAX V(max)

/* 2^f on lanes for f in [-1/2, 1/2], as exp2_scalar */
ALWAYS_INLINE vec v_exp2_fraction(vec f) {
    vec p = V_SET1(EXP_C6);
    p = V_FMA(p, f, V_SET1(EXP_C5));
    p = V_FMA(p, f, V_SET1(EXP_C4));
    p = V_FMA(p, f, V_SET1(EXP_C3));
    p = V_FMA(p, f, V_SET1(EXP_C2));
    p = V_FMA(p, f, V_SET1(EXP_C1));
    return V_FMA(p, f, V_SET1(1.0f));
}

/* exp2 on lanes, as exp2_scalar */
#ifdef HAVE_AVX512
/* vscalefps multiplies by 2^n in one operation; the mask zeroes what lies below -126 */
ALWAYS_INLINE vec v_exp2(vec x) {
    const vec n = V_ROUND(x);
    return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, V_SET1(-126.0f), _CMP_GE_OQ),
                                  v_exp2_fraction(V_SUB(x, n)), n);
}
#else
/* 2^n for whole numbers n in [-126, 127], by the exponent bits */
ALWAYS_INLINE vec v_pow2i(vec n) {
    const ivec bits = VI(slli)(VI(add)(NAMED(WIDTH, _cvtps_epi32)(n), VI(set1)(127)), 23);
    return (vec)bits;
}

ALWAYS_INLINE vec v_exp2(vec x) {
    const vec lowest = V_SET1(-126.0f), kept = V_MAX(x, lowest), n = V_ROUND(kept);
    return V_WHERE_GE(x, lowest, V_MUL(v_exp2_fraction(V_SUB(kept, n)), v_pow2i(n)));
}
#endif

/* m where a row has seen an unmasked key, else 0 */
ALWAYS_INLINE vec v_seen(vec m) { return V_WHERE_GE(m, V_SET1(0.5f * MASKED), m); }
#define VALUE_DIMS (ACCS / 3) /* dims per register tile of the value product */

/* st[key][row] for `n` keys (a multiple of ACCS / nv) at rows[0..n): ACCS / nv keys x nv row
   vectors of accumulators, one broadcast per key element, one load per row vector. */
ALWAYS_INLINE void scores_vec(const float *qt, const float *const *rows, int64_t n, int nv,
                              int64_t dim, float *st) {
    const int kb = ACCS / nv;
    for (int64_t n0 = 0; n0 < n; n0 += kb) {
        vec acc[ACCS][MAX_VECS];
#pragma GCC unroll 24
        for (int i = 0; i < kb; i++)
#pragma GCC unroll 3
            for (int j = 0; j < nv; j++) acc[i][j] = V_ZERO();
        for (int64_t d = 0; d < dim; d++) {
            vec qv[MAX_VECS];
#pragma GCC unroll 3
            for (int j = 0; j < nv; j++) {
                qv[j] = V_LOAD(qt + d * TILE_ROWS + j * LANES);
                PIN(qv[j]);
            }
#pragma GCC unroll 24
            for (int i = 0; i < kb; i++) {
                const vec kv = V_BCAST(rows[n0 + i] + d);
#pragma GCC unroll 3
                for (int j = 0; j < nv; j++) acc[i][j] = V_FMA(kv, qv[j], acc[i][j]);
            }
        }
#pragma GCC unroll 24
        for (int i = 0; i < kb; i++)
#pragma GCC unroll 3
            for (int j = 0; j < nv; j++)
                V_STORE(st + (n0 + i) * TILE_ROWS + j * LANES, acc[i][j]);
    }
}

/* ot[d][row] = ot[d][row] * alpha[row] + sum_key V[key][d] * st[key][row], VALUE_DIMS dims x
   nv row vectors at a time (dims past a multiple of it one at a time). */
ALWAYS_INLINE void values_vec(float *ot, const float *alpha, const float *const *rows,
                              int64_t n, int nv, int64_t dim, const float *st) {
    vec a[MAX_VECS];
#pragma GCC unroll 3
    for (int j = 0; j < nv; j++) a[j] = V_LOAD(alpha + j * LANES);
    int64_t d0 = 0;
    for (; d0 + VALUE_DIMS <= dim; d0 += VALUE_DIMS) {
        vec acc[VALUE_DIMS][MAX_VECS];
#pragma GCC unroll 8
        for (int i = 0; i < VALUE_DIMS; i++)
#pragma GCC unroll 3
            for (int j = 0; j < nv; j++)
                acc[i][j] = V_MUL(V_LOAD(ot + (d0 + i) * TILE_ROWS + j * LANES), a[j]);
        for (int64_t key = 0; key < n; key++) {
            vec p[MAX_VECS];
#pragma GCC unroll 3
            for (int j = 0; j < nv; j++) {
                p[j] = V_LOAD(st + key * TILE_ROWS + j * LANES);
                PIN(p[j]);
            }
            const float *vr = rows[key] + d0;
#pragma GCC unroll 8
            for (int i = 0; i < VALUE_DIMS; i++) {
                const vec vv = V_BCAST(vr + i);
#pragma GCC unroll 3
                for (int j = 0; j < nv; j++) acc[i][j] = V_FMA(vv, p[j], acc[i][j]);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < VALUE_DIMS; i++)
#pragma GCC unroll 3
            for (int j = 0; j < nv; j++)
                V_STORE(ot + (d0 + i) * TILE_ROWS + j * LANES, acc[i][j]);
    }
    for (; d0 < dim; d0++)
        for (int j = 0; j < nv; j++) {
            vec acc = V_MUL(V_LOAD(ot + d0 * TILE_ROWS + j * LANES), a[j]);
            for (int64_t key = 0; key < n; key++)
                acc = V_FMA(V_BCAST(rows[key] + d0), V_LOAD(st + key * TILE_ROWS + j * LANES),
                            acc);
            V_STORE(ot + d0 * TILE_ROWS + j * LANES, acc);
        }
}

/* Online softmax over one chunk's scores, lane-wise: updates m and l, writes alpha (the
   rescale of what was summed before) and turns st into probabilities. */
ALWAYS_INLINE void softmax_vec(float *st, int64_t n, int nv, float *m, float *l,
                               float *alpha) {
    for (int j = 0; j < nv; j++) {
        const vec m_old = V_LOAD(m + j * LANES);
        vec m_new = m_old;
        for (int64_t key = 0; key < n; key++)
            m_new = V_MAX(m_new, V_LOAD(st + key * TILE_ROWS + j * LANES));
        /* a row that has seen only masked keys subtracts 0: its p stays 0, never 1 */
        const vec ref = v_seen(m_new);
        vec sum = V_ZERO();
        for (int64_t key = 0; key < n; key++) {
            float *s = st + key * TILE_ROWS + j * LANES;
            const vec p = v_exp2(V_SUB(V_LOAD(s), ref));
            V_STORE(s, p);
            sum = V_ADD(sum, p);
        }
        const vec a = v_exp2(V_SUB(m_old, ref));
        V_STORE(alpha + j * LANES, a);
        V_STORE(l + j * LANES, V_FMA(V_LOAD(l + j * LANES), a, sum));
        V_STORE(m + j * LANES, m_new);
    }
}
#endif

/* ---------------------------------------------------------------- portable versions */
ALWAYS_INLINE void scores_portable(const float *qt, const float *const *rows, int64_t n,
                                   int nv, int64_t dim, float *st) {
    const int width = nv * LANES;
    for (int64_t key = 0; key < n; key++) {
        float acc[TILE_ROWS] = {0};
        for (int64_t d = 0; d < dim; d++) {
            const float kd = rows[key][d];
            for (int r = 0; r < width; r++) acc[r] += kd * qt[d * TILE_ROWS + r];
        }
        memcpy(st + key * TILE_ROWS, acc, width * sizeof(float));
    }
}

ALWAYS_INLINE void values_portable(float *ot, const float *alpha, const float *const *rows,
                                   int64_t n, int nv, int64_t dim, const float *st) {
    const int width = nv * LANES;
    for (int64_t d = 0; d < dim; d++) {
        float acc[TILE_ROWS];
        for (int r = 0; r < width; r++) acc[r] = ot[d * TILE_ROWS + r] * alpha[r];
        for (int64_t key = 0; key < n; key++) {
            const float vd = rows[key][d];
            for (int r = 0; r < width; r++) acc[r] += vd * st[key * TILE_ROWS + r];
        }
        memcpy(ot + d * TILE_ROWS, acc, width * sizeof(float));
    }
}

ALWAYS_INLINE void softmax_portable(float *st, int64_t n, int nv, float *m, float *l,
                                    float *alpha) {
    for (int r = 0; r < nv * LANES; r++) {
        float m_new = m[r], sum = 0.0f;
        for (int64_t key = 0; key < n; key++) {
            const float s = st[key * TILE_ROWS + r];
            m_new = s > m_new ? s : m_new;
        }
        const float ref = m_new < 0.5f * MASKED ? 0.0f : m_new;
        for (int64_t key = 0; key < n; key++) {
            float *s = st + key * TILE_ROWS + r;
            *s = exp2_scalar(*s - ref);
            sum += *s;
        }
        alpha[r] = exp2_scalar(m[r] - ref);
        l[r] = l[r] * alpha[r] + sum;
        m[r] = m_new;
    }
}

#ifdef HAVE_VECTORS
#define KEY_STEP(nv) (ACCS / (nv)) /* the score product takes keys this many at a time */
#define SCORES scores_vec
#define VALUES values_vec
#define SOFTMAX softmax_vec
#else
#define KEY_STEP(nv) 1
#define SCORES scores_portable
#define VALUES values_portable
#define SOFTMAX softmax_portable
#endif

/* ---------------------------------------------------------------- one tile */
typedef struct {
    const float *q;           /* the tile's first token, first query head */
    int64_t sq_t, sq_h;       /* q strides (floats) of a token and a head */
    float *out;               /* the same place in out [T, H, D] */
    int64_t so_t, so_h;
    int64_t first_pos;        /* the position of the tile's first token */
    int64_t tokens, heads;    /* rows = tokens x heads, token-major */
    float qscale;             /* softmax scale x log2(e): scores in base 2 */
} Tile;

static const float zero_row[MAX_DIM];

ALWAYS_INLINE void run_tile(const Tile *t, const Keys *ks, int nv, int64_t dim) {
    float qt[MAX_DIM * TILE_ROWS] ALIGNED;
    float ot[MAX_DIM * TILE_ROWS] ALIGNED;
    float st[CHUNK * TILE_ROWS] ALIGNED;
    float m[TILE_ROWS] ALIGNED, l[TILE_ROWS] ALIGNED;
    float alpha[TILE_ROWS] ALIGNED;
    float pos[TILE_ROWS]; /* each row's position (exact in float below 2^24) */
    const float *krows[CHUNK], *vrows[CHUNK];
    const int width = nv * LANES, rows = (int)(t->tokens * t->heads), kb = KEY_STEP(nv);
    const int64_t last_pos = t->first_pos + t->tokens - 1, window = ks->window;

    /* pack Q transposed and scaled; padding rows repeat the last row (their output is
       dropped, and they must not turn into NaN on the way) */
    for (int r = 0; r < width; r++) {
        const int rr = r < rows ? r : rows - 1;
        const int64_t tok = rr / t->heads, h = rr % t->heads;
        const float *qr = t->q + tok * t->sq_t + h * t->sq_h;
        for (int64_t d = 0; d < dim; d++) qt[d * TILE_ROWS + r] = qr[d] * t->qscale;
        pos[r] = (float)(t->first_pos + tok);
        m[r] = MASKED;
        l[r] = 0.0f;
    }
    memset(ot, 0, sizeof(float) * dim * TILE_ROWS);

    /* keys [lo, hi): what the rows see together */
    const int64_t hi = last_pos + 1;
    int64_t lo = 0;
    if (window > 0 && t->first_pos - window + 1 > 0) lo = t->first_pos - window + 1;
    for (int64_t c0 = lo; c0 < hi; c0 += CHUNK) {
        const int64_t count = hi - c0 < CHUNK ? hi - c0 : CHUNK;
        const int64_t n = (count + kb - 1) / kb * kb; /* padded: zero rows, masked */
        for (int64_t i = 0; i < n; i++) {
            krows[i] = i < count ? key_row(ks, ks->k, c0 + i) : zero_row;
            vrows[i] = i < count ? key_row(ks, ks->v, c0 + i) : zero_row;
        }
        SCORES(qt, krows, n, nv, dim, st);
        /* masks only where a row may not see a key of the chunk */
        const int crosses_diagonal = c0 + n - 1 > t->first_pos;
        const int crosses_window = window > 0 && c0 <= last_pos - window;
        if (crosses_diagonal || crosses_window)
            for (int64_t i = 0; i < n; i++) {
                const float kp = (float)(c0 + i);
                for (int r = 0; r < width; r++) {
                    const int hidden = kp > pos[r] || (window > 0 && pos[r] - kp >= window);
                    if (hidden) st[i * TILE_ROWS + r] = MASKED;
                }
            }
        SOFTMAX(st, n, nv, m, l, alpha);
        VALUES(ot, alpha, vrows, n, nv, dim, st);
    }

    for (int r = 0; r < rows; r++) {
        const int64_t tok = r / t->heads, h = r % t->heads;
        float *o = t->out + tok * t->so_t + h * t->so_h;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int64_t d = 0; d < dim; d++) o[d] = ot[d * TILE_ROWS + r] * inv;
    }
}

/* Instances with the row vectors and the head size known to the compiler. */
#define TILE_OF(NV, D)                                                                       \
    static void tile_##NV##_##D(const Tile *t, const Keys *ks) { run_tile(t, ks, NV, D); }
#define TILES_OF(D) TILE_OF(1, D) TILE_OF(2, D) TILE_OF(3, D)
TILES_OF(32)
TILES_OF(64)
TILES_OF(128)
#define TILE_ANY(NV)                                                                         \
    static void tile_##NV##_any(const Tile *t, const Keys *ks) {                             \
        run_tile(t, ks, NV, ks->dim);                                                        \
    }
TILE_ANY(1)
TILE_ANY(2)
TILE_ANY(3)

static void tile(const Tile *t, const Keys *ks) {
    const int nv = (int)((t->tokens * t->heads + LANES - 1) / LANES);
#define PICK(D)                                                                              \
    (nv == 1 ? tile_1_##D : nv == 2 ? tile_2_##D : tile_3_##D)
    void (*fn)(const Tile *, const Keys *) = ks->dim == 64    ? PICK(64)
                                             : ks->dim == 128 ? PICK(128)
                                             : ks->dim == 32  ? PICK(32)
                                                              : PICK(any);
#undef PICK
    fn(t, ks);
}

/* ---------------------------------------------------------------- the batch */
#define TOGETHER_MAX_KEYS 8192
#define TOGETHER_MIN_TILES 3 /* the copy costs about a third of one tile over the same keys */
static const int32_t first_block = 0;

typedef struct {
    float *buf;
    int64_t floats;
} Scratch;

/* One KV head's K and V rows of positions [0, len) copied to `scratch`, one after another.
   In the cache a head's rows lie the KV heads' row apart (1 KiB for 4 heads of 64), so
   a chunk's rows fall in a quarter of L1's sets and evict each other between the passes
   over them; contiguous rows use all sets. The copy is read once per tile that reads
   them. Longer spans, a sliding window (its tiles read a part of the span each) or a failed
   allocation read the cache in place. */
static Keys rows_together(Scratch *scratch, const Keys *paged, int64_t len) {
    const int64_t dim = paged->dim, need = 2 * len * dim;
    if (len > TOGETHER_MAX_KEYS || paged->sp == dim) return *paged; /* one KV head: in place */
    if (need > scratch->floats) {
        free(scratch->buf);
        scratch->buf = aligned_alloc(64, (size_t)((need * sizeof(float) + 63) / 64 * 64));
        scratch->floats = scratch->buf ? need : 0;
        if (!scratch->buf) return *paged;
    }
    float *kd = scratch->buf, *vd = scratch->buf + len * dim;
    for (int64_t pos = 0; pos < len; pos++) {
        memcpy(kd + pos * dim, key_row(paged, paged->k, pos), sizeof(float) * dim);
        memcpy(vd + pos * dim, key_row(paged, paged->v, pos), sizeof(float) * dim);
    }
    /* one block that holds every position */
    const Keys ks = {kd, vd, 0, dim, &first_block, INT64_MAX, paged->window, dim};
    return ks;
}

/* q [T, H, D] with strides sq_t, sq_h (unit over D); out [T, H, D] contiguous; k, v
   [blocks, block_size, H_kv, D] with strides sb, sp, sh (unit over D); tables [B, W] int32;
   sequence b owns q rows [query_start[b], query_start[b+1]) at positions
   seq_lens[b] - q_len .. seq_lens[b] - 1; window <= 0: none. D <= MAX_DIM. With
   skip_single, sequences of one query are left alone (the decode kernel serves them: their
   group of query heads fills too few lanes here). The tiles are numbered in loop order and
   this call runs those whose number is `part` modulo `parts`: the calls for every part,
   on as many threads, write disjoint rows of out. Dealing the tiles round-robin gives
   each part its share of a prompt's early (short) and late (long) causal tiles. */
void paged_prefill_attention(const float *q, int64_t sq_t, int64_t sq_h, const float *k,
                             const float *v, int64_t sb, int64_t sp, int64_t sh,
                             const int32_t *tables, int64_t table_width,
                             const int32_t *query_start, const int32_t *seq_lens,
                             int64_t batch, float *out, int64_t heads, int64_t kv_heads,
                             int64_t dim, int64_t block_size, float scale, int64_t window,
                             int64_t skip_single, int64_t part, int64_t parts) {
    if (dim > MAX_DIM || kv_heads <= 0 || heads % kv_heads) return; /* refused by the caller */
    const int64_t group = heads / kv_heads;
    const int64_t slice = group < TILE_ROWS ? group : TILE_ROWS; /* query heads per tile */
    const int64_t per_tile = TILE_ROWS / slice;                  /* tokens per tile */
    const int64_t slices = (group + slice - 1) / slice; /* of a KV head's query heads */
    Scratch scratch = {NULL, 0};
    int64_t tile_index = 0;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t first = query_start[b], q_len = query_start[b + 1] - first;
        const int64_t start_pos = seq_lens[b] - q_len;
        if (skip_single && q_len == 1) continue;
        const int64_t tiles_here = slices * ((q_len + per_tile - 1) / per_tile); /* a KV head's */
        for (int64_t kh = 0; kh < kv_heads; kh++) {
            const Keys paged = {k + kh * sh, v + kh * sh, sb, sp, tables + b * table_width,
                                block_size, window, dim};
            const int64_t skip = (part - tile_index % parts + parts) % parts;
            const int64_t my_tiles = skip < tiles_here ? (tiles_here - skip - 1) / parts + 1 : 0;
            const int copy = my_tiles >= TOGETHER_MIN_TILES && window <= 0;
            const Keys ks = copy ? rows_together(&scratch, &paged, seq_lens[b]) : paged;
            for (int64_t h0 = kh * group; h0 < (kh + 1) * group; h0 += slice) {
                const int64_t nh = (kh + 1) * group - h0 < slice ? (kh + 1) * group - h0 : slice;
                for (int64_t t0 = 0; t0 < q_len; t0 += per_tile) {
                    if (tile_index++ % parts != part) continue;
                    const Tile t = {q + (first + t0) * sq_t + h0 * sq_h, sq_t, sq_h,
                                    out + ((first + t0) * heads + h0) * dim, heads * dim, dim,
                                    start_pos + t0, q_len - t0 < per_tile ? q_len - t0 : per_tile,
                                    nh, scale * LOG2E};
                    tile(&t, &ks);
                }
            }
        }
    }
    free(scratch.buf);
}

/* The query rows of a tile in this build: the caller's estimate of a call's tiles. */
int64_t paged_prefill_tile_rows(void) { return TILE_ROWS; }
