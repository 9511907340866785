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
 * An int8 cache (common.h's KV_INT8) is multiplied in integers where the CPU allows: with AMX
 * the scores are tile products of the cached K rows as they lie and a two-level int8 query
 * (amx_int8_scores); without, a tile's K rows are widened to bfloat16 (exact) in L1 for the
 * vector path. The values are summed with vpdpbusd on weights rounded to two 8-bit levels
 * (int8_values). A token's K scale multiplies its scores, its V scale its softmax weight.
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

/* The lanes of tokens t .. t + 15 that lie in [skip, len). */
static inline __mmask16 live_lanes(int t, int skip, int len) {
    const uint32_t below = len - t >= 16 ? 0xffff : (1u << (len - t)) - 1;
    const uint32_t before = skip - t >= 16 ? 0xffff : skip > t ? (1u << (skip - t)) - 1 : 0;
    return (__mmask16)(below & ~before);
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

#if AMX_SCORES
/* AMX scores of an int8 cache, its K rows multiplied as they lie (tdpbssd). Each query head j
 * is held as two int8 levels, q / q_scale = q1 + q2 / 128 (q_scale = max |q| / 127, q2 the
 * rounding left by q1, within +-64), so that the query keeps about 14 bits where a single level
 * keeps 7: 128 (q1 . k) + q2 . k is exact in int32 and times q_scale / 128 the score. The
 * levels' tiles, [span / 64, 16 quads, 16 query heads, 4] each, are laid out as the bfloat16
 * path's pairs are, column j zero where K's head is not its own. Writes scores[j * padded + t]
 * times `scale` and each token's K scale; scratch: quads (2 span TILE bytes), the result tiles
 * (TILE x TILE int32 each), k_scales [heads, TILE]. */
static ALWAYS_INLINE void amx_int8_scores(const uint16_t *q, const char *k_cache,
                                          const char *v_cache, const int32_t *table, int len,
                                          int heads, int group, const int dim, int64_t row,
                                          int block_size, float scale, int8_t *quads,
                                          float *q_scales, int32_t *coarse, int32_t *fine,
                                          float *k_scales, float *scores, int padded,
                                          const char *z, int row_lines) {
    const int nq = heads * group, span = heads * dim, chunks = span / 64, head = dim + 4;
    const char *ahead[TILE];
    int8_t *q1 = quads, *q2 = quads + span * TILE;
    memset(quads, 0, 2 * (size_t)span * TILE);
    for (int j = 0; j < nq; j++) {
        float top = 0.0f;
        for (int d = 0; d < dim; d++) top = fmaxf(top, fabsf(bf16_load(q[j * dim + d])));
        const float inv = top > 0.0f ? 127.0f / top : 0.0f;
        q_scales[j] = top / 127.0f / 128.0f * scale;
        for (int d = 0; d < dim; d++) {
            const int c = j / group * dim + d;
            const int at = ((c / 64 * TILE + c % 64 / 4) * TILE + j) * 4 + c % 4;
            const float x = bf16_load(q[j * dim + d]) * inv, whole = nearbyintf(x);
            q1[at] = (int8_t)whole;
            q2[at] = (int8_t)nearbyintf((x - whole) * 128.0f);
        }
    }
    const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(TILE));
    for (int t0 = 0; t0 < len; t0 += TILE) {
        const int n = len - t0 < TILE ? len - t0 : TILE;
        const char *first = token_row(k_cache, table, t0 / block_size, t0 % block_size,
                                      block_size, row);
        ahead_rows(k_cache, v_cache, table, len, t0 + AHEAD * TILE, block_size, row, z, ahead);
        _tile_zero(0);
        _tile_zero(3);
        for (int c = 0; c < chunks; c++) {
            _tile_loadd(1, first + c / (dim / 64) * head + c % (dim / 64) * 64, row);
            _tile_loadd(2, q1 + c * TILE * TILE * 4, TILE * 4);
            _tile_dpbssd(0, 1, 2);
            _tile_loadd(4, q2 + c * TILE * TILE * 4, TILE * 4);
            _tile_dpbssd(3, 1, 4);
            for (int t = c; t < TILE; t += chunks) prefetch_row(ahead[t], 0, 1, row_lines);
        }
        _tile_stored(0, coarse, TILE * 4);
        _tile_stored(3, fine, TILE * 4);
        for (int h = 0; h < heads; h++)  /* past len: the page's unused slots, weighed 0 */
            for (int t = 0; t < TILE; t++)
                k_scales[h * TILE + t] = t < n ? kv_scale(first + t * row + h * head, dim) : 0.0f;
        for (int j = 0; j < nq; j++) {
            const __m512i at = _mm512_add_epi32(column, _mm512_set1_epi32(j));
            const __m512i sum = _mm512_add_epi32(
                _mm512_slli_epi32(_mm512_i32gather_epi32(at, coarse, 4), 7),
                _mm512_i32gather_epi32(at, fine, 4));
            _mm512_storeu_ps(scores + (int64_t)j * padded + t0, _mm512_mul_ps(
                _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(q_scales[j])),
                _mm512_loadu_ps(k_scales + j / group * TILE)));
        }
    }
}
#endif

/* int8 caches: the weighted sum of values in integers (vpdpbusd, 64 products an instruction
 * where vdpbf16ps takes 32). A tile's weights, the softmax numerators times their tokens' V
 * scales, are scaled to 0..255 against the tile's largest (`units`: a scale a tile and query
 * head) and held as two 8-bit levels, w = w1 + w2 / 256 (one level alone is too coarse when
 * the V scales of a tile differ widely), four tokens' in a 32-bit word; its V rows are
 * interleaved four tokens a dimension, as the instruction takes them; a tile's int32 sums,
 * 256 S1 + S2, are added into the float32 accumulators at its scale. acc[j * dim + 64 c + 16 k
 * + 4 L + e] holds dimension 64 c + 16 L + 4 k + e (the interleave's order). Scratch: weights
 * (8 words a query head), v_scales [heads, TILE], units [nq], quads (16 vectors). */
static ALWAYS_INLINE void int8_values(const float *numerators, int padded, const char *k_cache,
                                      const char *v_cache, const int32_t *table, int len,
                                      int heads, int group, const int dim, int64_t row,
                                      int block_size, const char *z, int row_lines, float *acc,
                                      uint32_t *weights, float *v_scales, float *units,
                                      char *quads) {
    const int nq = heads * group, head = dim + KV_SCALE_BYTES;
    const char *rows[TILE], *ahead[TILE];
    for (int t0 = 0; t0 < len; t0 += TILE) {
        const int n = len - t0 < TILE ? len - t0 : TILE;
        tile_rows(v_cache, table, t0, n, block_size, row, z, rows);
        ahead_rows(k_cache, v_cache, table, len, padded + t0 + AHEAD * TILE, block_size, row, z,
                   ahead);
        for (int h = 0; h < heads; h++)
            for (int t = 0; t < TILE; t++)
                v_scales[h * TILE + t] = t < n ? kv_scale(rows[t] + h * head, dim) : 0.0f;
        for (int j = 0; j < nq; j++) {  /* past len and before the window: numerators 0 */
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(numerators + (int64_t)j * padded + t0),
                                           _mm512_loadu_ps(v_scales + j / group * TILE));
            const float top = _mm512_reduce_max_ps(x);
            units[j] = top * (1.0f / (255.0f * 256.0f));
            const __m512 u = _mm512_mul_ps(x, _mm512_set1_ps(top > 0.0f ? 255.0f / top : 0.0f));
            const __m512i coarse = _mm512_cvttps_epi32(u);
            const __m512 fine = _mm512_mul_ps(_mm512_sub_ps(u, _mm512_cvtepi32_ps(coarse)),
                                              _mm512_set1_ps(256.0f));
            _mm_storeu_si128((__m128i *)(weights + 8 * j), _mm512_cvtusepi32_epi8(coarse));
            _mm_storeu_si128((__m128i *)(weights + 8 * j + 4),
                             _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(fine)));
        }
        for (int h = 0; h < heads; h++)
            for (int c = 0; c < dim; c += 64) {
                for (int g = 0; g < TILE / 4; g++) {  /* lane L of quads[4 g + k]: dims 16 L + 4 k .. */
                    const char *r = rows[4 * g] + h * head + c;
                    const __m512i a = _mm512_loadu_si512(r);
                    const __m512i b = _mm512_loadu_si512(rows[4 * g + 1] + h * head + c);
                    const __m512i d = _mm512_loadu_si512(rows[4 * g + 2] + h * head + c);
                    const __m512i e = _mm512_loadu_si512(rows[4 * g + 3] + h * head + c);
                    const __m512i ab0 = _mm512_unpacklo_epi8(a, b), ab1 = _mm512_unpackhi_epi8(a, b);
                    const __m512i de0 = _mm512_unpacklo_epi8(d, e), de1 = _mm512_unpackhi_epi8(d, e);
                    _mm512_storeu_si512(quads + 64 * (4 * g), _mm512_unpacklo_epi16(ab0, de0));
                    _mm512_storeu_si512(quads + 64 * (4 * g + 1), _mm512_unpackhi_epi16(ab0, de0));
                    _mm512_storeu_si512(quads + 64 * (4 * g + 2), _mm512_unpacklo_epi16(ab1, de1));
                    _mm512_storeu_si512(quads + 64 * (4 * g + 3), _mm512_unpackhi_epi16(ab1, de1));
                    if (h == 0 && c == 0)
                        for (int t = 4 * g; t < 4 * g + 4; t++) prefetch_row(ahead[t], 0, 1, row_lines);
                }
                for (int j = h * group; j < (h + 1) * group; j++) {
                    __m512i s[4], f[4];
                    for (int k = 0; k < 4; k++) s[k] = f[k] = _mm512_setzero_si512();
                    for (int g = 0; g < TILE / 4; g++) {
                        const __m512i w = _mm512_set1_epi32((int)weights[8 * j + g]);
                        const __m512i w2 = _mm512_set1_epi32((int)weights[8 * j + 4 + g]);
                        for (int k = 0; k < 4; k++) {
                            const __m512i v = _mm512_loadu_si512(quads + 64 * (4 * g + k));
                            s[k] = _mm512_dpbusd_epi32(s[k], w, v);
                            f[k] = _mm512_dpbusd_epi32(f[k], w2, v);
                        }
                    }
                    float *out = acc + j * dim + c;
                    for (int k = 0; k < 4; k++)  /* 256 coarse + fine: under 2^28 a tile */
                        _mm512_storeu_ps(out + 16 * k, _mm512_fmadd_ps(
                            _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(s[k], 8), f[k])),
                            _mm512_set1_ps(units[j]), _mm512_loadu_ps(out + 16 * k)));
                }
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
    int32_t *tile_fine = (int32_t *)(tile_scores + TILE * TILE);  /* int8: the second level's */
    /* int8: a tile widened [TILE, span], its scales [heads, TILE]; every query head's scale */
    uint16_t *wide = (uint16_t *)(tile_fine + TILE * TILE);
    float *tile_scales = (float *)(wide + TILE * span), *q_scales = tile_scales + heads * TILE;
    float *inverse = q_scales + nq;  /* 1 / each query head's softmax total */
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
    if (amx && q8)
        amx_int8_scores(q, k_cache, v_cache, table, len, heads, group, dim, row, block_size,
                        scale, (int8_t *)q_tiles, q_scales, (int32_t *)tile_scores, tile_fine,
                        tile_scales, scores, padded, z, row_lines);
    if (amx && !q8) {
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
    for (int j = 0; j < nq; j++) {
        float *s = scores + (int64_t)j * padded;
        uint16_t *w = weights + (int64_t)j * padded;
        soft_cap(s + skip, len - skip, cap);
        __m512 top = _mm512_set1_ps(-FLT_MAX), total = _mm512_setzero_ps();
        for (int t = 0; t < len; t += 16)
            top = _mm512_mask_max_ps(top, live_lanes(t, skip, len), top, _mm512_loadu_ps(s + t));
        top = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        for (int t = 0; t < len; t += 16) {  /* outside [skip, len): weight 0 */
            const __mmask16 m = live_lanes(t, skip, len);
            __m512 x = _mm512_sub_ps(_mm512_loadu_ps(s + t), top);
            x = _mm512_maskz_mov_ps(m, exp_neg16(x));
            total = _mm512_add_ps(total, x);
            if (q8)  /* weighed with the V scales tile by tile, below */
                _mm512_storeu_ps(s + t, x);
            else
                _mm256_storeu_si256((__m256i *)(w + t), (__m256i)_mm512_cvtneps_pbh(x));
        }
        inverse[j] = 1.0f / _mm512_reduce_add_ps(total);
    }

    memset(acc, 0, sizeof(float) * nq * dim);
    if (q8)
        int8_values(scores, padded, k_cache, v_cache, table, len, heads, group, dim, row,
                    block_size, z, row_lines, acc, (uint32_t *)weights, tile_scales, q_scales,
                    (char *)wide);
    for (int t0 = 0; t0 < len && !q8; t0 += TILE) {
        const int n = len - t0 < TILE ? len - t0 : TILE, np = (n + 1) / 2;
        tile_rows(v_cache, table, t0, n, block_size, row, z, rows);
        for (int t = 0; t < TILE; t++) k[t] = (const uint16_t *)rows[t];
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
    for (int j = 0; j < nq && q8; j++)  /* int8_values' order: 4 x 4 blocks of 4 transposed */
        for (int c = 0; c < dim; c += 64) {
            const float *s = acc + j * dim + c;
            const __m512 t0 = _mm512_shuffle_f32x4(_mm512_loadu_ps(s), _mm512_loadu_ps(s + 16), 0x44);
            const __m512 t1 = _mm512_shuffle_f32x4(_mm512_loadu_ps(s), _mm512_loadu_ps(s + 16), 0xEE);
            const __m512 t2 = _mm512_shuffle_f32x4(_mm512_loadu_ps(s + 32), _mm512_loadu_ps(s + 48), 0x44);
            const __m512 t3 = _mm512_shuffle_f32x4(_mm512_loadu_ps(s + 32), _mm512_loadu_ps(s + 48), 0xEE);
            const __m512 o[4] = {_mm512_shuffle_f32x4(t0, t2, 0x88), _mm512_shuffle_f32x4(t0, t2, 0xDD),
                                 _mm512_shuffle_f32x4(t1, t3, 0x88), _mm512_shuffle_f32x4(t1, t3, 0xDD)};
            for (int v = 0; v < 4; v += 2)
                _mm512_storeu_si512(out + j * dim + c + 16 * v, (__m512i)_mm512_cvtne2ps_pbh(
                    _mm512_mul_ps(o[v + 1], _mm512_set1_ps(inverse[j])),
                    _mm512_mul_ps(o[v], _mm512_set1_ps(inverse[j]))));
        }
    for (int j = 0; j < nq && !q8; j++) {
        const __m512 inv = _mm512_set1_ps(inverse[j]);
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
           + span * TILE + 2 * TILE * TILE + (TILE * span + 1) / 2 + heads * TILE + 2 * nq;
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
    const int amx = AMX_SCORES && block_size % TILE == 0 && group <= TILE && has_amx();
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
