/* Decode attention straight from the paged KV cache, in float32, with AVX2 FMAs.
 *
 * One query token per row (a decode, or a short prompt's token with the context up to it). Each
 * row's pages are read in place: no gather into a contiguous copy, no padding to the batch's
 * longest context. Scores, softmax and the weighted sum of values are float32, as PyTorch's
 * float32 SDPA; only the order of the sums (and exp's last bit) differs.
 *
 * A work item is a request's KV heads (with few requests, one KV head), each with its group of
 * query heads. Scores go 8 tokens at a time: for each query head, 8 chains of FMAs over the head
 * dimension (one per token, so the FMA units' latency is covered), then summed across lanes
 * together (one transpose-and-add for all 8). The weighted sum of values keeps a query head's
 * output in registers, 8 dimensions a vector, while the tokens stream past. Whole requests a
 * item read each token's row front to back (SmolLM2, 32 requests of 300 tokens: 0.81-0.88x
 * the time of an item a KV head). head_dim: any multiple of 8 up to 256.
 *
 * An int8 cache (common.h's KV_INT8) is read as it lies: 8 values widened to float32 a load,
 * a token's K scale applied to its score and its V scale to its softmax weight. A float16 one
 * (KV_F16): 8 halves widened a load (F16C), exactly.
 */
#include <float.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define TILE 8
#define MAXV 8  /* vectors of a query head held in registers at once (64 dimensions) */
#define AHEAD 2 /* tiles of rows asked for ahead of the products */
#define ZERO_ROW 2048  /* floats of the longest row a whole-request item reads (8 KV heads x 256) */

/* r[t] = the sum of a[t]'s 8 lanes, for 8 vectors at once. */
static inline __m256 sum8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline void prefetch_row(const char *r, int lines) {
    for (int i = 0; i < lines; i++) _mm_prefetch((const char *)r + 64 * i, _MM_HINT_T0);
}

/* 8 values of a cached head row of `kind` (common.h's kv_type) from p on, as float32. */
static ALWAYS_INLINE __m256 load8(const char *p, int kind) {
    return kind == KV_INT8
               ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)))
           : kind == KV_F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p))
                            : _mm256_loadu_ps((const float *)p);
}

/* One request and `heads` consecutive KV heads (the caches offset to the first; their slices of
 * a token's row are adjacent, so rows are read front to back), each with its `group` query
 * heads at q: scores against every cached token, softmax, weighted sum of values into out.
 * at: each token's row offset in either cache (bytes; see paged_decode_attention_f32);
 * scores: [heads * group][len rounded up to TILE] of scratch; zero: a row of zeros past len.
 * kind: the rows' storage (common.h's kv_type: int8 head rows of `dim` + KV_SCALE_BYTES bytes,
 * halves, or float32). */
static ALWAYS_INLINE void attend(const float *q, const char *k_cache, const char *v_cache,
                                  const int64_t *at, int len, int skip, float *out, int heads,
                                  int group, const int dim, float scale, float cap,
                                  const char *zero, float *scores, const int kind) {
    const int nv = dim / 8, nq = heads * group, padded = (len + TILE - 1) / TILE * TILE;
    const int q8 = kind == KV_INT8, head = kv_head_bytes(dim, kind, 0);
    const int step = q8 ? 8 : kind == KV_F16 ? 16 : 32;  /* bytes of 8 values */
    const int lines = (heads * head + 63) / 64;  /* of a token's row of these heads */
    const __m256 vscale = _mm256_set1_ps(scale);
    /* pages lie anywhere in the pool: rows are asked for by hand AHEAD tiles before the
     * products read them (K's; past the end, V's first ones, as the next pass reads them) */
    for (int t = 0; t < AHEAD * TILE && t < len; t++) prefetch_row(k_cache + at[t], lines);
    for (int t0 = 0; t0 < len; t0 += TILE) {
        const char *k[TILE];
        for (int t = 0; t < TILE; t++) k[t] = t0 + t < len ? k_cache + at[t0 + t] : zero;
        for (int t = t0 + AHEAD * TILE; t < t0 + (AHEAD + 1) * TILE; t++)
            if (t < len)
                prefetch_row(k_cache + at[t], lines);
            else if (t - len < AHEAD * TILE)
                prefetch_row(v_cache + at[t - len], lines);
        for (int j = 0; j < nq; j++) {  /* query head j reads KV head j / group */
            /* the tile's K rows are read again each head, from L1: without this barrier GCC
             * hoists all the loads out of the loop and spills them to the stack */
            __asm__ volatile("" ::: "memory");
            const float *qj = q + j * dim;
            const int kd = j / group * head;
            __m256 acc[TILE];
            for (int t = 0; t < TILE; t++) acc[t] = _mm256_setzero_ps();
            for (int v = 0; v < nv; v++) {
                const __m256 qv = _mm256_loadu_ps(qj + 8 * v);
                for (int t = 0; t < TILE; t++)
                    acc[t] = _mm256_fmadd_ps(qv, load8(k[t] + kd + step * v, kind), acc[t]);
            }
            __m256 sc = _mm256_mul_ps(sum8(acc), vscale);
            if (q8)  /* (a zero row's scale is 0) */
                sc = _mm256_mul_ps(sc, _mm256_setr_ps(
                    kv_scale(k[0] + kd, dim), kv_scale(k[1] + kd, dim), kv_scale(k[2] + kd, dim),
                    kv_scale(k[3] + kd, dim), kv_scale(k[4] + kd, dim), kv_scale(k[5] + kd, dim),
                    kv_scale(k[6] + kd, dim), kv_scale(k[7] + kd, dim)));
            _mm256_storeu_ps(scores + j * padded + t0, sc);
        }
    }
    for (int j = 0; j < nq; j++) {
        float *s = scores + j * padded, top = -FLT_MAX;
        soft_cap(s + skip, len - skip, cap);
        for (int t = skip; t < len; t++) top = s[t] > top ? s[t] : top;
        const __m256 vtop = _mm256_set1_ps(top);
        __m256 total = _mm256_setzero_ps();
        for (int t = 0; t < padded; t += 8) {
            /* before skip (outside the window) and past len (the zero rows'): weight 0 */
            const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            const __m256i live = _mm256_andnot_si256(
                _mm256_cmpgt_epi32(_mm256_set1_epi32(skip - t), lane),
                _mm256_cmpgt_epi32(_mm256_set1_epi32(len - t), lane));
            const __m256 p = _mm256_and_ps(exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + t), vtop)),
                                           _mm256_castsi256_ps(live));
            _mm256_storeu_ps(s + t, p);
            total = _mm256_add_ps(total, p);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / hsum8(total));
        const char *vh = v_cache + j / group * head;
        for (int v0 = 0; v0 < nv; v0 += MAXV) {  /* dimensions 8 v0 .. in registers */
            const int nc = nv - v0 < MAXV ? nv - v0 : MAXV;
            __m256 acc[MAXV];
            for (int v = 0; v < nc; v++) acc[v] = _mm256_setzero_ps();
            for (int t = 0; t < len; t++) {
                const char *vr = vh + at[t] + step * v0;
                if (j == 0 && v0 == 0 && t + AHEAD * TILE < len)  /* the whole row, once */
                    prefetch_row(v_cache + at[t + AHEAD * TILE], lines);
                const __m256 p = _mm256_set1_ps(q8 ? s[t] * kv_scale(vh + at[t], dim) : s[t]);
                for (int v = 0; v < nc; v++)
                    acc[v] = _mm256_fmadd_ps(p, load8(vr + step * v, kind), acc[v]);
            }
            for (int v = 0; v < nc; v++)
                _mm256_storeu_ps(out + j * dim + 8 * (v0 + v), _mm256_mul_ps(acc[v], inv));
        }
    }
}

/* q: row i, head j at q[i * q_stride + j * head_dim]; caches: [num_blocks, block_size,
 * num_kv_heads, head_dim] of float32, halves or int8 head rows (kv_type, common.h);
 * block_tables: [n, table_stride] int32; context_lens: [n] int32 (tokens to attend to, the
 * new one included, its K/V already written); out like q; window: the tokens a query attends
 * to at most (0: all), cap: the scores' soft cap (0: none).
 * Returns 0; -1 for a head_dim it does not take; -2 if scratch memory could not be had. */
int paged_decode_attention_f32(const float *q, int64_t q_stride, const void *k_cache,
                               const void *v_cache, int kv_type, const int32_t *block_tables,
                               int64_t table_stride, const int32_t *context_lens, float *out,
                               int64_t out_stride, int n, int num_heads, int num_kv_heads,
                               int head_dim, int block_size, float scale, int window,
                               float cap, int threads) {
    if (head_dim % 8 != 0 || head_dim > 256) return -1;
    const int group = num_heads / num_kv_heads;
    const int64_t head = kv_head_bytes(head_dim, kv_type, 0), row = num_kv_heads * head;
    int longest = 1, failed = 0;
    for (int i = 0; i < n; i++) longest = context_lens[i] > longest ? context_lens[i] : longest;
    const size_t padded = (size_t)(longest + TILE - 1) / TILE * TILE;
    /* Work items: a request's KV heads in `split` parts. Whole requests when there are enough of
     * them to go round the threads (each row is then read front to back); with few requests,
     * one KV head per item instead. */
    float zero[ZERO_ROW] = {0};  /* the rows past a context's end: up to ZERO_ROW floats */
    const int split = n >= 2 * threads && row <= (int64_t)sizeof zero ? 1 : num_kv_heads;
    const int per = num_kv_heads / split;
    #pragma omp parallel num_threads(threads)
    {
        /* a request's row offsets (the same in K and V), then one item's scores */
        int64_t *at = malloc(sizeof(int64_t) * padded + sizeof(float) * per * group * padded);
        float *scores = (float *)(at + padded);
        int have = -1;  /* the request whose offsets `at` holds */
        #pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < n * split; item++) {
            if (at == NULL) {
                #pragma omp atomic write
                failed = 1;
                continue;
            }
            const int i = item / split, h = item % split * per;
            const int32_t *table = block_tables + i * table_stride;
            int len = context_lens[i];
            const int skip = window_pages(window, block_size, &table, &len);
            if (have != i) {  /* stepped along the pages: no division a token */
                for (int t = 0, page = 0, slot = 0; t < len; t++) {
                    at[t] = ((int64_t)table[page] * block_size + slot) * row;
                    if (++slot == block_size) page++, slot = 0;
                }
                have = i;
            }
            const int64_t qoff = (int64_t)h * group * head_dim, kv = h * head;
            const float *qi = q + i * q_stride + qoff;
            const char *ki = (const char *)k_cache + kv, *vi = (const char *)v_cache + kv;
            const char *z = (const char *)zero;
            float *oi = out + i * out_stride + qoff;
            /* the common head sizes as constants, so the loops over a row unroll into
             * registers (a runtime size left the sums in memory:
             * docs/results/design-notes#head-dim-constants) */
#define ATTEND(kind, dim) \
    attend(qi, ki, vi, at, len, skip, oi, per, group, dim, scale, cap, z, scores, kind)
#define BY_DIM(kind) \
    (head_dim == 64 ? ATTEND(kind, 64) : head_dim == 128 ? ATTEND(kind, 128) \
                                                         : ATTEND(kind, head_dim))
            if (kv_type == KV_INT8)
                BY_DIM(KV_INT8);
            else if (kv_type == KV_F16)
                BY_DIM(KV_F16);
            else
                BY_DIM(KV_MODEL);
#undef BY_DIM
#undef ATTEND
        }
        free(at);
    }
    return failed ? -2 : 0;
}
