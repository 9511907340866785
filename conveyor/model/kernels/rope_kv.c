/* Rotary embedding of each token's q and k heads, in place, and its k and v rows written into
 * the paged caches: one call a layer for what the PyTorch path does in ~8 ops (two multiplies,
 * a roll, an add, two index copies and their views), whose fixed cost dominates small batches.
 *
 * The same roundings as that path (model.apply_rope): x * cos and roll(x) * signed sin are each
 * rounded to bfloat16, then their sum, so the results are equal bit for bit.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* qk: [tokens, heads + kv_heads, dim] (row stride qk_stride, heads packed), rotated in place;
 * v: [tokens, kv_heads, dim] (row stride v_stride); cos, sin: [tokens, dim] (row stride
 * cs_stride); slots: [tokens] rows of the caches, which are [rows, kv_heads, dim]. */
void rope_kv_write(uint16_t *qk, int64_t qk_stride, const uint16_t *v, int64_t v_stride,
                   const uint16_t *cos, const uint16_t *sin, int64_t cs_stride,
                   const int64_t *slots, uint16_t *k_cache, uint16_t *v_cache, int tokens,
                   int heads, int kv_heads, int dim, int threads) {
    const int half = dim / 2;
    #pragma omp parallel for schedule(static) num_threads(threads) if (tokens >= 4 * threads)
    for (int t = 0; t < tokens; t++) {
        uint16_t *row = qk + t * qk_stride;
        const uint16_t *c = cos + t * cs_stride, *s = sin + t * cs_stride;
        float cf[dim], sf[dim], x[dim];
        for (int i = 0; i < dim; i++) {
            cf[i] = bf16_load(c[i]);
            sf[i] = bf16_load(s[i]);
        }
        for (int h = 0; h < heads + kv_heads; h++) {
            uint16_t *head = row + h * dim;
            for (int i = 0; i < dim; i++) x[i] = bf16_load(head[i]);
            for (int i = 0; i < dim; i++) {
                const float rolled = x[i < half ? i + half : i - half];
                head[i] = bf16_store(bf16_load(bf16_store(x[i] * cf[i]))
                                     + bf16_load(bf16_store(rolled * sf[i])));
            }
        }
        const int64_t at = slots[t] * kv_heads * dim;
        memcpy(k_cache + at, row + heads * dim, sizeof(uint16_t) * kv_heads * dim);
        memcpy(v_cache + at, v + t * v_stride, sizeof(uint16_t) * kv_heads * dim);
    }
}
