/* RMSNorm and neox rotary embedding for float32 rows on CPU (kernels/cpu_norm_rope.py builds
 * and calls it).
 *
 * torch on CPU runs F.rms_norm as five passes over the tensor (pow, mean, add, rsqrt, mul,
 * then the weight) and the rotary embedding as index, cat, neg, two muls and an add: at
 * prompt-sized steps these memory passes cost a third of a layer. Here each row is read once
 * and written once, in place where the caller allows it.
 *
 * A call does the rows of its `part` of `parts` (a contiguous range), so the Python side can
 * give each part a thread (ctypes releases the GIL). The arithmetic is torch's: x * (1 /
 * sqrt(mean(x^2) + eps)) * w, and x * cos + rotate_half(x) * sin; built with
 * -ffp-contract=off so no multiply-add is fused where torch rounds twice.
 */
#include <math.h>
#include <stdint.h>

static inline void row_range(int64_t rows, int64_t part, int64_t parts, int64_t *lo,
                             int64_t *hi) {
  int64_t per = rows / parts, extra = rows % parts;
  *lo = part * per + (part < extra ? part : extra);
  *hi = *lo + per + (part < extra ? 1 : 0);
}

static inline void norm_row(const float *x, float *out, const float *w, int64_t dim,
                            float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < dim; i++) sum += x[i] * x[i];
  const float r = 1.0f / sqrtf(sum / (float)dim + eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; i++) out[i] = (x[i] * r) * w[i];
}

/* out[row] = rms_norm(x[row]) * w for the rows of this part; out may be x. */
void rms_norm_rows(const float *x, int64_t x_stride, float *out, int64_t out_stride,
                   const float *w, int64_t rows, int64_t dim, float eps, int64_t part,
                   int64_t parts) {
  int64_t lo, hi;
  row_range(rows, part, parts, &lo, &hi);
  for (int64_t r = lo; r < hi; r++) norm_row(x + r * x_stride, out + r * out_stride, w, dim, eps);
}

/* In place on x [tokens, heads, head_dim] (head_dim contiguous): each head's vector is
 * RMS-normalised with w (when w is not NULL), then its first rotary_dim values are rotated
 * neox style by the token's position: cos/sin rows of `table_stride` floats, the first half
 * of a row for the first half of the rotated values and the second half for the second. */
void norm_rope_heads(float *x, int64_t tokens, int64_t heads, int64_t token_stride,
                     int64_t head_stride, int64_t head_dim, const float *w, float eps,
                     const int64_t *positions, const float *cos, const float *sin,
                     int64_t table_stride, int64_t rotary_dim, int64_t part, int64_t parts) {
  int64_t lo, hi;
  row_range(tokens * heads, part, parts, &lo, &hi);
  const int64_t half = rotary_dim / 2;
  for (int64_t item = lo; item < hi; item++) {
    const int64_t t = item / heads, h = item % heads;
    float *v = x + t * token_stride + h * head_stride;
    if (w) norm_row(v, v, w, head_dim, eps);
    const float *c = cos + positions[t] * table_stride;
    const float *s = sin + positions[t] * table_stride;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
      const float a = v[i], b = v[i + half];
      v[i] = a * c[i] + (-b) * s[i];
      v[i + half] = b * c[i + half] + a * s[i + half];
    }
  }
}
