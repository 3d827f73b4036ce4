/* Scatters new K/V rows into the paged caches on CPU (kernels/cpu_kv_write.py builds and
 * calls it): token t's heads go to slot slots[t] = block * block_size + offset; slot -1 is
 * skipped. The caches are strided views (one layer of the whole cache), so each head's
 * head_dim floats are copied where the view's strides put them. torch's index_put_ with two
 * index tensors on such a view costs several times this copy.
 */
#include <stdint.h>
#include <string.h>

void write_kv_rows(const float *k, const float *v, int64_t tokens, int64_t token_stride,
                   int64_t head_stride, int64_t kv_heads, int64_t head_dim, float *k_cache,
                   float *v_cache, int64_t block_stride, int64_t slot_stride,
                   int64_t cache_head_stride, int64_t block_size, const int64_t *slots,
                   int64_t part, int64_t parts) {
  const int64_t per = tokens / parts, extra = tokens % parts;
  const int64_t lo = part * per + (part < extra ? part : extra);
  const int64_t hi = lo + per + (part < extra ? 1 : 0);
  const size_t bytes = (size_t)head_dim * sizeof(float);
  for (int64_t t = lo; t < hi; t++) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const int64_t at = (slot / block_size) * block_stride + (slot % block_size) * slot_stride;
    for (int64_t h = 0; h < kv_heads; h++) {
      const int64_t src = t * token_stride + h * head_stride;
      memcpy(k_cache + at + h * cache_head_stride, k + src, bytes);
      memcpy(v_cache + at + h * cache_head_stride, v + src, bytes);
    }
  }
}
