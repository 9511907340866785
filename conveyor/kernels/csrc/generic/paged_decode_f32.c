/* Decode attention straight from the paged KV cache, in float32, in plain C.
 *
 * One query token per row (a decode, or a short prompt's token with the context up to it). Each
 * row's pages are read in place: no gather into a contiguous copy, no padding to the batch's
 * longest context. Scores, softmax and the weighted sum of values are float32, as PyTorch's
 * float32 SDPA; only the order of the sums differs. The avx2 tier replaces this file.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* Element d of a cached head row of `kind` (common.h's kv_type), before an int8 row's scale. */
static inline float kv_value(const char *head, int d, int kind) {
    return kind == KV_INT8  ? ((const int8_t *)head)[d]
           : kind == KV_F16 ? half_load((const uint8_t *)head + 2 * d)
                            : ((const float *)head)[d];
}

/* One query head against its KV head's cached rows (the caches offset to that head; `row`
 * bytes a token), the first `skip` of them outside its window. */
static ALWAYS_INLINE void attend(const float *q, const char *k_cache, const char *v_cache,
                                 const int32_t *table, int len, int skip, float *out, int dim,
                                 int64_t row, int block_size, float scale, float cap,
                                 float *scores, int kind) {
    const int q8 = kind == KV_INT8;
    float top = -FLT_MAX, total = 0.0f;
    for (int t = skip; t < len; t++) {
        const char *k = k_cache + ((int64_t)table[t / block_size] * block_size
                                   + t % block_size) * row;
        float s = 0.0f;
        for (int d = 0; d < dim; d++) s += q[d] * kv_value(k, d, kind);
        scores[t] = s * scale * (q8 ? kv_scale(k, dim) : 1.0f);
    }
    soft_cap(scores + skip, len - skip, cap);
    for (int t = skip; t < len; t++) top = scores[t] > top ? scores[t] : top;
    for (int d = 0; d < dim; d++) out[d] = 0.0f;
    for (int t = skip; t < len; t++) {
        const float p = expf(scores[t] - top);
        const char *v = v_cache + ((int64_t)table[t / block_size] * block_size
                                   + t % block_size) * row;
        const float pv = q8 ? p * kv_scale(v, dim) : p;
        total += p;
        for (int d = 0; d < dim; d++) out[d] += pv * kv_value(v, d, kind);
    }
    for (int d = 0; d < dim; d++) out[d] /= total;
}

/* q: row i, head j at q[i * q_stride + j * head_dim]; caches: [num_blocks, block_size,
 * num_kv_heads, head_dim] of float32, halves or int8 head rows (kv_type, common.h);
 * block_tables: [n, table_stride] int32; context_lens: [n] int32 (tokens to attend to, the
 * new one included, its K/V already written); out like q; window: the tokens a query attends
 * to at most (0: all), cap: the scores' soft cap (0: none).
 * Returns 0, or -2 if scratch memory could not be allocated. */
int paged_decode_attention_f32(const float *q, int64_t q_stride, const void *k_cache,
                               const void *v_cache, int kv_type, const int32_t *block_tables,
                               int64_t table_stride, const int32_t *context_lens, float *out,
                               int64_t out_stride, int n, int num_heads, int num_kv_heads,
                               int head_dim, int block_size, float scale, int window,
                               float cap, int threads) {
    const int group = num_heads / num_kv_heads;
    const int64_t head = kv_head_bytes(head_dim, kv_type, 0), row = num_kv_heads * head;
    int longest = 1, failed = 0;
    for (int i = 0; i < n; i++) longest = context_lens[i] > longest ? context_lens[i] : longest;
    #pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * longest);
        #pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < n * num_heads; item++) {
            const int i = item / num_heads, j = item % num_heads;
            if (scores == NULL) {
                #pragma omp atomic write
                failed = 1;
                continue;
            }
            const int64_t kv = (int64_t)(j / group) * head;
            const int32_t *table = block_tables + i * table_stride;
            int len = context_lens[i];
            const int skip = window_pages(window, block_size, &table, &len);
            const float *qj = q + i * q_stride + j * head_dim;
            const char *kj = (const char *)k_cache + kv, *vj = (const char *)v_cache + kv;
            float *oj = out + i * out_stride + j * head_dim;
            if (kv_type == KV_INT8)
                attend(qj, kj, vj, table, len, skip, oj, head_dim, row, block_size, scale, cap,
                       scores, KV_INT8);
            else if (kv_type == KV_F16)
                attend(qj, kj, vj, table, len, skip, oj, head_dim, row, block_size, scale, cap,
                       scores, KV_F16);
            else
                attend(qj, kj, vj, table, len, skip, oj, head_dim, row, block_size, scale, cap,
                       scores, KV_MODEL);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
