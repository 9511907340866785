/* Decode attention straight from the paged KV cache, for the CPU, in bfloat16.
 *
 * One query token per row (a decode, or a short prompt's token with the context up to it). Each
 * row's pages are read once, in place: no gather into a contiguous copy, no padding to the
 * batch's longest context, and the query heads that share a KV head are served by the same
 * read. Products take the cache's bfloat16 pairs as they are
 * (vdpbf16ps), scores and sums are float32, and the softmax's weights are rounded to bfloat16
 * for the weighted sum of values, as PyTorch's CPU flash attention does for bfloat16 inputs.
 * With AMX, a tile's scores are tile products instead, read straight from the page.
 *
 * The context is walked in tiles of 16 tokens. A query's 16 dot products with a tile are summed
 * across lanes together (`sum_each`, ~3 shuffles a score instead of ~8 for one reduction at a
 * time); a tile's V rows are interleaved in token pairs once, into a scratch that stays in L1,
 * for every query head of the group. The rows still to come are prefetched a few lines at a time
 * between the products, since at large batches reading the cache is what bounds the kernel.
 *
 * An int8 cache (common.h's KV_INT8) is widened a tile at a time into a scratch of bfloat16
 * rows (int8 values are exact in bfloat16) that the vector path's products read; a token's K
 * scale multiplies its scores, its V scale its softmax weight before that is rounded.
 *
 * The avx512 and amx tiers only (AVX-512 F and BF16); float32 models use paged_decode_f32.c.
 * OpenMP shares the work out on the runtime PyTorch has already loaded into the process
 * (libgomp.so.1), with PyTorch's thread count.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <float.h>

#include "common.h"

#if !CONVEYOR_AVX512_BF16
#error "built for the avx512 and amx tiers only (AVX-512 F and BF16)"
#endif

#define TILE 16


/* With AMX (configure_tiles, common.h), the scores take tiles 0, a tile's scores (16 tokens x 16
 * query heads, float32); 1, 32 dimensions of 16 cached K rows (bfloat16); 2, the same dimensions
 * of the queries, in pairs (16 pairs x 16 query heads). */
#define AMX_SCORES CONVEYOR_AMX

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

/* Where token t of a context lies in a cache (`row` bytes a token): its page from the table,
 * then its row there. */
static inline const char *token_row(const char *cache, const int32_t *table, int page,
                                    int slot, int block_size, int64_t row) {
    return cache + ((int64_t)table[page] * block_size + slot) * row;
}

/* The rows of tokens t0 .. t0 + n - 1 of a context (n <= 16) in rows[], and `zero` for the
 * rest of the tile. The page and slot are stepped along, not divided out per token. */
static inline void tile_rows(const char *cache, const int32_t *table, int t0, int n,
                             int block_size, int64_t row, const char *zero, const char **rows) {
    int page = t0 / block_size, slot = t0 % block_size;
    for (int t = 0; t < TILE; t++) {
        if (t < n) {
            rows[t] = token_row(cache, table, page, slot, block_size, row);
            if (++slot == block_size) page++, slot = 0;
        } else {
            rows[t] = zero;
        }
    }
}

/* Pages lie anywhere in the pool, so the hardware prefetcher cannot see the next ones coming.
 * Each tile's products ask for the rows of the tile AHEAD tiles on (the K tiles, then the V
 * tiles, as the passes read them) into L2, a line or two between products: asked for all at
 * once, most of them are dropped (docs/results/design-notes#decode-prefetch). This writes the
 * rows of that tile, token t of the K-then-V stream, into rows[] (`zero` past the end). */
#define AHEAD 2
static inline void ahead_rows(const char *k_cache, const char *v_cache, const int32_t *table,
                              int len, int t, int block_size, int64_t row, const char *zero,
                              const char **rows) {
    const int padded = (len + TILE - 1) / TILE * TILE;
    const char *cache = t < padded ? k_cache : v_cache;
    t = t < padded ? t : t - padded;
    const int n = len - t < 0 ? 0 : len - t < TILE ? len - t : TILE;
    tile_rows(cache, table, n ? t : 0, n, block_size, row, zero, rows);
}

/* Lines b0, b0 + step, ... (below `lines`) of a row, into L2. */
static inline void prefetch_row(const char *r, int b0, int step, int lines) {
    for (int b = b0; b < lines; b += step) _mm_prefetch(r + 64 * b, _MM_HINT_T2);
}

/* int8 caches: a tile's rows (`heads` int8 head rows each, `n` of them real, `zero` past them)
 * as bfloat16 rows of `heads * dim` values in wide[], and their scales in scales[head * TILE +
 * t] (0 past n). */
static inline void widen_tile(const char *const *rows, int n, int heads, int dim,
                              uint16_t *wide, float *scales) {
    const int span = heads * dim;
    for (int t = 0; t < TILE; t++)
        for (int h = 0; h < heads; h++) {
            const int8_t *r = (const int8_t *)rows[t] + h * (dim + KV_SCALE_BYTES);
            scales[h * TILE + t] = t < n ? kv_scale(r, dim) : 0.0f;
            for (int d = 0; d < dim; d += 32) {
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)(r + d))));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)(r + d + 16))));
                _mm512_storeu_si512(wide + t * span + h * dim + d,
                                    (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            }
        }
}

/* One request and `heads` consecutive KV heads (whose slices of a cached token are adjacent, so
 * each row is read front to back), each with its `group` query heads: scores against every
 * cached token, softmax, weighted sum of values.
 *
 * Both products take bfloat16 pairs straight from the cache (vdpbf16ps: exact products, summed
 * in float32), so nothing is widened. Scores: q . k, then times `scale`. Values: the softmax's
 * numerators exp(s - max) are rounded to bfloat16 and the sum is divided by their float32 total
 * at the end, as PyTorch's CPU flash attention does for bfloat16; a tile's V rows are interleaved
 * in token pairs once (a scratch in L1), so each product takes two tokens of 16 dimensions.
 * head_dim is a compile-time constant in each specialisation, so the loops over it unroll into
 * registers. buf: see attend_scratch. q8: int8 head rows (`row` is always in bytes). */
static ALWAYS_INLINE void attend(const uint16_t *q, const char *k_cache, const char *v_cache,
                                 const int32_t *table, int len, int skip, uint16_t *out,
                                 int heads, int group, const int dim, int64_t row,
                                 int block_size, float scale, float cap, int amx, float *buf,
                                 const int q8) {
    enum { MAXV = 8 };  /* zmm registers of bfloat16 a row of head_dim 256 takes */
    const int nv = dim / 32, nq = heads * group, span = heads * dim;
    const int padded = (len + TILE - 1) / TILE * TILE;
    float *acc = buf, *scores = acc + nq * dim;
    uint16_t *weights = (uint16_t *)(scores + (int64_t)nq * padded);  /* [nq, padded] */
    uint16_t *pairs = weights + (int64_t)nq * padded;                 /* [TILE / 2, span, 2] */
    uint16_t *zero = pairs + TILE * span;                             /* [span] */
    /* AMX: the queries as tiles [heads, dim / 32, 16 pairs, 16 query heads, 2], a tile's scores */
    uint16_t *q_tiles = zero + span;
    float *tile_scores = (float *)(q_tiles + (int64_t)heads * dim * TILE * 2);
    /* int8: a tile widened [TILE, span], its scales [heads, TILE], the V scales [heads, padded] */
    uint16_t *wide = (uint16_t *)(tile_scores + TILE * TILE);
    float *tile_scales = (float *)(wide + TILE * span), *v_scales = tile_scales + heads * TILE;
    const char *rows[TILE], *z = (const char *)zero;
    const uint16_t *k[TILE];  /* the tile's bfloat16 rows: in the cache, or widened */
    memset(zero, 0, sizeof(uint16_t) * span);
    const int row_lines = (int)((heads * (q8 ? dim + KV_SCALE_BYTES : 2 * dim) + 63) / 64);
    const char *ahead[TILE];
    for (int a = 0; a < AHEAD; a++) {
        ahead_rows(k_cache, v_cache, table, len, a * TILE, block_size, row, z, ahead);
        for (int t = 0; t < TILE; t++) prefetch_row(ahead[t], 0, 1, row_lines);
    }

#if AMX_SCORES
    if (amx) {
        /* column j of the queries' tiles is query head j, zero where K's head is not its own,
         * so the products of all KV heads add up in one result tile */
        memset(q_tiles, 0, sizeof(uint16_t) * heads * dim * TILE * 2);
        for (int j = 0; j < nq; j++)
            for (int d = 0; d < dim; d++)
                q_tiles[((j / group * dim + d) / 2 * TILE + j) * 2 + d % 2] = q[j * dim + d];
        const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(
            0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(TILE));
        for (int t0 = 0; t0 < len; t0 += TILE) {
            /* a tile lies in one page (block_size is a multiple of 16): its rows are row apart;
             * past len they are the page's unused slots, whose scores are never read */
            const uint16_t *first = (const uint16_t *)token_row(
                k_cache, table, t0 / block_size, t0 % block_size, block_size, row);
            ahead_rows(k_cache, v_cache, table, len, t0 + AHEAD * TILE, block_size, row, z,
                       ahead);
            _tile_zero(0);
            for (int c = 0; c < span / 32; c++) {
                _tile_loadd(1, first + 32 * c, row);
                _tile_loadd(2, q_tiles + c * TILE * TILE * 2, TILE * 4);
                _tile_dpbf16ps(0, 1, 2);
                for (int t = c; t < TILE; t += span / 32) prefetch_row(ahead[t], 0, 1, row_lines);
            }
            _tile_stored(0, tile_scores, TILE * 4);
            for (int j = 0; j < nq; j++)
                _mm512_storeu_ps(scores + (int64_t)j * padded + t0, _mm512_mul_ps(
                    _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(j)),
                                        tile_scores, 4), _mm512_set1_ps(scale)));
        }
    }
#endif
    for (int t0 = 0; t0 < len && !(AMX_SCORES && amx); t0 += TILE) {
        const int n = len - t0 < TILE ? len - t0 : TILE;
        tile_rows(k_cache, table, t0, n, block_size, row, z, rows);
        if (q8) widen_tile(rows, n, heads, dim, wide, tile_scales);
        for (int t = 0; t < TILE; t++)
            k[t] = q8 ? wide + t * span : (const uint16_t *)rows[t];
        ahead_rows(k_cache, v_cache, table, len, t0 + AHEAD * TILE, block_size, row, z, ahead);
        for (int j = 0; j < nq; j++) {  /* query head j reads KV head j / group */
            const int kd = j / group * dim;
            __m512bh qv[MAXV];
            __m512 part[TILE];
            for (int v = 0; v < nv; v++)
                qv[v] = (__m512bh)_mm512_loadu_si512(q + j * dim + 32 * v);
            for (int t = 0; t < TILE; t++) {
                prefetch_row(ahead[t], j, nq, row_lines);
                __m512 s = _mm512_setzero_ps();
                for (int v = 0; v < nv; v++)
                    s = _mm512_dpbf16_ps(s, qv[v],
                                         (__m512bh)_mm512_loadu_si512(k[t] + kd + 32 * v));
                part[t] = s;
            }
            __m512 sc = _mm512_mul_ps(sum_each(part), _mm512_set1_ps(scale));
            if (q8) sc = _mm512_mul_ps(sc, _mm512_loadu_ps(tile_scales + j / group * TILE));
            _mm512_storeu_ps(scores + (int64_t)j * padded + t0, sc);
        }
    }
    if (q8)  /* each token's V scales, for its weights */
        for (int t = 0; t < len; t++) {
            const char *r = token_row(v_cache, table, t / block_size, t % block_size,
                                      block_size, row);
            for (int h = 0; h < heads; h++)
                v_scales[h * padded + t] = kv_scale(r + h * (dim + KV_SCALE_BYTES), dim);
        }
    for (int j = 0; j < nq; j++) {
        float *s = scores + (int64_t)j * padded, top = -FLT_MAX, total = 0.0f;
        uint16_t *w = weights + (int64_t)j * padded;
        soft_cap(s + skip, len - skip, cap);
        for (int t = skip; t < len; t++) top = s[t] > top ? s[t] : top;
        for (int t = 0; t < skip; t++) s[t] = 0.0f;  /* before the window: weight 0 */
        for (int t = skip; t < len; t++) {
            s[t] = expf(s[t] - top);
            total += s[t];
        }
        for (int t = 0; t < len; t += 16) {  /* past len: zero weights (scores are not read) */
            const __mmask16 m = len - t >= 16 ? 0xffff : (__mmask16)((1u << (len - t)) - 1);
            __m512 x = _mm512_maskz_loadu_ps(m, s + t);
            if (q8)
                x = _mm512_mul_ps(x, _mm512_maskz_loadu_ps(m, v_scales + j / group * padded + t));
            _mm256_storeu_si256((__m256i *)(w + t), (__m256i)_mm512_cvtneps_pbh(x));
        }
        s[0] = 1.0f / total;  /* kept for the end */
    }

    memset(acc, 0, sizeof(float) * nq * dim);
    for (int t0 = 0; t0 < len; t0 += TILE) {
        const int n = len - t0 < TILE ? len - t0 : TILE, np = (n + 1) / 2;
        tile_rows(v_cache, table, t0, n, block_size, row, z, rows);
        if (q8) widen_tile(rows, n, heads, dim, wide, tile_scales);
        for (int t = 0; t < TILE; t++)
            k[t] = q8 ? wide + t * span : (const uint16_t *)rows[t];
        ahead_rows(k_cache, v_cache, table, len, padded + t0 + AHEAD * TILE, block_size, row,
                   z, ahead);
        /* pair p, vector v: (token 2p, token 2p + 1) of dims 32v + 8L + {0-3} (lo) and
         * 32v + 8L + {4-7} (hi) for lanes L of 128 bits */
        for (int p = 0; p < np; p++)
            for (int d = 0; d < span; d += 32) {
                const __m512i a = _mm512_loadu_si512(k[2 * p] + d);
                const __m512i b = _mm512_loadu_si512(k[2 * p + 1] + d);
                _mm512_storeu_si512(pairs + (p * span + d) * 2, _mm512_unpacklo_epi16(a, b));
                _mm512_storeu_si512(pairs + (p * span + d) * 2 + 32, _mm512_unpackhi_epi16(a, b));
            }
        for (int j = 0; j < nq; j++) {
            const uint16_t *v_pairs = pairs + j / group * dim * 2;
            const uint32_t *w = (const uint32_t *)(weights + (int64_t)j * padded + t0);
            __m512 a[2 * MAXV];
            for (int v = 0; v < 2 * nv; v++) a[v] = _mm512_loadu_ps(acc + j * dim + 16 * v);
            for (int p = 0; p < np; p++) {
                prefetch_row(ahead[2 * p], j, nq, row_lines);
                prefetch_row(ahead[2 * p + 1], j, nq, row_lines);
                const __m512bh wp = (__m512bh)_mm512_set1_epi32((int)w[p]);
                for (int v = 0; v < 2 * nv; v++)
                    a[v] = _mm512_dpbf16_ps(a[v], (__m512bh)_mm512_loadu_si512(
                                            v_pairs + p * span * 2 + 32 * v), wp);
            }
            for (int v = 0; v < 2 * nv; v++) _mm512_storeu_ps(acc + j * dim + 16 * v, a[v]);
        }
    }
    /* back to dimension order, divided by the total, rounded */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int j = 0; j < nq; j++) {
        const __m512 inv = _mm512_set1_ps(scores[(int64_t)j * padded]);
        for (int v = 0; v < nv; v++) {
            const __m512 lo = _mm512_loadu_ps(acc + j * dim + 32 * v);
            const __m512 hi = _mm512_loadu_ps(acc + j * dim + 32 * v + 16);
            const __m512 x = _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), inv);
            const __m512 y = _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), inv);
            _mm512_storeu_si512(out + j * dim + 32 * v, (__m512i)_mm512_cvtne2ps_pbh(y, x));
        }
    }
}

/* Floats of scratch attend takes for `nq` query heads of `heads` KV heads over `span` cached
 * values a token and contexts up to `longest`: accumulators, scores, bfloat16 weights, the
 * paired tile, a zero row, the AMX query tiles and scores (two bfloat16 a float); for int8
 * caches, a widened tile and the scales. */
static size_t attend_scratch(int nq, int heads, int dim, int span, int longest) {
    const size_t padded = (size_t)(longest + TILE - 1) / TILE * TILE;
    return nq * dim + nq * padded + (nq * padded + TILE * span + span + 1) / 2
           + span * TILE + TILE * TILE + (TILE * span + 1) / 2 + heads * TILE + heads * padded;
}

/* q: row i, head j at q[i * q_stride + j * head_dim]; caches: [num_blocks, block_size,
 * num_kv_heads, head_dim] of bfloat16, or of int8 head rows (kv_type, common.h); block_tables:
 * [n, table_stride] int32; context_lens: [n] int32 (tokens to attend to, the new one included,
 * its K/V already written); out like q; window: the tokens a query attends to at most (0: all),
 * cap: the scores' soft cap (0: none). threads: PyTorch's intra-op thread count. Returns 0; -1
 * for a head_dim without a specialisation; -2 if scratch memory could not be allocated. */
int paged_decode_attention_bf16(const uint16_t *q, int64_t q_stride, const void *k_cache,
                                const void *v_cache, int kv_type, const int32_t *block_tables,
                                int64_t table_stride, const int32_t *context_lens, uint16_t *out,
                                int64_t out_stride, int n, int num_heads, int num_kv_heads,
                                int head_dim, int block_size, float scale, int window, float cap,
                                int threads) {
    if (head_dim != 64 && head_dim != 128 && head_dim != 256) return -1;
    const int group = num_heads / num_kv_heads;
    const int64_t head = kv_head_bytes(head_dim, kv_type, 1);
    const int64_t row = num_kv_heads * head;  /* bytes of one token of one page */
    /* AMX scores take a tile in one page and every query head of an item in one result tile
     * (int8 caches: the vector path, whose tiles are widened anyway; faster there) */
    const int amx = AMX_SCORES && block_size % TILE == 0 && group <= TILE && has_amx()
                    && kv_type != KV_INT8;
    /* Work items: a request's KV heads in `split` parts. Whole requests when there are enough of
     * them to go round the threads; with few requests, or more query heads than an AMX result
     * tile holds, one head per item instead (so that a row's scores take the same path at
     * every batch size: batch invariance). */
    const int split = n >= 2 * threads && !(amx && num_heads > TILE) ? 1 : num_kv_heads;
    const int per = num_kv_heads / split;
    int longest = 0, failed = 0;
    for (int i = 0; i < n; i++) longest = context_lens[i] > longest ? context_lens[i] : longest;
    const size_t floats = attend_scratch(per * group, per, head_dim, per * head_dim, longest);

    #pragma omp parallel num_threads(threads)
    {
        float *buf = malloc(sizeof(float) * floats);
#if AMX_SCORES
        if (amx) configure_tiles();
#endif
        #pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < n * split; item++) {
            if (buf == NULL) {
                #pragma omp atomic write
                failed = 1;
                continue;
            }
            const int i = item / split, h = item % split * per;
            const int64_t qoff = (int64_t)h * group * head_dim;
            const int32_t *table = block_tables + (int64_t)i * table_stride;
            int len = context_lens[i];
            const int skip = window_pages(window, block_size, &table, &len);
            const uint16_t *qi = q + i * q_stride + qoff;
            const char *ki = (const char *)k_cache + h * head;
            const char *vi = (const char *)v_cache + h * head;
            uint16_t *oi = out + i * out_stride + qoff;
#define ATTEND(DIM, Q8) attend(qi, ki, vi, table, len, skip, oi, per, group, DIM, row, \
                               block_size, scale, cap, amx, buf, Q8)
            if (kv_type == KV_INT8)
                head_dim == 64 ? ATTEND(64, 1) : head_dim == 128 ? ATTEND(128, 1) : ATTEND(256, 1);
            else
                head_dim == 64 ? ATTEND(64, 0) : head_dim == 128 ? ATTEND(128, 0) : ATTEND(256, 0);
#undef ATTEND
        }
#if AMX_SCORES
        if (amx) _tile_release();
#endif
        free(buf);
    }
    return failed ? -2 : 0;
}
