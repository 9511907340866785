/* The block linear on integer activations (--activation-quant) with AVX2: the numerics of
 * generic/quant_linear_int.c (its comment has the formula), without VNNI.
 *
 * A thread takes OB weight rows at a time and unpacks each once, with vector shifts and masks,
 * into bytes (the type's offset taken off: Q4_0's 8; Q6_K's 0 .. 63 as stored, its offset a
 * min) and its factors; then every group of RT activation rows passes those OB rows while
 * both stay in cache. A call of at most RT rows on the K-quants has nothing to share an
 * unpacking with: it reads the blocks as stored (pass_stored), prefetched ahead.
 *
 * int8 activations: pmaddubsw multiplies 32 unsigned bytes by 32 signed ones, two products a
 * 16-bit lane (within it: |q| <= 128, |p| <= 127). The weights are the unsigned side: as they
 * are where the type stores no negative one, else their magnitudes, the activations taking the
 * weights' signs (psignb), as llama.cpp's AVX2 dot products do.
 * - The K-quants (Q8_K: a scale per 256 activations): pmaddwd multiplies the pairs by the
 *   sub-block's integer scale, and the int32 lanes add up through the super-block; one
 *   conversion and FMA by d * s per 256 weights (llama.cpp's q4_K x q8_K). The mins' (Q6_K:
 *   offsets') share is m . (s * sum(p)), a float FMA per 8 (Q6_K: 16) chunks' worth.
 * - The other types (Q8_0: a scale per 32): pmaddwd by ones; each chunk's int32 lanes become
 *   float32 and take d * s.
 * int16 activations (15 bits): the weights widened to 16 bits, pmaddwd, 16 products an
 * instruction, a chunk's lanes to float32 as for Q8_0. Lanes are summed once per output value.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "common.h"
#include "int_activations.h"

#define RT 4   /* activation rows a pass takes (1, 2 or 4) */
#define PREFETCH 4096  /* bytes ahead a few-row call prefetches the blocks it reads */
#define OB 16  /* weight rows unpacked at a time and passed by every group of RT rows */

/* x's rows as integers, as generic/quant_linear_int.c's int_rows quantizes them (the same
 * roundings, so not under fast math): p8 (int8) or p16 (int16) [rows][k], s (each chunk's
 * run's scale) and sp (s * sum(p)) [rows][k / 32], and for Q6_K sp16, s * sum(p) a half-chunk
 * [rows][k / 16] (what its offsets multiply). */
typedef struct {
    int8_t *p8;
    int16_t *p16;
    float *s, *sp, *sp16;
} Acts;

static void acts_free(Acts *a) {
    free(a->p8);
    free(a->p16);
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
                   int type) {
    const int chunks = k / 32, run = activation_run(type, levels);
    memset(a, 0, sizeof *a);
    if (levels > 127) a->p16 = aligned_alloc(32, (size_t)rows * k * 2);
    else a->p8 = aligned_alloc(32, (size_t)rows * k);
    a->s = malloc((size_t)rows * chunks * sizeof(float));
    a->sp = malloc((size_t)rows * chunks * sizeof(float));
    if (type == Q6_K) a->sp16 = malloc((size_t)rows * chunks * 2 * sizeof(float));
    if ((a->p8 == NULL && a->p16 == NULL) || a->s == NULL || a->sp == NULL
        || (type == Q6_K && a->sp16 == NULL)) {
        acts_free(a);
        return -2;
    }
    const __m256 sign = _mm256_set1_ps(-0.0f);
    float run_amax = 0.0f;
    for (int r = 0; r < rows; r++)
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
            /* packs interleave 128-bit lanes: the permutation puts the values back in order */
            const __m256i w01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(p[0], p[1]), 0xd8);
            const __m256i w23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(p[2], p[3]), 0xd8);
            if (a->p16 != NULL) {
                _mm256_store_si256((__m256i *)(a->p16 + (int64_t)r * k + 32 * j), w01);
                _mm256_store_si256((__m256i *)(a->p16 + (int64_t)r * k + 32 * j + 16), w23);
            } else {
                _mm256_store_si256((__m256i *)(a->p8 + (int64_t)r * k + 32 * j),
                                   _mm256_permute4x64_epi64(_mm256_packs_epi16(w01, w23), 0xd8));
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

/* A K-quant super-block's factors: sc [8], each chunk's two half-chunk scales as int16 (low
 * half first); d [16], each half-chunk's factor as float32; m, Q4_K/Q5_K: [8] the chunks' mins,
 * Q6_K: [16] the half-chunks' offsets (-32 d). Returns the super-block's d. */
static ALWAYS_INLINE float k_scales(const uint8_t *b, int type, uint32_t *sc, float *d,
                                    float *m) {
    if (type == Q6_K) {
        const float dd = half_load(b + 208);
        for (int i = 0; i < 16; i++) {
            d[i] = dd * (float)(int8_t)b[192 + i];
            m[i] = -32.0f * d[i];
        }
        for (int j = 0; j < 8; j++)
            sc[j] = (uint16_t)(int8_t)b[192 + 2 * j]
                    | (uint32_t)(uint16_t)(int8_t)b[193 + 2 * j] << 16;
        return dd;
    }
    uint32_t u[4];
    k_scales_mins(b, u);
    const uint8_t *sm = (const uint8_t *)u;
    const float dd = half_load(b), dmin = half_load(b + 2);
    for (int j = 0; j < 8; j++) {
        d[2 * j] = d[2 * j + 1] = dd * (float)sm[j];
        m[j] = -(dmin * (float)sm[8 + j]);
        sc[j] = sm[j] | (uint32_t)sm[j] << 16;
    }
    return dd;
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
 * 0 .. 63 as stored. The factors are chunk_scales'. The K-quants' also as integers: sc [chunks],
 * each chunk's two half-chunk scales as int16 (low half first), and dsb [chunks / 8], each
 * super-block's d (for Q8_K activations). */
static ALWAYS_INLINE void unpack_row(const uint8_t *row, int type, int chunks, int8_t *q,
                                     float *d, float *m, uint32_t *sc, float *dsb) {
    if (is_k_quant(type)) {
        for (int sb = 0; sb < chunks / 8; sb++) {
            const uint8_t *b = row + (int64_t)sb * stored_block_bytes(type);
            dsb[sb] = k_scales(b, type, sc + 8 * sb, d + 16 * sb,
                               m + (type == Q6_K ? 16 : 8) * sb);
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

/* K-quant rows (ow: 1 or 2, k bytes apart as unpacked) on int8 activations of one scale a
 * super-block (Q8_K), into acc[i][t]: each chunk's pmaddubsw pairs take its half-chunks'
 * integer scales through pmaddwd, and the int32 sums run through the super-block; d * s once at
 * its end. Two weight rows share each activation load. */
static ALWAYS_INLINE void pass_superblocks(const int8_t *q, const uint32_t *sc, const float *dsb,
                                          int chunks, int k, const Acts *a, int r0, int rt,
                                          int ow, __m256 acc[2][RT]) {
    /* each 128-bit lane's int16 lanes all the lane's half-chunk scale */
    const __m256i halves = _mm256_set_epi8(3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2,
                                           1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
    for (int sb = 0; sb < chunks / 8; sb++) {
        __m256i sum[2][RT];
        for (int i = 0; i < 2; i++)
            for (int t = 0; t < RT; t++) sum[i][t] = _mm256_setzero_si256();
        #pragma GCC unroll 8
        for (int j = 8 * sb; j < 8 * sb + 8; j++) {
            __m256i w[2], scales[2];
            for (int i = 0; i < ow; i++) {
                w[i] = _mm256_loadu_si256((const __m256i *)(q + (int64_t)i * k + 32 * j));
                scales[i] = _mm256_shuffle_epi8(
                    _mm256_set1_epi32((int)sc[(int64_t)i * chunks + j]), halves);
            }
            #pragma GCC unroll 4
            for (int t = 0; t < rt; t++) {
                const __m256i p = _mm256_load_si256(
                    (const __m256i *)(a->p8 + (int64_t)(r0 + t) * k + 32 * j));
                for (int i = 0; i < ow; i++)
                    sum[i][t] = _mm256_add_epi32(sum[i][t], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(w[i], p), scales[i]));
            }
        }
        for (int i = 0; i < ow; i++)
            for (int t = 0; t < rt; t++)
                acc[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i][t]), _mm256_set1_ps(
                    dsb[i * (chunks / 8) + sb] * a->s[(int64_t)(r0 + t) * chunks + 8 * sb]),
                    acc[i][t]);
    }
}

/* A K-quant weight row read as it is stored (no unpacking: for calls of at most RT rows, which
 * pass it once) against int8 activation rows 0 .. rt, Q8_K numerics as pass_superblocks':
 * out[t] its dots (no bias). */
static ALWAYS_INLINE void pass_stored(const uint8_t *row, int type, int chunks, int k,
                                     const Acts *a, int rt, float *out) {
    __m256 acc[RT];
    for (int t = 0; t < RT; t++) acc[t] = _mm256_setzero_ps();
    for (int sb = 0; sb < chunks / 8; sb++) {
        const uint8_t *b = row + (int64_t)sb * stored_block_bytes(type);
        /* the rows are read once, from memory: ahead of the hardware's prefetch */
        for (int at = 0; at < stored_block_bytes(type); at += 64)
            _mm_prefetch((const char *)b + PREFETCH + at, _MM_HINT_T0);
        /* the scales as int16, both 128-bit lanes alike (Q6_K: two vectors of 8), and each
         * chunk's pshufb of them; the mins (Q6_K: offsets) as float32, in vectors */
        __m256i all[2];
        __m256 m[2];
        float dd;
        if (type == Q6_K) {
            dd = half_load(b + 208);
            const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
            all[0] = _mm256_permute2x128_si256(s16, s16, 0x00);
            all[1] = _mm256_permute2x128_si256(s16, s16, 0x11);
            const __m256 offset = _mm256_set1_ps(-32.0f * dd);
            m[0] = _mm256_mul_ps(offset, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(
                _mm256_castsi256_si128(s16))));
            m[1] = _mm256_mul_ps(offset, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(
                _mm256_extracti128_si256(s16, 1))));
        } else {
            uint32_t u[4];
            k_scales_mins(b, u);
            dd = half_load(b);
            const __m128i bytes = _mm_loadu_si128((const __m128i *)u);
            const __m128i s8 = _mm_cvtepu8_epi16(bytes);
            all[0] = all[1] = _mm256_set_m128i(s8, s8);
            m[0] = _mm256_mul_ps(_mm256_set1_ps(-half_load(b + 2)), _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))));
        }
        __m256i sum[RT];
        for (int t = 0; t < RT; t++) sum[t] = _mm256_setzero_si256();
        #pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const __m256i w = k_chunk(b, type, j);
            /* int16 lane pairs: Q6_K's half-chunks 2j and 2j + 1, else chunk j's, twice */
            const int lo = type == Q6_K ? 2 * (2 * j % 8) : 2 * j, hi = type == Q6_K ? lo + 2 : lo;
            const __m256i pick = _mm256_set_epi8(
                hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi,
                hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi,
                lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo,
                lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo);
            const __m256i scales = _mm256_shuffle_epi8(all[type == Q6_K && j >= 4], pick);
            #pragma GCC unroll 4
            for (int t = 0; t < rt; t++) {
                const __m256i p = _mm256_load_si256(
                    (const __m256i *)(a->p8 + (int64_t)t * k + 256 * sb + 32 * j));
                sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(
                    _mm256_maddubs_epi16(w, p), scales));
            }
        }
        for (int t = 0; t < rt; t++) {
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), _mm256_set1_ps(
                dd * a->s[(int64_t)t * chunks + 8 * sb]), acc[t]);
            /* the mins' (Q6_K: offsets') share, as pass's */
            if (type == Q6_K) {
                const float *sp = a->sp16 + (int64_t)t * 2 * chunks + 16 * sb;
                acc[t] = _mm256_fmadd_ps(m[0], _mm256_loadu_ps(sp), acc[t]);
                acc[t] = _mm256_fmadd_ps(m[1], _mm256_loadu_ps(sp + 8), acc[t]);
            } else {
                acc[t] = _mm256_fmadd_ps(m[0], _mm256_loadu_ps(
                    a->sp + (int64_t)t * chunks + 8 * sb), acc[t]);
            }
        }
    }
    for (int t = 0; t < rt; t++) out[t] = hsum(acc[t]);
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

/* Unpacked weight rows (ow: 1 or 2, as unpack_rows lays them) against activation rows r0 ..
 * r0 + rt: out[i * RT + t] their dots (no bias). `type`, `rt`, `ow` and `wide` (int16
 * activations) are constants in each caller. */
static ALWAYS_INLINE void pass(const int8_t *q, const float *d, const float *m,
                              const uint32_t *sc, const float *dsb, int type, int chunks, int k,
                              const Acts *a, int r0, int rt, int ow, int wide, float *out) {
    __m256 acc[2][RT];
    for (int i = 0; i < 2; i++)
        for (int t = 0; t < RT; t++) acc[i][t] = _mm256_setzero_ps();
    if (is_k_quant(type) && !wide)
        pass_superblocks(q, sc, dsb, chunks, k, a, r0, rt, ow, acc);
    else
        for (int i = 0; i < ow; i++)
            pass_chunks(q + (int64_t)i * k, d + (int64_t)i * 2 * chunks, type, chunks, k, a, r0,
                        rt, wide, acc[i]);
    /* the mins' share: m . (s * sum(p)) over the chunks (Q6_K: its offsets, half-chunks) */
    const int groups = type == Q6_K ? 2 * chunks : chunks;
    for (int i = 0; i < ow; i++)
        for (int t = 0; t < rt; t++) {
            if (has_min(type) || type == Q6_K) {
                const float *mi = m + (int64_t)i * 2 * chunks;
                const float *sp = type == Q6_K ? a->sp16 + (int64_t)(r0 + t) * groups
                                               : a->sp + (int64_t)(r0 + t) * chunks;
                int j = 0;
                for (; j + 8 <= groups; j += 8)
                    acc[i][t] = _mm256_fmadd_ps(_mm256_loadu_ps(mi + j), _mm256_loadu_ps(sp + j),
                                                acc[i][t]);
                float rest = 0.0f;
                for (; j < groups; j++) rest += mi[j] * sp[j];
                out[i * RT + t] = hsum(acc[i][t]) + rest;
            } else {
                out[i * RT + t] = hsum(acc[i][t]);
            }
        }
}

#define PASS_TYPE(RTC, OW, WIDE) \
    switch (type) { \
    case Q4_0: pass(q, d, m, sc, dsb, Q4_0, chunks, k, a, r0, RTC, OW, WIDE, out); break; \
    case Q4_1: pass(q, d, m, sc, dsb, Q4_1, chunks, k, a, r0, RTC, OW, WIDE, out); break; \
    case Q5_1: pass(q, d, m, sc, dsb, Q5_1, chunks, k, a, r0, RTC, OW, WIDE, out); break; \
    case Q8_0: pass(q, d, m, sc, dsb, Q8_0, chunks, k, a, r0, RTC, OW, WIDE, out); break; \
    case Q4_K: pass(q, d, m, sc, dsb, Q4_K, chunks, k, a, r0, RTC, OW, WIDE, out); break; \
    case Q5_K: pass(q, d, m, sc, dsb, Q5_K, chunks, k, a, r0, RTC, OW, WIDE, out); break; \
    default: pass(q, d, m, sc, dsb, Q6_K, chunks, k, a, r0, RTC, OW, WIDE, out); break; \
    }

static void pass_rows(const int8_t *q, const float *d, const float *m, const uint32_t *sc,
                      const float *dsb, int type, int chunks, int k, const Acts *a, int r0,
                      int rt, int ow, float *out) {
    if (a->p16 != NULL) {
        if (rt == 4) { PASS_TYPE(4, 1, 1) } else if (rt == 2) { PASS_TYPE(2, 1, 1) }
        else { PASS_TYPE(1, 1, 1) }
    } else if (ow == 2) {
        if (rt == 4) { PASS_TYPE(4, 2, 0) } else if (rt == 2) { PASS_TYPE(2, 2, 0) }
        else { PASS_TYPE(1, 2, 0) }
    } else {
        if (rt == 4) { PASS_TYPE(4, 1, 0) } else if (rt == 2) { PASS_TYPE(2, 1, 0) }
        else { PASS_TYPE(1, 1, 0) }
    }
}

#define STORED_TYPE(RTC) \
    switch (type) { \
    case Q4_K: pass_stored(row, Q4_K, chunks, k, a, RTC, out); break; \
    case Q5_K: pass_stored(row, Q5_K, chunks, k, a, RTC, out); break; \
    default: pass_stored(row, Q6_K, chunks, k, a, RTC, out); break; \
    }

/* pass_stored, with the type and row count constants. */
static void stored_rows(const uint8_t *row, int type, int chunks, int k, const Acts *a,
                        int rows, float *out) {
    if (rows == 4) { STORED_TYPE(4) } else if (rows == 3) { STORED_TYPE(3) }
    else if (rows == 2) { STORED_TYPE(2) } else { STORED_TYPE(1) }
}

/* The unpacking, with the type a constant. */
static void unpack_rows(const uint8_t *w, int64_t row_bytes, int type, int chunks, int o0,
                        int count, int8_t *q, float *d, float *m, uint32_t *sc, float *dsb) {
    for (int i = 0; i < count; i++) {
        const uint8_t *row = w + (int64_t)(o0 + i) * row_bytes;
        int8_t *qi = q + (int64_t)i * 32 * chunks;
        float *di = d + (int64_t)i * 2 * chunks, *mi = m + (int64_t)i * 2 * chunks;
        uint32_t *sci = sc + (int64_t)i * chunks;
        float *dsbi = dsb + (int64_t)i * (chunks / 8);
        switch (type) {
        case Q4_0: unpack_row(row, Q4_0, chunks, qi, di, mi, sci, dsbi); break;
        case Q4_1: unpack_row(row, Q4_1, chunks, qi, di, mi, sci, dsbi); break;
        case Q5_1: unpack_row(row, Q5_1, chunks, qi, di, mi, sci, dsbi); break;
        case Q8_0: unpack_row(row, Q8_0, chunks, qi, di, mi, sci, dsbi); break;
        case Q4_K: unpack_row(row, Q4_K, chunks, qi, di, mi, sci, dsbi); break;
        case Q5_K: unpack_row(row, Q5_K, chunks, qi, di, mi, sci, dsbi); break;
        default: unpack_row(row, Q6_K, chunks, qi, di, mi, sci, dsbi); break;
        }
    }
}

static int quant_linear_int(const void *x, int64_t x_stride, int bf16, const uint8_t *w,
                            int64_t row_bytes, int type, const void *bias, void *y,
                            int64_t y_stride, int rows, int n, int k, int levels, int threads) {
    if (bf16 || !int_linear_takes(type, k, rows, levels)) return -1;
    const int chunks = k / 32;
    Acts a;
    if (acts_of(&a, x, x_stride, rows, k, levels, type) != 0) return -2;
    int failed = 0;
    if (a.p8 != NULL && is_k_quant(type) && rows <= RT) {
        #pragma omp parallel num_threads(threads)
        {
            int n0, n1;
            thread_share(n, &n0, &n1);
            for (int o = n0; o < n1; o++) {
                float out[RT];
                stored_rows(w + (int64_t)o * row_bytes, type, chunks, k, &a, rows, out);
                const float b = bias != NULL ? ((const float *)bias)[o] : 0.0f;
                for (int t = 0; t < rows; t++)
                    ((float *)y)[(int64_t)t * y_stride + o] = out[t] + b;
            }
        }
        acts_free(&a);
        return 0;
    }
    #pragma omp parallel num_threads(threads)
    {
        int8_t *q = malloc((size_t)OB * k);
        float *d = malloc((size_t)OB * 2 * chunks * sizeof(float));
        float *m = malloc((size_t)OB * 2 * chunks * sizeof(float));
        uint32_t *sc = malloc((size_t)OB * chunks * sizeof(uint32_t));
        float *dsb = malloc((size_t)OB * (chunks / 8 + 1) * sizeof(float));
        int n0, n1;
        thread_share(n, &n0, &n1);
        if (q == NULL || d == NULL || m == NULL || sc == NULL || dsb == NULL) failed = 1;
        for (int ob = n0; !failed && ob < n1; ob += OB) {
            const int count = n1 - ob < OB ? n1 - ob : OB;
            unpack_rows(w, row_bytes, type, chunks, ob, count, q, d, m, sc, dsb);
            for (int r0 = 0; r0 < rows;) {
                const int left = rows - r0, rt = left >= 4 ? 4 : left >= 2 ? 2 : 1;
                for (int i = 0; i < count;) {
                    const int ow = a.p8 != NULL && count - i >= 2 ? 2 : 1;
                    float out[2 * RT];
                    pass_rows(q + (int64_t)i * k, d + (int64_t)i * 2 * chunks,
                              m + (int64_t)i * 2 * chunks, sc + (int64_t)i * chunks,
                              dsb + (int64_t)i * (chunks / 8), type, chunks, k, &a, r0, rt, ow,
                              out);
                    for (int e = 0; e < ow; e++, i++) {
                        const float b = bias != NULL ? ((const float *)bias)[ob + i] : 0.0f;
                        for (int t = 0; t < rt; t++)
                            ((float *)y)[(int64_t)(r0 + t) * y_stride + ob + i] =
                                out[e * RT + t] + b;
                    }
                }
                r0 += rt;
            }
        }
        free(q);
        free(d);
        free(m);
        free(sc);
        free(dsb);
    }
    acts_free(&a);
    return failed ? -2 : 0;
}

INT_LINEAR_F32(quant_linear_int)
