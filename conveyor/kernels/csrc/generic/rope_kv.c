/* Rotary embedding of each token's q and k heads, in place, and its k and v rows written into
 * the paged caches: one call a layer for what the PyTorch path does in ~8 ops (two multiplies,
 * a roll, an add, two index copies and their views), whose fixed cost dominates small batches.
 *
 * The same roundings as that path (model.apply_rope), in the model dtype: x * cos and
 * roll(x) * signed sin are each rounded, then their sum, so the results are equal bit for bit.
 */
#include <stdint.h>
#include <string.h>

#include "common.h"

/* qk: [tokens, heads + kv_heads, dim] (row stride qk_stride, heads packed), rotated in place;
 * v: [tokens, kv_heads, dim] (row stride v_stride); cos, sin: [tokens, dim] (row stride
 * cs_stride); slots: [tokens] rows of the caches, which are [rows, kv_heads, dim] of the model
 * dtype, of int8 head rows (kv_type KV_INT8, common.h) or of halves (KV_F16). */
static ALWAYS_INLINE void rope_kv_write(void *qk, int64_t qk_stride, const void *v,
                                        int64_t v_stride, const void *cos, const void *sin,
                                        int64_t cs_stride, const int64_t *slots, void *k_cache,
                                        void *v_cache, int kv_type, int tokens, int heads,
                                        int kv_heads, int dim, int threads, int bf16) {
    const int half = dim / 2;
    const size_t elem = bf16 ? 2 : 4, head_bytes = kv_head_bytes(dim, kv_type, bf16);
    const size_t kv_row = head_bytes * kv_heads;
    #pragma omp parallel for schedule(static) num_threads(threads) if (tokens >= 4 * threads)
    for (int t = 0; t < tokens; t++) {
        const int64_t row = t * qk_stride, c = t * cs_stride;
        float cf[dim], sf[dim], x[dim];
        for (int i = 0; i < dim; i++) {
            cf[i] = elem_load(cos, c + i, bf16);
            sf[i] = elem_load(sin, c + i, bf16);
        }
        for (int h = 0; h < heads + kv_heads; h++) {
            const int64_t head = row + h * dim;
            for (int i = 0; i < dim; i++) x[i] = elem_load(qk, head + i, bf16);
            for (int i = 0; i < dim; i++) {
                const float rolled = x[i < half ? i + half : i - half];
                elem_store(qk, head + i, round_to(x[i] * cf[i], bf16)
                           + round_to(rolled * sf[i], bf16), bf16);
            }
        }
        char *k_row = (char *)k_cache + slots[t] * kv_row;
        char *v_row = (char *)v_cache + slots[t] * kv_row;
        if (kv_type == KV_INT8) {
            for (int h = 0; h < kv_heads; h++) {
                kv_quantize(qk, row + (heads + h) * dim, dim, bf16, k_row + h * head_bytes);
                kv_quantize(v, t * v_stride + h * dim, dim, bf16, v_row + h * head_bytes);
            }
        } else if (kv_type == KV_F16) {
            uint16_t *k_half = (uint16_t *)k_row, *v_half = (uint16_t *)v_row;
            for (int e = 0; e < kv_heads * dim; e++) {
                k_half[e] = half_store(elem_load(qk, row + heads * dim + e, bf16));
                v_half[e] = half_store(elem_load(v, t * v_stride + e, bf16));
            }
        } else {
            memcpy(k_row, (const char *)qk + elem * (row + heads * dim), kv_row);
            memcpy(v_row, (const char *)v + elem * t * v_stride, kv_row);
        }
    }
}

void rope_kv_write_f32(float *qk, int64_t qk_stride, const float *v, int64_t v_stride,
                       const float *cos, const float *sin, int64_t cs_stride,
                       const int64_t *slots, void *k_cache, void *v_cache, int kv_type,
                       int tokens, int heads, int kv_heads, int dim, int threads) {
    rope_kv_write(qk, qk_stride, v, v_stride, cos, sin, cs_stride, slots, k_cache, v_cache,
                  kv_type, tokens, heads, kv_heads, dim, threads, 0);
}

void rope_kv_write_bf16(uint16_t *qk, int64_t qk_stride, const uint16_t *v, int64_t v_stride,
                        const uint16_t *cos, const uint16_t *sin, int64_t cs_stride,
                        const int64_t *slots, void *k_cache, void *v_cache, int kv_type,
                        int tokens, int heads, int kv_heads, int dim, int threads) {
    rope_kv_write(qk, qk_stride, v, v_stride, cos, sin, cs_stride, slots, k_cache, v_cache,
                  kv_type, tokens, heads, kv_heads, dim, threads, 1);
}
