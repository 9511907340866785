/* A float32 linear read straight from llama.cpp's blocks (blocks.h), with AVX2 FMAs.
 *
 * The GGUF blocks are 0.14x (Q4_K) to 0.27x (Q8_0) float32's bytes, and at a decode step's row
 * counts a float32 linear is bound by reading its weights. Products are summed in float32; the
 * results are F.linear's on the loader's float32 weights up to the order (and, up to FEW_ROWS
 * rows, the factoring) of those sums.
 *
 * Two ways, by row count:
 * - up to FEW_ROWS rows, each output row's blocks are multiplied in registers with every
 *   activation row at once, the block scales factored out of the sums (the weights are read
 *   once; nothing is stored);
 * - past that, BLIS-style: a strip of NR output rows is dequantized exactly as the loader does
 *   (float32 d * q, + m: two roundings) a KC-long slice at a time into a panel laid out
 *   [k][NR] (it stays in L1), and a register-blocked MR x NR product runs over it for every MR
 *   activation rows, each activation broadcast against two vectors of weights, so the
 *   dequantizing is shared by all rows. The next strip's blocks are prefetched meanwhile.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "common.h"

#define FEW_ROWS 6   /* the register path's most rows */
#define MR 6         /* activation rows of a register tile (12 accumulators) */
#define NR 16        /* output rows of a strip: two vectors */
#define KC 256       /* k of a panel slice: 16 KB, in L1 beside the activations' 6 KB */
#define MAX_MC 96    /* activation rows a strip's sums hold (6 KB) */
#define AHEAD 4      /* the few-rows path asks for the blocks of the output row this far on */


/* ---- A few rows: each output row's blocks multiplied in registers, scales factored out. ----
 * y = sum over blocks j of d_j * (x . q_j) (+ m_j * (the sum of x over block j), Q4_1): the
 * quantized values are converted to float32 (exact), never scaled one by one, which takes half
 * the vector work of dequantizing each weight; at a decode's row counts that work, not the
 * products, bounds the kernel. The sums are the loader's weights' up to float32 rounding (a
 * one-hot row still reads a weight bit for bit: d * q, then + m, two roundings). */

/* 8 bytes widened to 8 int32 lanes */
static inline __m256i u8x8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* Chunk j's quantized values of a row as float32, unscaled and offset as chunk_quants
 * (blocks.h) has them, elements 8c .. 8c + 7 in v[c]. */
static ALWAYS_INLINE void chunk_values(const uint8_t *row, int type, int j, __m256 *v) {
    const uint8_t *b = chunk_block(row, type, j);
    const __m256i fifteen = _mm256_set1_epi32(15), one = _mm256_set1_epi32(1);
    __m256i q[4];
    if (is_dense(type)) {  /* the weights themselves, widened */
        for (int c = 0; c < 4; c++)
            v[c] = type == F32 ? _mm256_loadu_ps((const float *)b + 8 * c)
                   : type == F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16 * c)))
                   : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
                         _mm_loadu_si128((const __m128i *)(b + 16 * c))), 16));
        return;
    }
    if (type == Q8_0) {
        for (int c = 0; c < 4; c++)
            q[c] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * c)));
    } else if (type == Q4_K || type == Q5_K) {
        const uint8_t *qs = b + (type == Q4_K ? 16 : 48) + 32 * ((j & 7) >> 1);
        const __m128i shift = _mm_cvtsi32_si128(4 * (j & 1)), bit = _mm_cvtsi32_si128(j & 7);
        for (int c = 0; c < 4; c++) {
            q[c] = _mm256_and_si256(_mm256_srl_epi32(u8x8(qs + 8 * c), shift), fifteen);
            if (type == Q5_K)
                q[c] = _mm256_or_si256(q[c], _mm256_slli_epi32(_mm256_and_si256(
                    _mm256_srl_epi32(u8x8(b + 16 + 8 * c), bit), one), 4));
        }
    } else if (type == Q6_K) {
        const int h = (j & 7) >> 2, t = j & 3;
        const uint8_t *ql = b + 64 * h + 32 * (t & 1), *qh = b + 128 + 32 * h;
        const __m128i lshift = _mm_cvtsi32_si128(4 * (t >> 1)), hshift = _mm_cvtsi32_si128(2 * t);
        for (int c = 0; c < 4; c++)
            q[c] = _mm256_sub_epi32(_mm256_or_si256(
                _mm256_and_si256(_mm256_srl_epi32(u8x8(ql + 8 * c), lshift), fifteen),
                _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(u8x8(qh + 8 * c), hshift),
                                                   _mm256_set1_epi32(3)), 4)),
                _mm256_set1_epi32(32));
    } else {  /* weight e < 16: the low nibble of byte e, weight e + 16 its high nibble */
        const uint8_t *qs = b + stored_values_at(type);
        const __m256i lo = u8x8(qs), hi = u8x8(qs + 8);
        q[0] = _mm256_and_si256(lo, fifteen);
        q[1] = _mm256_and_si256(hi, fifteen);
        q[2] = _mm256_srli_epi32(lo, 4);
        q[3] = _mm256_srli_epi32(hi, 4);
        if (type == Q4_0)
            for (int c = 0; c < 4; c++) q[c] = _mm256_sub_epi32(q[c], _mm256_set1_epi32(8));
        if (type == Q5_1) {
            /* bit e of qh is weight e's fifth: qh shifted right by e - 4 leaves it at bit 4
             * (for weights 0-7, qh << 4 by e) */
            uint32_t bits;
            memcpy(&bits, qs - 4, 4);
            const __m256i qh = _mm256_set1_epi32((int)bits), lane = _mm256_setr_epi32(
                0, 1, 2, 3, 4, 5, 6, 7);
            for (int c = 0; c < 4; c++)
                q[c] = _mm256_or_si256(q[c], _mm256_and_si256(_mm256_srlv_epi32(
                    c == 0 ? _mm256_slli_epi32(qh, 4) : qh,
                    _mm256_add_epi32(lane, _mm256_set1_epi32(c == 0 ? 0 : 8 * c - 4))),
                    _mm256_set1_epi32(16)));
        }
    }
    for (int c = 0; c < 4; c++) v[c] = _mm256_cvtepi32_ps(q[c]);
}

/* The factors of block b's chunks (one chunk, or a K-quant's eight): d[c][h] scales chunk c's
 * half h, m[c] is its min, as chunk_scales (blocks.h) has them; a K-quant's 6-bit or int8
 * scales are widened eight at a time. */
static ALWAYS_INLINE void block_scales(const uint8_t *b, int type, float d[8][2], float m[8]) {
    if (type == Q6_K) {
        const __m256 dd = _mm256_set1_ps(half_load(b + 208));
        for (int h = 0; h < 2; h++)  /* scale i covers weights 16i .. 16i + 15 */
            _mm256_storeu_ps(&d[4 * h][0], _mm256_mul_ps(dd, _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 192 + 8 * h))))));
    } else if (type == Q4_K || type == Q5_K) {
        uint32_t u[4];
        k_scales_mins(b, u);
        const __m256 sc = _mm256_mul_ps(_mm256_set1_ps(half_load(b)), _mm256_cvtepi32_ps(
            u8x8((const uint8_t *)u)));
        const __m256 mn = _mm256_mul_ps(_mm256_set1_ps(half_load(b + 2)), _mm256_cvtepi32_ps(
            u8x8((const uint8_t *)u + 8)));
        float scales[8];
        _mm256_storeu_ps(scales, sc);
        _mm256_storeu_ps(m, _mm256_sub_ps(_mm256_setzero_ps(), mn));
        for (int c = 0; c < 8; c++) d[c][0] = d[c][1] = scales[c];
    } else {
        chunk_scales(b, type, 0, d[0], &m[0]);
    }
}

/* R rows of x (R <= FEW_ROWS) times output rows [n0, n1). xsum: for types with a min, each
 * row's chunks of x folded to 8 lanes ([R][chunks][8]), what m multiplies. chains: 2 keeps two
 * chains of each sum (alternate chunks), so the FMA latency does not bound one row; more rows
 * are chains of their own. */
static ALWAYS_INLINE void rows_times_blocks(int R, int chains, int type, const float *x,
                                            int64_t x_stride, int k, const float *xsum,
                                            const uint8_t *w, int64_t row_bytes,
                                            const float *bias, float *y, int64_t y_stride,
                                            int n0, int n1) {
    const int chunks = k / 32, per = values_per_block(type) / 32;
    /* bytes of a row a chunk takes: how far along the row AHEAD rows on to ask for */
    const int64_t step = stored_block_bytes(type) / per;
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (int64_t)n * row_bytes;
        __m256 dacc[FEW_ROWS][2], macc[FEW_ROWS][2];
        for (int r = 0; r < R; r++)
            for (int h = 0; h < chains; h++)
                dacc[r][h] = macc[r][h] = _mm256_setzero_ps();
        for (int j0 = 0; j0 < chunks; j0 += per) {
          float ds[8][2], ms[8];
          block_scales(chunk_block(row, type, j0), type, ds, ms);
          #pragma GCC unroll 8
          for (int c = 0; c < per; c++) {  /* unrolled: each chunk's shifts are constants */
            const int j = j0 + c, h = chains == 2 ? j & 1 : 0;
            _mm_prefetch((const char *)row + AHEAD * row_bytes + j * step, _MM_HINT_T0);
            __m256 v[4];
            chunk_values(row, type, j, v);
            const __m256 d = _mm256_set1_ps(ds[c][0]), d1 = _mm256_set1_ps(ds[c][1]);
            const __m256 m = _mm256_set1_ps(ms[c]);
            for (int r = 0; r < R; r++) {
                const float *xr = x + r * x_stride + 32 * j;
                __m256 s = _mm256_mul_ps(v[0], _mm256_loadu_ps(xr));
                s = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xr + 8), s);
                if (type == Q6_K) {  /* its second 16 weights have a scale of their own */
                    dacc[r][h] = _mm256_fmadd_ps(d, s, dacc[r][h]);
                    s = _mm256_mul_ps(v[2], _mm256_loadu_ps(xr + 16));
                } else {
                    s = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xr + 16), s);
                }
                s = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xr + 24), s);
                dacc[r][h] = is_dense(type) ? _mm256_add_ps(s, dacc[r][h])
                             : _mm256_fmadd_ps(type == Q6_K ? d1 : d, s, dacc[r][h]);
                if (has_min(type))
                    macc[r][h] = _mm256_fmadd_ps(m, _mm256_loadu_ps(xsum + (r * chunks + j) * 8),
                                                 macc[r][h]);
            }
          }
        }
        const float bv = bias != NULL ? bias[n] : 0.0f;
        for (int r = 0; r < R; r++) {
            __m256 dsum = dacc[r][0], msum = macc[r][0];
            if (chains == 2) {
                dsum = _mm256_add_ps(dsum, dacc[r][1]);
                msum = _mm256_add_ps(msum, macc[r][1]);
            }
            y[r * y_stride + n] = hsum8(dsum) + hsum8(msum) + bv;
        }
    }
}

/* ---- Many rows: panels of NR output rows, register tiles of MR x NR. ---- */

/* r[o] holds 16 bytes of row o (o < 8); afterwards t[i] holds byte 2i of the eight rows in its
 * low half and byte 2i + 1 in its high half (byte 8h + o of t[i] is byte 2i + h of row o). */
static inline void transpose_bytes(const __m128i *r, __m128i *t) {
    __m128i a[8], b[8];
    for (int i = 0; i < 4; i++) {  /* rows 2i, 2i + 1 interleaved: bytes 0-7, then 8-15 */
        a[2 * i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++)    /* rows 0-3 (h = 0) or 4-7: bytes 0-3, 4-7, 8-11, 12-15 */
        for (int i = 0; i < 2; i++) {
            b[4 * h + 2 * i] = _mm_unpacklo_epi16(a[4 * h + i], a[4 * h + i + 2]);
            b[4 * h + 2 * i + 1] = _mm_unpackhi_epi16(a[4 * h + i], a[4 * h + i + 2]);
        }
    for (int i = 0; i < 4; i++) {  /* b[i], b[i + 4]: bytes 4i .. 4i + 3 of rows 0-3, 4-7 */
        t[2 * i] = _mm_unpacklo_epi32(b[i], b[i + 4]);
        t[2 * i + 1] = _mm_unpackhi_epi32(b[i], b[i + 4]);
    }
}

/* Panel row `dst` from the low 8 bytes of `bytes` (one byte per output): its low (shift 0) or
 * high (shift 4) nibbles, or for Q8_0 the byte itself, dequantized by the outputs' d (and m). */
static inline void panel_row(float *dst, __m128i bytes, int shift, __m256 d, __m256 m,
                             int type) {
    __m256i q;
    if (type == Q8_0) {
        q = _mm256_cvtepi8_epi32(bytes);
    } else {
        q = _mm256_cvtepu8_epi32(bytes);
        q = shift ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, _mm256_set1_epi32(15));
        if (type == Q4_0) q = _mm256_sub_epi32(q, _mm256_set1_epi32(8));
    }
    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
    if (type == Q4_1) v = _mm256_add_ps(v, m);
    _mm256_store_ps(dst, v);
}

static const uint8_t ZERO_BLOCK[34];  /* stands in for outputs past n: weights 0 */

static inline short half_bits(const uint8_t *p) {
    short h;
    memcpy(&h, p, 2);
    return h;
}

/* The panel [kc][NR] of output rows n0 .. n0 + NR - 1 (zero past `have` of them) and k from
 * k0 (a multiple of 32): eight outputs' blocks at a time, their quantized bytes transposed so
 * that each dequantizing step makes a row of the panel, eight outputs at one k. */
static ALWAYS_INLINE void pack_panel_of(const uint8_t *w, int64_t row_bytes, int type, int n0,
                                        int have, int k0, int kc, float *panel) {
    const int bb = stored_block_bytes(type), q0 = stored_values_at(type);
    for (int g = 0; g < NR; g += 8) {
        for (int j = 0; j < kc / 32; j++) {
            const uint8_t *b[8];
            for (int o = 0; o < 8; o++)
                b[o] = g + o < have ? w + (int64_t)(n0 + g + o) * row_bytes
                                      + (int64_t)(k0 / 32 + j) * bb
                                    : ZERO_BLOCK;
            /* the 8 outputs' scales (and mins) side by side, widened in one instruction */
            const __m256 d = _mm256_cvtph_ps(_mm_setr_epi16(
                half_bits(b[0]), half_bits(b[1]), half_bits(b[2]), half_bits(b[3]),
                half_bits(b[4]), half_bits(b[5]), half_bits(b[6]), half_bits(b[7])));
            const __m256 m = type != Q4_1 ? _mm256_setzero_ps() : _mm256_cvtph_ps(_mm_setr_epi16(
                half_bits(b[0] + 2), half_bits(b[1] + 2), half_bits(b[2] + 2),
                half_bits(b[3] + 2), half_bits(b[4] + 2), half_bits(b[5] + 2),
                half_bits(b[6] + 2), half_bits(b[7] + 2)));
            float *rows = panel + 32 * j * NR + g;
            for (int half = 0; half < (type == Q8_0 ? 2 : 1); half++) {
                __m128i r[8], t[8];
                for (int o = 0; o < 8; o++)
                    r[o] = _mm_loadu_si128((const __m128i *)(b[o] + q0 + 16 * half));
                transpose_bytes(r, t);
                for (int i = 0; i < 8; i++) {
                    const __m128i hi = _mm_unpackhi_epi64(t[i], t[i]);
                    const int e = 2 * i + 16 * half;  /* elements e, e + 1 (and + 16) */
                    panel_row(rows + e * NR, t[i], 0, d, m, type);
                    panel_row(rows + (e + 1) * NR, hi, 0, d, m, type);
                    if (type != Q8_0) {
                        panel_row(rows + (e + 16) * NR, t[i], 4, d, m, type);
                        panel_row(rows + (e + 17) * NR, hi, 4, d, m, type);
                    }
                }
            }
        }
    }
}

/* Lane i of the 8 vectors r[0..7] moved to vector i, lane o from r[o]: an 8 x 8 transpose. */
static inline void transpose8(__m256 *r) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* pack_panel_of for Q5_1, the K-quants and the dense types, whose values do not sit one to a byte
 * or nibble: each output's chunk dequantized as the loader does (chunk_values times its
 * scale, + its min: two roundings), then eight outputs' chunks transposed into the panel. */
static ALWAYS_INLINE void pack_panel_chunks(const uint8_t *w, int64_t row_bytes, int type,
                                            int n0, int have, int k0, int kc, float *panel) {
    for (int g = 0; g < NR; g += 8)
        for (int j = k0 / 32; j < (k0 + kc) / 32; j++) {
            __m256 t[4][8];  /* [8 weights of the chunk][output] */
            for (int o = 0; o < 8; o++) {
                if (g + o >= have) {
                    for (int c = 0; c < 4; c++) t[c][o] = _mm256_setzero_ps();
                    continue;
                }
                const uint8_t *row = w + (int64_t)(n0 + g + o) * row_bytes;
                __m256 v[4];
                float ds[2], ms;
                chunk_values(row, type, j, v);
                chunk_scales(row, type, j, ds, &ms);
                for (int c = 0; c < 4; c++) {
                    t[c][o] = _mm256_mul_ps(v[c], _mm256_set1_ps(ds[c >> 1]));
                    if (has_min(type)) t[c][o] = _mm256_add_ps(t[c][o], _mm256_set1_ps(ms));
                }
            }
            float *rows = panel + (32 * j - k0) * NR + g;
            for (int c = 0; c < 4; c++) {
                transpose8(t[c]);
                for (int i = 0; i < 8; i++) _mm256_store_ps(rows + (8 * c + i) * NR, t[c][i]);
            }
        }
}

/* One specialisation a block type (no type tests a panel row). Not inlined: inlined into
 * panels() it slowed the register tiles (docs/results/design-notes#panel-packing). */
static __attribute__((noinline)) void pack_panel(const uint8_t *w, int64_t row_bytes,
                                                 int type, int n0, int have, int k0, int kc,
                                                 float *panel) {
    switch (type) {
    case Q4_0: pack_panel_of(w, row_bytes, Q4_0, n0, have, k0, kc, panel); break;
    case Q4_1: pack_panel_of(w, row_bytes, Q4_1, n0, have, k0, kc, panel); break;
    case Q8_0: pack_panel_of(w, row_bytes, Q8_0, n0, have, k0, kc, panel); break;
    case Q5_1: pack_panel_chunks(w, row_bytes, Q5_1, n0, have, k0, kc, panel); break;
    case Q4_K: pack_panel_chunks(w, row_bytes, Q4_K, n0, have, k0, kc, panel); break;
    case Q5_K: pack_panel_chunks(w, row_bytes, Q5_K, n0, have, k0, kc, panel); break;
    case Q6_K: pack_panel_chunks(w, row_bytes, Q6_K, n0, have, k0, kc, panel); break;
    case F32: pack_panel_chunks(w, row_bytes, F32, n0, have, k0, kc, panel); break;
    case F16: pack_panel_chunks(w, row_bytes, F16, n0, have, k0, kc, panel); break;
    default: pack_panel_chunks(w, row_bytes, BF16, n0, have, k0, kc, panel); break;
    }
}

/* c[m][..] += x[m][k0 .. k0 + kc) . panel for the M <= MR rows of x from its row m; c is
 * [M][NR], contiguous (a strip's sums, in L1). */
static ALWAYS_INLINE void tile(int M, const float *x, int64_t x_stride, const float *panel,
                               int kc, float *c) {
    __m256 acc[MR][2];
    for (int m = 0; m < M; m++)
        for (int v = 0; v < 2; v++) acc[m][v] = _mm256_load_ps(c + m * NR + 8 * v);
    for (int kk = 0; kk < kc; kk++) {
        const __m256 b0 = _mm256_load_ps(panel + kk * NR);
        const __m256 b1 = _mm256_load_ps(panel + kk * NR + 8);
        for (int m = 0; m < M; m++) {
            const __m256 a = _mm256_broadcast_ss(x + m * x_stride + kk);
            acc[m][0] = _mm256_fmadd_ps(a, b0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(a, b1, acc[m][1]);
        }
    }
    for (int m = 0; m < M; m++)
        for (int v = 0; v < 2; v++) _mm256_store_ps(c + m * NR + 8 * v, acc[m][v]);
}

#define TILE(M) tile(M, xm, x_stride, panel, kc, c + (m - m0) * NR)

static int panels(const float *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes,
                  int type, const float *bias, float *y, int64_t y_stride, int rows, int n,
                  int k, int threads) {
    const int strips = (n + NR - 1) / NR;
    /* MC rows of x at a time: each KC slice of a strip's panel is dequantized once per MC rows,
     * so MC is as many rows as the strip's sums hold, whatever k (the slice of x a panel meets,
     * MC x KC, stays in L2). Sizing MC to keep all of x's k in L2 made it 6 rows at k = 8192,
     * every weight dequantized again each 6 rows (docs/results/design-notes#panel-packing). */
    const int mc = rows < MAX_MC ? (rows + MR - 1) / MR * MR : MAX_MC;
    float *buf = aligned_alloc(32, sizeof(float) * (size_t)threads * (KC + mc) * NR);
    if (buf == NULL) return -2;
    #pragma omp parallel num_threads(threads)
    {
        int s0, s1, t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        float *panel = buf + (size_t)t * (KC + mc) * NR, *c = panel + KC * NR;
        thread_share(strips, &s0, &s1);
        for (int m0 = 0; m0 < rows; m0 += mc) {
            const int m1 = rows - m0 < mc ? rows : m0 + mc;
            for (int s = s0; s < s1; s++) {
                const int n0 = s * NR, have = n - n0 < NR ? n - n0 : NR;
                memset(c, 0, sizeof(float) * (m1 - m0) * NR);
                /* the next strip's blocks (NR rows, contiguous), asked for a few lines after
                 * each register tile, so they are in cache when it is packed */
                const char *next = (const char *)(w + (int64_t)(n0 + NR) * row_bytes);
                const int lines = s + 1 < s1 ? (int)((NR * row_bytes + 63) / 64) : 0;
                const int calls = (k + KC - 1) / KC * ((m1 - m0) / MR);
                const int per = calls ? (lines + calls - 1) / calls : lines;
                int asked = 0;
                for (int k0 = 0; k0 < k; k0 += KC) {
                    const int kc = k - k0 < KC ? k - k0 : KC;
                    pack_panel(w, row_bytes, type, n0, have, k0, kc, panel);
                    int m = m0;
                    for (; m + MR <= m1; m += MR) {
                        const float *xm = x + m * x_stride + k0;
                        TILE(MR);
                        for (int i = 0; i < per && asked < lines; i++, asked++)
                            _mm_prefetch(next + 64 * asked, _MM_HINT_T0);
                    }
                    for (; calls == 0 && asked < lines; asked++)  /* no full tile to wait on */
                        _mm_prefetch(next + 64 * asked, _MM_HINT_T0);
                    const float *xm = x + m * x_stride + k0;
                    switch (m1 - m) {
                    case 1: TILE(1); break;
                    case 2: TILE(2); break;
                    case 3: TILE(3); break;
                    case 4: TILE(4); break;
                    case 5: TILE(5); break;
                    }
                }
                for (int m = m0; m < m1; m++)  /* y written once */
                    for (int i = 0; i < have; i++)
                        y[m * y_stride + n0 + i] = c[(m - m0) * NR + i]
                                                   + (bias != NULL ? bias[n0 + i] : 0.0f);
            }
        }
    }
    free(buf);
    return 0;
}

/* One row keeps two chains of each sum, unless each row's sums must be in the same order at
 * every row count (batch invariance). */
#define CASE(R, T) case R: if (R == 1 && !invariant) \
        rows_times_blocks(R, 2, T, x, x_stride, k, xsum, w, row_bytes, bias, y, y_stride, n0, n1); \
    else rows_times_blocks(R, 1, T, x, x_stride, k, xsum, w, row_bytes, bias, y, y_stride, n0, n1); \
    break;
#define ROWS(T) switch (rows) { CASE(1, T) CASE(2, T) CASE(3, T) CASE(4, T) CASE(5, T) CASE(6, T) }

/* y = x w^T (+ bias). x: [rows, k], y: [rows, n] float32 (row strides given), w: n rows of
 * k weights in blocks of `type`, row_bytes apart; bias: [n] or NULL. invariant: each row's
 * result the same whatever the other rows (the few-rows path, one chain, FEW_ROWS rows at a
 * time, at any row count). Returns -1 for a type or shape it does not handle, -2 without memory
 * for its scratch. */
int quant_linear_f32(const float *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes,
                     int type, const float *bias, float *y, int64_t y_stride, int rows, int n,
                     int k, int invariant, int threads) {
    if (!reads_type(type) || k % values_per_block(type) != 0 || rows < 1) return -1;
    if (invariant && rows > FEW_ROWS) {
        int rc = 0;
        for (int m0 = 0; m0 < rows && rc == 0; m0 += FEW_ROWS)
            rc = quant_linear_f32(x + m0 * x_stride, x_stride, w, row_bytes, type, bias,
                                  y + m0 * y_stride, y_stride,
                                  rows - m0 < FEW_ROWS ? rows - m0 : FEW_ROWS, n, k, 1, threads);
        return rc;
    }
    if (rows > FEW_ROWS)
        return panels(x, x_stride, w, row_bytes, type, bias, y, y_stride, rows, n, k, threads);
    const int chunks = k / 32;
    float *xsum = aligned_alloc(32, sizeof(float) * 8 * rows * chunks);
    if (xsum == NULL) return -2;
    for (int r = 0; r < rows; r++)  /* each chunk of x folded to 8 lanes: its min's factor */
        for (int j = 0; j < chunks; j++) {
            const float *xr = x + r * x_stride + 32 * j;
            _mm256_store_ps(xsum + (r * chunks + j) * 8,
                            _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xr),
                                                        _mm256_loadu_ps(xr + 8)),
                                          _mm256_add_ps(_mm256_loadu_ps(xr + 16),
                                                        _mm256_loadu_ps(xr + 24))));
        }
    #pragma omp parallel num_threads(threads)
    {
        int n0, n1;
        thread_share(n, &n0, &n1);
        switch (type) {
        case Q4_0: ROWS(Q4_0) break;
        case Q4_1: ROWS(Q4_1) break;
        case Q5_1: ROWS(Q5_1) break;
        case Q8_0: ROWS(Q8_0) break;
        case Q4_K: ROWS(Q4_K) break;
        case Q5_K: ROWS(Q5_K) break;
        case Q6_K: ROWS(Q6_K) break;
        case F32: ROWS(F32) break;
        case F16: ROWS(F16) break;
        default: ROWS(BF16) break;
        }
    }
    free(xsum);
    return 0;
}
