/* Decode attention straight from the paged KV cache, for the CPU, in bfloat16.
 *
 * One query token per request. Each request's pages are read once, in place: no gather into a
 * contiguous copy, no padding to the batch's longest context, and the query heads that share a
 * KV head are served by the same read. Scores and the weighted sum of values
 * are kept in float32, as PyTorch's SDPA does for bfloat16 inputs.
 *
 * Plain C that GCC vectorises (-O3 -march=native); OpenMP shares the work out on the runtime
 * PyTorch has already loaded into the process (libgomp.so.1), with PyTorch's thread count.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <float.h>

#include "bf16.h"

/* Page p of a context (tokens t0 = p * block_size onward) in a cache: its first row, and in
 * *rows how many of its rows the context fills. Pages lie anywhere in the pool, so the hardware
 * prefetcher cannot see the next one coming: the span this work item reads from it is fetched
 * one page ahead. */
static inline const uint16_t *page_at(const uint16_t *cache, const int32_t *table, int p, int len,
                                      int block_size, int64_t row, int span, int *rows) {
    const int t0 = p * block_size;
    *rows = len - t0 < block_size ? len - t0 : block_size;
    if (t0 + block_size < len) {
        const uint16_t *next = cache + (int64_t)table[p + 1] * block_size * row;
        for (int r = 0; r < block_size; r++)
            for (int d = 0; d < span; d += 32) __builtin_prefetch(next + r * row + d, 0, 2);
    }
    return cache + (int64_t)table[p] * block_size * row;
}

/* One request and `heads` consecutive KV heads (whose slices of a cached token are adjacent, so
 * each page is read front to back): scores against every cached token, softmax, weighted sum of
 * values. head_dim is a compile-time constant in each specialisation, so inner loops unroll. */
static inline void attend(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int32_t *table, int len, uint16_t *out, int heads, int group,
                          const int head_dim, int64_t row, int block_size, float scale,
                          float *buf) {
    const int nq = heads * group;  /* query heads served; query head j reads KV head j / group */
    const int span = heads * head_dim;
    float *qf = buf, *acc = qf + (size_t)nq * head_dim, *scores = acc + (size_t)nq * head_dim;
    for (int j = 0; j < nq * head_dim; j++) qf[j] = bf16_load(q[j]) * scale;

    float top[nq];
    for (int j = 0; j < nq; j++) top[j] = -FLT_MAX;
    for (int t0 = 0, p = 0, rows; t0 < len; t0 += block_size, p++) {
        const uint16_t *page = page_at(k_cache, table, p, len, block_size, row, span, &rows);
        for (int r = 0; r < rows; r++) {
            for (int hh = 0, j = 0; hh < heads; hh++) {
                float kf[head_dim];
                const uint16_t *kr = page + r * row + hh * head_dim;
                for (int d = 0; d < head_dim; d++) kf[d] = bf16_load(kr[d]);
                for (int g = 0; g < group; g++, j++) {
                    const float *qj = qf + j * head_dim;
                    float s = 0.0f;
                    for (int d = 0; d < head_dim; d++) s += qj[d] * kf[d];
                    scores[(int64_t)j * len + t0 + r] = s;
                    top[j] = s > top[j] ? s : top[j];
                }
            }
        }
    }
    for (int j = 0; j < nq; j++) {
        float *sj = scores + (int64_t)j * len, total = 0.0f;
        for (int t = 0; t < len; t++) {
            sj[t] = expf(sj[t] - top[j]);
            total += sj[t];
        }
        const float inv = 1.0f / total;
        for (int t = 0; t < len; t++) sj[t] *= inv;
    }

    memset(acc, 0, sizeof(float) * (size_t)nq * head_dim);
    for (int t0 = 0, p = 0, rows; t0 < len; t0 += block_size, p++) {
        const uint16_t *page = page_at(v_cache, table, p, len, block_size, row, span, &rows);
        for (int r = 0; r < rows; r++) {
            for (int hh = 0, j = 0; hh < heads; hh++) {
                float vf[head_dim];
                const uint16_t *vr = page + r * row + hh * head_dim;
                for (int d = 0; d < head_dim; d++) vf[d] = bf16_load(vr[d]);
                for (int g = 0; g < group; g++, j++) {
                    const float w = scores[(int64_t)j * len + t0 + r];
                    float *aj = acc + j * head_dim;
                    for (int d = 0; d < head_dim; d++) aj[d] += w * vf[d];
                }
            }
        }
    }
    for (int j = 0; j < nq * head_dim; j++) out[j] = bf16_store(acc[j]);
}

/* q: row i, head j at q[i * q_stride + j * head_dim]; caches: [num_blocks, block_size,
 * num_kv_heads, head_dim]; block_tables: [n, table_stride] int32; context_lens: [n] int32
 * (tokens to attend to, the new one included, its K/V already written); out like q.
 * threads: PyTorch's intra-op thread count. Returns 0; -1 for a head_dim without a
 * specialisation; -2 if scratch memory could not be allocated. */
int paged_decode_attention(const uint16_t *q, int64_t q_stride,
                           const uint16_t *k_cache, const uint16_t *v_cache,
                           const int32_t *block_tables, int64_t table_stride,
                           const int32_t *context_lens, uint16_t *out, int64_t out_stride,
                           int n, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, float scale, int threads) {
    if (head_dim != 64 && head_dim != 128) return -1;
    const int group = num_heads / num_kv_heads;
    const int64_t row = (int64_t)num_kv_heads * head_dim;  /* one token of one page */
    /* Work items: a request's KV heads in `split` parts. Whole requests when there are enough of
     * them to go round the threads; with few requests, one head per item instead. */
    const int split = n >= 2 * threads ? 1 : num_kv_heads;
    const int per = num_kv_heads / split;
    int failed = 0;

    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int item = 0; item < n * split; item++) {
        const int i = item / split, h = item % split * per;
        const int len = context_lens[i];
        float *buf = malloc(sizeof(float) * ((size_t)per * group * (2 * head_dim + len)));
        if (buf == NULL) {
            #pragma omp atomic write
            failed = 1;
            continue;
        }
        const int64_t qoff = (int64_t)h * group * head_dim, kvoff = (int64_t)h * head_dim;
        const int32_t *table = block_tables + (int64_t)i * table_stride;
        const uint16_t *qi = q + i * q_stride + qoff;
        uint16_t *oi = out + i * out_stride + qoff;
        if (head_dim == 64)
            attend(qi, k_cache + kvoff, v_cache + kvoff, table, len, oi, per, group, 64, row,
                   block_size, scale, buf);
        else
            attend(qi, k_cache + kvoff, v_cache + kvoff, table, len, oi, per, group, 128, row,
                   block_size, scale, buf);
        free(buf);
    }
    return failed ? -2 : 0;
}
