/* Decode attention straight from the paged KV cache, for the CPU, in bfloat16.
 *
 * One query token per request. Each request's pages are read once, in place: no gather into a
 * contiguous copy, no padding to the batch's longest context, and the query heads that share a
 * KV head are served by the same read. Scores and the weighted sum of values are kept in
 * float32, as PyTorch's SDPA does for bfloat16 inputs.
 *
 * The context is walked in tiles of 16 tokens: a tile's K (then V) rows of the KV heads a work
 * item serves are widened to float32 once, into a scratch that stays in L1, and every query
 * head of those heads' groups works from there. A query's 16 dot products with a tile are summed across lanes together
 * (`sum_each`, ~3 shuffles a score instead of ~8 for one reduction at a time). That keeps the
 * kernel near the speed of reading the cache, which is what bounds it at large batches.
 *
 * Needs AVX-512 (F, BF16), as quant_linear.c: elsewhere has_avx512_bf16() says 0 and the model
 * gathers pages and runs SDPA. OpenMP shares the work out on the runtime PyTorch has already
 * loaded into the process (libgomp.so.1), with PyTorch's thread count.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <float.h>

#include "bf16.h"

#if CONVEYOR_AVX512_BF16
#define TILE 16

/* r[i] = the sum of the 16 lanes of a[i]: pairs are folded together by halving the width
 * (512 -> 256 -> 128 -> 64 -> 32 bits), so each step serves several vectors at once. The last
 * step leaves lane 4 * L + e holding a[4 * e + L]; one permutation puts them in order. */
static inline __m512 sum_each(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[2 * i], c[2 * i + 1]),
                             _mm512_unpackhi_ps(c[2 * i], c[2 * i + 1]));
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi)));
}

/* Where token t of a context lies in a cache: its page from the table, then its row there. */
static inline const uint16_t *token_row(const uint16_t *cache, const int32_t *table, int page,
                                        int slot, int block_size, int64_t row) {
    return cache + ((int64_t)table[page] * block_size + slot) * row;
}

/* Tokens t0 .. t0 + n - 1 of a context (n <= 16), `span` values of each cached row (some KV
 * heads' slices), as float32 rows of `span` in f; rows n .. 15 zeroed. Pages lie anywhere in the pool, so the
 * hardware prefetcher cannot see the next tile coming: it is fetched one tile ahead. The page
 * and slot are stepped along, not divided out per token. */
static inline void widen_tile(const uint16_t *cache, const int32_t *table, int t0, int n,
                              int len, int block_size, int64_t row, int span, float *f) {
    int page = t0 / block_size, slot = t0 % block_size;
    int ahead = t0 + TILE, ahead_page = ahead / block_size, ahead_slot = ahead % block_size;
    for (int t = 0; t < TILE; t++) {
        if (ahead + t < len) {
            const char *p = (const char *)token_row(cache, table, ahead_page, ahead_slot,
                                                    block_size, row);
            for (int b = 0; b < span * 2; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
            if (++ahead_slot == block_size) ahead_page++, ahead_slot = 0;
        }
        if (t < n) {
            const uint16_t *src = token_row(cache, table, page, slot, block_size, row);
            for (int d = 0; d < span; d += 16) _mm512_storeu_ps(f + t * span + d,
                                 bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(src + d))));
            if (++slot == block_size) page++, slot = 0;
        } else {
            for (int d = 0; d < span; d += 16) _mm512_storeu_ps(f + t * span + d, _mm512_setzero_ps());
        }
    }
}

/* One request and `heads` consecutive KV heads (whose slices of a cached token are adjacent, so
 * each row is read front to back), each with its `group` query heads: scores against every
 * cached token, softmax, weighted sum of values. head_dim is a compile-time constant in each
 * specialisation, so the loops over it unroll into registers. buf holds heads * group * (2 *
 * dim + padded len) + 16 * heads * dim floats. */
static inline void attend(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int32_t *table, int len, uint16_t *out, int heads, int group,
                          const int dim, int64_t row, int block_size, float scale, float *buf) {
    enum { MAXV = 8 };  /* zmm registers a row of head_dim 128 takes */
    const int nv = dim / 16, nq = heads * group, span = heads * dim;
    const int padded = (len + TILE - 1) / TILE * TILE;
    float *qf = buf, *acc = qf + nq * dim, *scores = acc + nq * dim;
    float *tile = scores + (int64_t)nq * padded;
    for (int j = 0; j < nq * dim; j++) qf[j] = bf16_load(q[j]) * scale;

    for (int t0 = 0; t0 < len; t0 += TILE) {
        const int n = len - t0 < TILE ? len - t0 : TILE;
        widen_tile(k_cache, table, t0, n, len, block_size, row, span, tile);
        for (int j = 0; j < nq; j++) {  /* query head j reads KV head j / group */
            const float *k = tile + j / group * dim;
            __m512 qv[MAXV], part[TILE];
            for (int v = 0; v < nv; v++) qv[v] = _mm512_loadu_ps(qf + j * dim + 16 * v);
            for (int t = 0; t < TILE; t++) {
                __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k + t * span));
                for (int v = 1; v < nv; v++)
                    s = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(k + t * span + 16 * v), s);
                part[t] = s;
            }
            _mm512_storeu_ps(scores + (int64_t)j * padded + t0, sum_each(part));
        }
    }
    for (int j = 0; j < nq; j++) {
        float *s = scores + (int64_t)j * padded, top = -FLT_MAX, total = 0.0f;
        for (int t = 0; t < len; t++) top = s[t] > top ? s[t] : top;
        for (int t = 0; t < len; t++) {
            s[t] = expf(s[t] - top);
            total += s[t];
        }
        const float inv = 1.0f / total;
        for (int t = 0; t < len; t++) s[t] *= inv;
    }

    memset(acc, 0, sizeof(float) * nq * dim);
    for (int t0 = 0; t0 < len; t0 += TILE) {
        const int n = len - t0 < TILE ? len - t0 : TILE;
        widen_tile(v_cache, table, t0, n, len, block_size, row, span, tile);
        for (int j = 0; j < nq; j++) {
            const float *v_rows = tile + j / group * dim, *w = scores + (int64_t)j * padded + t0;
            __m512 a[MAXV];
            for (int v = 0; v < nv; v++) a[v] = _mm512_loadu_ps(acc + j * dim + 16 * v);
            for (int t = 0; t < n; t++) {
                const __m512 wt = _mm512_set1_ps(w[t]);
                for (int v = 0; v < nv; v++)
                    a[v] = _mm512_fmadd_ps(wt, _mm512_loadu_ps(v_rows + t * span + 16 * v), a[v]);
            }
            for (int v = 0; v < nv; v++) _mm512_storeu_ps(acc + j * dim + 16 * v, a[v]);
        }
    }
    for (int j = 0; j < nq * dim; j += 16)
        _mm256_storeu_si256((__m256i *)(out + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + j)));
}

#endif

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
#if !CONVEYOR_AVX512_BF16
    return -1;  /* not built for this CPU */
#else
    if (head_dim != 64 && head_dim != 128) return -1;
    const int group = num_heads / num_kv_heads;
    const int64_t row = (int64_t)num_kv_heads * head_dim;  /* one token of one page */
    /* Work items: a request's KV heads in `split` parts. Whole requests when there are enough of
     * them to go round the threads; with few requests, one head per item instead. */
    const int split = n >= 2 * threads ? 1 : num_kv_heads, per = num_kv_heads / split;
    int longest = 0, failed = 0;
    for (int i = 0; i < n; i++) longest = context_lens[i] > longest ? context_lens[i] : longest;
    const size_t floats = (size_t)per * group * (2 * head_dim + longest + TILE)
                          + TILE * per * head_dim;

    #pragma omp parallel num_threads(threads)
    {
        float *buf = malloc(sizeof(float) * floats);
        #pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < n * split; item++) {
            if (buf == NULL) {
                #pragma omp atomic write
                failed = 1;
                continue;
            }
            const int i = item / split, h = item % split * per;
            const int64_t qoff = (int64_t)h * group * head_dim, kvoff = (int64_t)h * head_dim;
            const int32_t *table = block_tables + (int64_t)i * table_stride;
            if (head_dim == 64)
                attend(q + i * q_stride + qoff, k_cache + kvoff, v_cache + kvoff, table,
                       context_lens[i], out + i * out_stride + qoff, per, group, 64, row,
                       block_size, scale, buf);
            else
                attend(q + i * q_stride + qoff, k_cache + kvoff, v_cache + kvoff, table,
                       context_lens[i], out + i * out_stride + qoff, per, group, 128, row,
                       block_size, scale, buf);
        }
        free(buf);
    }
    return failed ? -2 : 0;
#endif
}
