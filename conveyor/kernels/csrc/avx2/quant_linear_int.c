/* The block linear on integer activations (--activation-quant) with AVX2: the numerics of
 * generic/quant_linear_int.c (its comment has the formula), without VNNI.
 *
 * int8 on the K-quants (Q8_K: a scale per 256 activations) reads them repacked at load
 * (repacked.h, avx2/repack.c): a pass takes 8 weight rows and up to X8_ROWS activation rows.
 * For each chunk of 32 weights it unpacks the 8 rows' values once into 8 vectors, then every
 * activation row takes them: pmaddubsw multiplies 32 unsigned weight bytes (4 rows x 8 values)
 * by a broadcast of 8 activation bytes, and the 16-bit pairs of a chunk's steps add up in
 * 16 bits (Q4_K, Q5_K: 4 steps; Q6_K: the 2 of a scale's 16 values stay within int16:
 * |q| <= 63, |p| <= 127); pmaddwd by the sub-block's integer scale takes them to int32, which
 * add up through the super-block. There one hadd puts the 8 rows' sums in a vector, scaled
 * once by their d and the activations' scale; the mins' (Q6_K: offsets') share is an integer
 * dot product of the 8 rows' mins with the activations' sums a chunk (Q6_K: a 16th), the
 * offsets' folded into the sums. A few-row call is bound by reading the weights, which it
 * prefetches ahead; with more rows the integer products bound it.
 *
 * Every other call (the 32-weight types; int16; a K-quant's blocks as stored) unpacks OB
 * weight rows at a time, with vector shifts and masks, into bytes (the type's offset taken
 * off: Q4_0's 8; Q6_K's 0 .. 63 as stored, its offset a min) and a factor per half-chunk; then
 * every group of RT activation rows passes those rows while both stay in cache, chunk by
 * chunk: int8 as pmaddubsw of the weights' magnitudes (as they are where the type stores no
 * negative one) and the activations carrying the weights' signs (psignb), as llama.cpp's AVX2
 * dot products do, then pmaddwd by ones; int16 (15 bits) with the weights widened, pmaddwd.
 * Each chunk's int32 lanes become float32 and take d * s; the mins' (Q6_K: offsets') share is
 * m . (s * sum(p)); lanes are summed once per output value.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "common.h"
#include "int_activations.h"
#include "repacked.h"

#define RT 4   /* activation rows a pass of unpacked rows takes (1, 2 or 4) */
#define OB 16  /* weight rows unpacked at a time and passed by every group of RT rows */
#define X8_ROWS 32  /* activation rows a pass of a repacked group takes (its sums in L1) */
#define X8_SPAN (256 << 10)  /* bytes of activation rows a thread's groups take in turn (in L2) */
#define PREFETCH 4096  /* bytes ahead a pass prefetches the repacked weights it reads */

/* x's rows as integers, as generic/quant_linear_int.c's int_rows quantizes them (the same
 * roundings, so not under fast math): p8 (int8) or p16 (int16) [rows][k], s (each chunk's
 * run's scale) and sp (s * sum(p)) [rows][k / 32], and for Q6_K sp16, s * sum(p) a half-chunk
 * [rows][k / 16] (what its offsets multiply); for the repacked K-quants p8 by super-block,
 * [k / 256][rows][256] (a pass's rows side by side, not a power of two apart: they would
 * share a few L1 sets), and the integer sums, b32 a chunk [rows][k / 32] and b16 a half-chunk
 * [rows][k / 16]. */
typedef struct {
    int rows;
    int8_t *p8;
    int16_t *p16, *b16, *b32;
    float *s, *sp, *sp16;
} Acts;

static void acts_free(Acts *a) {
    free(a->p8);
    free(a->p16);
    free(a->b16);
    free(a->b32);
    free(a->s);
    free(a->sp);
    free(a->sp16);
}

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1)));
}

__attribute__((optimize("no-fast-math")))
static int acts_of(Acts *a, const void *x, int64_t x_stride, int rows, int k, int levels,
                   int type, int threads) {
    const int chunks = k / 32, run = activation_run(stored_type(type), levels);
    memset(a, 0, sizeof *a);
    a->rows = rows;
    if (levels > 127) a->p16 = aligned_alloc(32, (size_t)rows * k * 2);
    else a->p8 = aligned_alloc(32, (size_t)rows * k);
    a->s = malloc((size_t)rows * chunks * sizeof(float));
    a->sp = malloc((size_t)rows * chunks * sizeof(float));
    if (type == Q6_K) a->sp16 = malloc((size_t)rows * chunks * 2 * sizeof(float));
    if (is_repacked(type)) {
        a->b16 = malloc((size_t)rows * chunks * 2 * sizeof(int16_t));
        a->b32 = malloc((size_t)rows * chunks * sizeof(int16_t));
    }
    if ((a->p8 == NULL && a->p16 == NULL) || a->s == NULL || a->sp == NULL
        || (type == Q6_K && a->sp16 == NULL)
        || (is_repacked(type) && (a->b16 == NULL || a->b32 == NULL))) {
        acts_free(a);
        return -2;
    }
    const __m256 sign = _mm256_set1_ps(-0.0f);
    #pragma omp parallel for num_threads(rows > 1 ? threads : 1) schedule(static)
    for (int r = 0; r < rows; r++) {
        float run_amax = 0.0f;
        for (int j = 0; j < chunks; j++) {
            if (run > 32 && 32 * j % run == 0)
                run_amax = magnitude_of(x, r * x_stride + 32 * j, 0, run);
            const float *xe = (const float *)x + r * x_stride + 32 * j;
            __m256 v[4], top = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xe + 8 * i);
                top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
            }
            __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
            t = _mm_max_ps(t, _mm_movehl_ps(t, t));
            t = _mm_max_ss(t, _mm_movehdup_ps(t));
            const float amax = run > 32 ? run_amax : _mm_cvtss_f32(t);
            const float scale = amax / (float)levels;
            const __m256 inverse = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
            __m256i p[4];
            for (int i = 0; i < 4; i++)  /* to nearest, halves to even, as rintf */
                p[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
            const int32_t lo = hsum_epi32(_mm256_add_epi32(p[0], p[1]));
            const int32_t hi = hsum_epi32(_mm256_add_epi32(p[2], p[3]));
            const int64_t at = (int64_t)r * chunks + j;
            a->s[at] = scale;
            a->sp[at] = scale * (float)(lo + hi);
            if (a->sp16 != NULL) {
                a->sp16[2 * at] = scale * (float)lo;
                a->sp16[2 * at + 1] = scale * (float)hi;
            }
            if (a->b16 != NULL) {  /* (|sum| <= 32 * 127) */
                a->b16[2 * at] = (int16_t)lo;
                a->b16[2 * at + 1] = (int16_t)hi;
                a->b32[at] = (int16_t)(lo + hi);
            }
            /* packs interleave 128-bit lanes: the permutation puts the values back in order */
            const __m256i w01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(p[0], p[1]), 0xd8);
            const __m256i w23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(p[2], p[3]), 0xd8);
            if (a->p16 != NULL) {
                _mm256_store_si256((__m256i *)(a->p16 + (int64_t)r * k + 32 * j), w01);
                _mm256_store_si256((__m256i *)(a->p16 + (int64_t)r * k + 32 * j + 16), w23);
            } else {
                const int64_t to = is_repacked(type)
                    ? ((int64_t)(j / 8) * rows + r) * 256 + 32 * (j % 8) : (int64_t)r * k + 32 * j;
                _mm256_store_si256((__m256i *)(a->p8 + to),
                                   _mm256_permute4x64_epi64(_mm256_packs_epi16(w01, w23), 0xd8));
            }
        }
    }
    return 0;
}

/* Byte e all ones where bit e of x is set (llama.cpp's bytes_from_bits_32). */
static inline __m256i bit_bytes(uint32_t x) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), _mm256_set_epi64x(
        0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    return _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                             _mm256_set1_epi64x(-1));
}

static inline __m256i nibbles(__m256i v, int high) {
    return _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
}

/* A K-quant super-block's factors: d [16], each half-chunk's factor as float32; m, Q4_K/Q5_K:
 * [8] the chunks' mins, Q6_K: [16] the half-chunks' offsets (-32 d). */
static ALWAYS_INLINE void k_scales(const uint8_t *b, int type, float *d, float *m) {
    if (type == Q6_K) {
        const float dd = half_load(b + 208);
        for (int i = 0; i < 16; i++) {
            d[i] = dd * (float)(int8_t)b[192 + i];
            m[i] = -32.0f * d[i];
        }
        return;
    }
    uint32_t u[4];
    k_scales_mins(b, u);
    const uint8_t *sm = (const uint8_t *)u;
    const float dd = half_load(b), dmin = half_load(b + 2);
    for (int j = 0; j < 8; j++) {
        d[2 * j] = d[2 * j + 1] = dd * (float)sm[j];
        m[j] = -(dmin * (float)sm[8 + j]);
    }
}

/* Chunk j (0 .. 7) of a K-quant super-block as 32 bytes, chunk_quants' integers (Q6_K's 0 ..
 * 63 as stored, its offset left to its m). */
static ALWAYS_INLINE __m256i k_chunk(const uint8_t *b, int type, int j) {
    if (type == Q6_K) {  /* chunk_quants' layout */
        const int h = j >> 2, t = j & 3;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (t & 1)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(
            _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t)), _mm256_set1_epi8(3)), 4);
        return _mm256_or_si256(nibbles(ql, t >> 1), hi);
    }
    __m256i v = nibbles(_mm256_loadu_si256((const __m256i *)(
        b + (type == Q4_K ? 16 : 48) + 32 * (j >> 1))), j & 1);
    if (type == Q5_K) {
        const __m256i fifth = _mm256_loadu_si256((const __m256i *)(b + 16));
        const __m256i bit = _mm256_set1_epi8((char)(1 << j));
        v = _mm256_or_si256(v, _mm256_and_si256(_mm256_cmpeq_epi8(
            _mm256_and_si256(fifth, bit), bit), _mm256_set1_epi8(16)));
    }
    return v;
}

/* One weight row unpacked: q [k] bytes, d [2 * chunks] (each half-chunk's factor) and m (the
 * mins, has_min types: [chunks]; Q6_K's offset, -32 d a half-chunk: [2 * chunks]). The
 * integers are chunk_quants', signed with the offset taken off (Q4_0's 8), except Q6_K's: its
 * 0 .. 63 as stored. The factors are chunk_scales'. */
static ALWAYS_INLINE void unpack_row(const uint8_t *row, int type, int chunks, int8_t *q,
                                     float *d, float *m) {
    if (is_k_quant(type)) {
        for (int sb = 0; sb < chunks / 8; sb++) {
            const uint8_t *b = row + (int64_t)sb * stored_block_bytes(type);
            k_scales(b, type, d + 16 * sb, m + (type == Q6_K ? 16 : 8) * sb);
            for (int j = 0; j < 8; j++)
                _mm256_storeu_si256((__m256i *)(q + 256 * sb + 32 * j), k_chunk(b, type, j));
        }
        return;
    }
    const int bytes = stored_block_bytes(type), at = stored_values_at(type);
    for (int j = 0; j < chunks; j++) {
        const uint8_t *b = row + (int64_t)j * bytes;
        d[2 * j] = d[2 * j + 1] = half_load(b);
        if (has_min(type)) m[j] = half_load(b + 2);
        __m256i v;
        if (type == Q8_0) {
            v = _mm256_loadu_si256((const __m256i *)(b + at));
        } else {
            const __m128i qs = _mm_loadu_si128((const __m128i *)(b + at));
            v = nibbles(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), 0);
            if (type == Q5_1) {
                uint32_t qh;
                memcpy(&qh, b + at - 4, 4);
                v = _mm256_or_si256(v, _mm256_and_si256(bit_bytes(qh), _mm256_set1_epi8(16)));
            }
            if (type == Q4_0) v = _mm256_sub_epi8(v, _mm256_set1_epi8(8));
        }
        _mm256_storeu_si256((__m256i *)(q + 32 * j), v);
    }
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* A row on activations of a scale a chunk, into acc[t]: each chunk's int32 lanes become float32
 * and take d * s. */
static ALWAYS_INLINE void pass_chunks(const int8_t *q, const float *d, int type, int chunks,
                                     int k, const Acts *a, int r0, int rt, int wide,
                                     __m256 *acc) {
    /* the types whose stored integers are never negative take pmaddubsw without signs */
    const int unsigned_q = has_min(type) || type == Q6_K;
    for (int j = 0; j < chunks; j++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(q + 32 * j));
        /* lanes 0-3: the chunk's first 16 values; 4-7: the last 16 */
        const __m256 dj = _mm256_set_m128(_mm_set1_ps(d[2 * j + 1]), _mm_set1_ps(d[2 * j]));
        if (wide) {
            const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
            const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
            #pragma GCC unroll 4
            for (int t = 0; t < rt; t++) {
                const int16_t *p = a->p16 + (int64_t)(r0 + t) * k + 32 * j;
                const __m256i lo = _mm256_madd_epi16(w0, _mm256_load_si256((const __m256i *)p));
                const __m256i hi = _mm256_madd_epi16(
                    w1, _mm256_load_si256((const __m256i *)(p + 16)));
                /* lo's lanes hold values 0-15 in pairs, hi's 16-31: pair them up by halves */
                const __m256i dot = _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20),
                                                     _mm256_permute2x128_si256(lo, hi, 0x31));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(
                    dj, _mm256_set1_ps(a->s[(int64_t)(r0 + t) * chunks + j])), acc[t]);
            }
        } else {
            const __m256i magnitude = unsigned_q ? w : _mm256_abs_epi8(w);
            #pragma GCC unroll 4
            for (int t = 0; t < rt; t++) {
                const __m256i p = _mm256_load_si256(
                    (const __m256i *)(a->p8 + (int64_t)(r0 + t) * k + 32 * j));
                const __m256i pairs = _mm256_maddubs_epi16(
                    magnitude, unsigned_q ? p : _mm256_sign_epi8(p, w));
                const __m256i dot = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(
                    dj, _mm256_set1_ps(a->s[(int64_t)(r0 + t) * chunks + j])), acc[t]);
            }
        }
    }
}

/* An unpacked weight row against activation rows r0 .. r0 + rt: out[t] its dots (no bias).
 * `type`, `rt` and `wide` (int16 activations) are constants in each caller. */
static ALWAYS_INLINE void pass(const int8_t *q, const float *d, const float *m, int type,
                              int chunks, int k, const Acts *a, int r0, int rt, int wide,
                              float *out) {
    __m256 acc[RT];
    for (int t = 0; t < RT; t++) acc[t] = _mm256_setzero_ps();
    pass_chunks(q, d, type, chunks, k, a, r0, rt, wide, acc);
    /* the mins' share: m . (s * sum(p)) over the chunks (Q6_K: its offsets, half-chunks) */
    const int groups = type == Q6_K ? 2 * chunks : chunks;
    for (int t = 0; t < rt; t++) {
        float rest = 0.0f;
        if (has_min(type) || type == Q6_K) {
            const float *sp = type == Q6_K ? a->sp16 + (int64_t)(r0 + t) * groups
                                           : a->sp + (int64_t)(r0 + t) * chunks;
            int j = 0;
            for (; j + 8 <= groups; j += 8)
                acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(m + j), _mm256_loadu_ps(sp + j), acc[t]);
            for (; j < groups; j++) rest += m[j] * sp[j];
        }
        out[t] = hsum(acc[t]) + rest;
    }
}

#define PASS_TYPE(RTC, WIDE) \
    switch (type) { \
    case Q4_0: pass(q, d, m, Q4_0, chunks, k, a, r0, RTC, WIDE, out); break; \
    case Q4_1: pass(q, d, m, Q4_1, chunks, k, a, r0, RTC, WIDE, out); break; \
    case Q5_1: pass(q, d, m, Q5_1, chunks, k, a, r0, RTC, WIDE, out); break; \
    case Q8_0: pass(q, d, m, Q8_0, chunks, k, a, r0, RTC, WIDE, out); break; \
    case Q4_K: pass(q, d, m, Q4_K, chunks, k, a, r0, RTC, WIDE, out); break; \
    case Q5_K: pass(q, d, m, Q5_K, chunks, k, a, r0, RTC, WIDE, out); break; \
    default: pass(q, d, m, Q6_K, chunks, k, a, r0, RTC, WIDE, out); break; \
    }

static void pass_rows(const int8_t *q, const float *d, const float *m, int type, int chunks,
                      int k, const Acts *a, int r0, int rt, float *out) {
    if (a->p16 != NULL) {
        if (rt == 4) { PASS_TYPE(4, 1) } else if (rt == 2) { PASS_TYPE(2, 1) }
        else { PASS_TYPE(1, 1) }
    } else {
        if (rt == 4) { PASS_TYPE(4, 0) } else if (rt == 2) { PASS_TYPE(2, 0) }
        else { PASS_TYPE(1, 0) }
    }
}

/* The unpacking, with the type a constant. */
static void unpack_rows(const uint8_t *w, int64_t row_bytes, int type, int chunks, int o0,
                        int count, int8_t *q, float *d, float *m) {
    for (int i = 0; i < count; i++) {
        const uint8_t *row = w + (int64_t)(o0 + i) * row_bytes;
        int8_t *qi = q + (int64_t)i * 32 * chunks;
        float *di = d + (int64_t)i * 2 * chunks, *mi = m + (int64_t)i * 2 * chunks;
        switch (type) {
        case Q4_0: unpack_row(row, Q4_0, chunks, qi, di, mi); break;
        case Q4_1: unpack_row(row, Q4_1, chunks, qi, di, mi); break;
        case Q5_1: unpack_row(row, Q5_1, chunks, qi, di, mi); break;
        case Q8_0: unpack_row(row, Q8_0, chunks, qi, di, mi); break;
        case Q4_K: unpack_row(row, Q4_K, chunks, qi, di, mi); break;
        case Q5_K: unpack_row(row, Q5_K, chunks, qi, di, mi); break;
        default: unpack_row(row, Q6_K, chunks, qi, di, mi); break;
        }
    }
}

/* The 8 bytes at b (one a row of a group) as int16 lanes for pmaddwd against a step's low
 * (high: the high) rows' pairs: each row's 4 lanes its byte, zero-extended, or sign-extended
 * (Q6_K's scales). */
static ALWAYS_INLINE __m256i x8_spread(const uint8_t *b, int high, int sign) {
    int64_t v;
    memcpy(&v, b, 8);
    const int *rows = high ? X8_HI : X8_LO;
    int8_t pick[32];
    for (int slot = 0; slot < 4; slot++)
        for (int lane = 0; lane < 4; lane++) {  /* (each 128-bit half picks from its own 8) */
            const int at = 8 * slot + 2 * lane;
            pick[at + sign] = (int8_t)rows[slot];
            pick[at + 1 - sign] = -128;  /* a zero byte */
        }
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi64x(v),
                                               _mm256_loadu_si256((const __m256i *)pick));
    return sign ? _mm256_srai_epi16(spread, 8) : spread;
}

/* Step s (0 .. 3) of chunk j of a group's super-block g: the low rows' and the high rows'
 * values as bytes. */
static ALWAYS_INLINE void x8_step(const uint8_t *g, int type, int j, int s, __m256i *lo,
                                  __m256i *hi) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(
        g + (type == Q6_K ? X8_QL6 : X8_QS) + 128 * j + 32 * s));
    *lo = nibbles(v, 0);
    *hi = nibbles(v, 1);
    if (type == Q5_K) {
        uint32_t bits[2];
        memcpy(bits, g + X8_QH5 + 32 * j + 8 * s, 8);
        const __m256i fifth = _mm256_set1_epi8(16);
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(bit_bytes(bits[0]), fifth));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(bit_bytes(bits[1]), fifth));
    } else if (type == Q6_K) {
        const __m256i top = _mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)(g + X8_QH6 + 64 * j + 16 * s)));
        const __m256i mask = _mm256_set1_epi8(0x30);
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(
            _mm256_sllv_epi32(top, _mm256_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2)), mask));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(
            _mm256_srlv_epi32(top, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)), mask));
    }
}

static ALWAYS_INLINE __m256i broadcast8(const int8_t *p) {
    int64_t v;
    memcpy(&v, p, 8);
    return _mm256_set1_epi64x(v);
}

/* A repacked group (8 weight rows from grp, sbs super-blocks) against activation rows r0 ..
 * r0 + rt: acc[t], the 8 rows' dots in row order (no bias). iacc: 2 rt vectors of scratch. */
static ALWAYS_INLINE void x8_pass(const uint8_t *grp, int type, int sbs, const Acts *a, int r0,
                                  int rt, int k, __m256i *iacc, __m256 *acc) {
    const int gb = 8 * x8_block_bytes(type), chunks = k / 32, q6 = type == Q6_K;
    for (int t = 0; t < rt; t++) acc[t] = _mm256_setzero_ps();
    for (int sb = 0; sb < sbs; sb++) {
        const uint8_t *g = grp + (int64_t)sb * gb;
        for (int at = 0; at < gb; at += 64)
            _mm_prefetch((const char *)g + PREFETCH + at, _MM_HINT_T0);
        /* the scales as pmaddwd takes them: a chunk's (Q6_K: a 16th's) for the low and the
         * high rows */
        __m256i scale[16][2];
        for (int i = 0; i < (q6 ? 16 : 8); i++)
            for (int h = 0; h < 2; h++)
                scale[i][h] = x8_spread(g + (q6 ? X8_SC6 : X8_SC) + 8 * i, h, q6);
        for (int t = 0; t < 2 * rt; t++) iacc[t] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            __m256i w[4][2];
            for (int s = 0; s < 4; s++) x8_step(g, type, j, s, &w[s][0], &w[s][1]);
            for (int t = 0; t < rt; t++) {
                const int8_t *p = a->p8 + ((int64_t)sb * a->rows + r0 + t) * 256 + 32 * j;
                __m256i sum[2];
                for (int s = 0; s < 4; s++) {
                    const __m256i ps = broadcast8(p + 8 * s);
                    for (int h = 0; h < 2; h++) {
                        const __m256i pairs = _mm256_maddubs_epi16(w[s][h], ps);
                        sum[h] = s % (q6 ? 2 : 4) ? _mm256_add_epi16(sum[h], pairs) : pairs;
                    }
                    if (s % (q6 ? 2 : 4) == (q6 ? 1 : 3))
                        for (int h = 0; h < 2; h++)
                            iacc[2 * t + h] = _mm256_add_epi32(iacc[2 * t + h], _mm256_madd_epi16(
                                sum[h], scale[q6 ? 2 * j + s / 2 : j][h]));
                }
            }
        }
        /* the mins' (Q6_K: offsets') share: each pair of chunks' (16ths') row values against
         * the activations' sums of them */
        __m256i mins[8];
        for (int i = 0; i < (q6 ? 8 : 4); i++) {
            const uint8_t *m = g + (q6 ? X8_SC6 : X8_MN) + 16 * i;
            const __m128i pair = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)m),
                                                   _mm_loadl_epi64((const __m128i *)(m + 8)));
            mins[i] = q6 ? _mm256_cvtepi8_epi16(pair) : _mm256_cvtepu8_epi16(pair);
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + X8_D)));
        const __m256 dmin = q6 ? d : _mm256_cvtph_ps(
            _mm_loadu_si128((const __m128i *)(g + X8_DMIN)));
        for (int t = 0; t < rt; t++) {
            const int16_t *bs = q6 ? a->b16 + (int64_t)(r0 + t) * 2 * chunks + 16 * sb
                                   : a->b32 + (int64_t)(r0 + t) * chunks + 8 * sb;
            __m256i off = _mm256_setzero_si256();
            for (int i = 0; i < (q6 ? 8 : 4); i++) {
                int32_t two;
                memcpy(&two, bs + 2 * i, 4);
                off = _mm256_add_epi32(off, _mm256_madd_epi16(mins[i], _mm256_set1_epi32(two)));
            }
            __m256i dots = _mm256_hadd_epi32(iacc[2 * t], iacc[2 * t + 1]);
            const __m256 s = _mm256_set1_ps(a->s[(int64_t)(r0 + t) * chunks + 8 * sb]);
            if (q6) {  /* (q - 32) . p */
                dots = _mm256_sub_epi32(dots, _mm256_slli_epi32(off, 5));
            } else {
                acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(off), _mm256_mul_ps(dmin, s),
                                          acc[t]);
            }
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(d, s), acc[t]);
        }
    }
}

#define X8_TYPE(RTC) \
    switch (type) { \
    case Q4_K: x8_pass(grp, Q4_K, sbs, a, r0, RTC, k, iacc, acc); break; \
    case Q5_K: x8_pass(grp, Q5_K, sbs, a, r0, RTC, k, iacc, acc); break; \
    default: x8_pass(grp, Q6_K, sbs, a, r0, RTC, k, iacc, acc); break; \
    }

/* x8_pass with the type a constant, and a decode's few rows too. */
static void x8_rows(const uint8_t *grp, int type, int sbs, const Acts *a, int r0, int rt, int k,
                    __m256i *iacc, __m256 *acc) {
    if (rt == 1) { X8_TYPE(1) } else if (rt == 2) { X8_TYPE(2) } else if (rt == 3) { X8_TYPE(3) }
    else if (rt == 4) { X8_TYPE(4) } else { X8_TYPE(rt) }
}

/* y = x w^T (+ bias) on the repacked weights w (of stored type `type`, groups of 8 rows
 * 8 row_bytes apart) and the int8 activations a. */
static void repacked_linear(const Acts *a, const uint8_t *w, int64_t row_bytes, int type,
                            const void *bias, void *y, int64_t y_stride, int rows, int n, int k,
                            int threads) {
    const int groups = (n + 7) / 8;
    const int span_rows = X8_SPAN / k > X8_ROWS ? X8_SPAN / k / X8_ROWS * X8_ROWS : X8_ROWS;
    #pragma omp parallel num_threads(threads)
    {
        __m256i iacc[2 * X8_ROWS];
        __m256 acc[X8_ROWS];
        int g0, g1;
        thread_share(groups, &g0, &g1);
        for (int span = 0; span < rows; span += span_rows)
            for (int g = g0; g < g1; g++) {
                const uint8_t *grp = w + (int64_t)g * 8 * row_bytes;
                const int valid = n - 8 * g < 8 ? n - 8 * g : 8;
                float b[8] = {0};
                if (bias != NULL) memcpy(b, (const float *)bias + 8 * g, valid * sizeof(float));
                const __m256 bv = _mm256_loadu_ps(b);
                const int end = rows < span + span_rows ? rows : span + span_rows;
                for (int r0 = span; r0 < end; r0 += X8_ROWS) {
                    const int rt = end - r0 < X8_ROWS ? end - r0 : X8_ROWS;
                    x8_rows(grp, type, k / 256, a, r0, rt, k, iacc, acc);
                    for (int t = 0; t < rt; t++) {
                        float *out = (float *)y + (int64_t)(r0 + t) * y_stride + 8 * g;
                        const __m256 v = _mm256_add_ps(acc[t], bv);
                        if (valid == 8) {
                            _mm256_storeu_ps(out, v);
                        } else {
                            float part[8];
                            _mm256_storeu_ps(part, v);
                            memcpy(out, part, valid * sizeof(float));
                        }
                    }
                }
            }
    }
}
static int quant_linear_int(const void *x, int64_t x_stride, int bf16, const uint8_t *w,
                            int64_t row_bytes, int type, const void *bias, void *y,
                            int64_t y_stride, int rows, int n, int k, int levels, int threads) {
    if (is_repacked(type)) {
        if (bf16 || levels != 127 || x8_block_bytes(stored_type(type)) == 0 || k % 256
            || rows < 1)
            return -1;
    } else if (bf16 || !int_linear_takes(type, k, rows, levels)) {
        return -1;
    }
    const int chunks = k / 32;
    Acts a;
    if (acts_of(&a, x, x_stride, rows, k, levels, type, threads) != 0) return -2;
    if (is_repacked(type)) {
        repacked_linear(&a, w, row_bytes, stored_type(type), bias, y, y_stride, rows, n, k,
                        threads);
        acts_free(&a);
        return 0;
    }
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        int8_t *q = malloc((size_t)OB * k);
        float *d = malloc((size_t)OB * 2 * chunks * sizeof(float));
        float *m = malloc((size_t)OB * 2 * chunks * sizeof(float));
        int n0, n1;
        thread_share(n, &n0, &n1);
        if (q == NULL || d == NULL || m == NULL) failed = 1;
        for (int ob = n0; !failed && ob < n1; ob += OB) {
            const int count = n1 - ob < OB ? n1 - ob : OB;
            unpack_rows(w, row_bytes, type, chunks, ob, count, q, d, m);
            for (int r0 = 0; r0 < rows;) {
                const int left = rows - r0, rt = left >= 4 ? 4 : left >= 2 ? 2 : 1;
                for (int i = 0; i < count; i++) {
                    float out[RT];
                    pass_rows(q + (int64_t)i * k, d + (int64_t)i * 2 * chunks,
                              m + (int64_t)i * 2 * chunks, type, chunks, k, &a, r0, rt, out);
                    const float b = bias != NULL ? ((const float *)bias)[ob + i] : 0.0f;
                    for (int t = 0; t < rt; t++)
                        ((float *)y)[(int64_t)(r0 + t) * y_stride + ob + i] = out[t] + b;
                }
                r0 += rt;
            }
        }
        free(q);
        free(d);
        free(m);
    }
    acts_free(&a);
    return failed ? -2 : 0;
}

INT_LINEAR_F32(quant_linear_int)
