/* The block linear on integer activations (--activation-quant) with AVX-512 VNNI: the numerics
 * of generic/quant_linear_int.c (its comment has the formula), 64 products an instruction.
 *
 * vpdpbusd multiplies 64 unsigned bytes by 64 signed ones and adds each 4 products into one of
 * 16 int32 lanes. The weights are the unsigned bytes: every type's stored integers as they are
 * (0..15, 0..31, 0..63; Q8_0's signed bytes plus 128), two chunks (64 weights) a vector in
 * their natural order, unpacked with a shift and a mask. The offsets the types subtract (Q4_0's
 * 8, Q6_K's 32, Q8_0's 128) start each lane at -offset * (its 4 activations' sum), worked out
 * once a call. The activations are the signed bytes: int8 ones as they are; int16 ones (15 bits,
 * |p| <= 16383) as p = 128 hi + lo, lo in 0..127, one vpdpbusd each. Each lane's int32 then
 * becomes float32 and takes its chunk's d * s (Q6_K's sixteens their own d) in a float32
 * accumulator, summed across lanes once per output value.
 *
 * The K-quants on int8 activations (Q8_K: a scale per 256) go as llama.cpp's q4_K x q8_K
 * does (pass_superblocks; the avx2 tier's repacked kernel sums them so too): vpmaddubsw pairs the
 * products into int16 lanes, vpdpwssd multiplies each pair by its (Q6_K: half-)chunk's integer
 * scale into the int32 lanes, which add up through the super-block; one conversion and one FMA
 * by d * s a super-block: two instructions a vector an activation row where the chunks' way
 * takes four. The mins' (Q6_K: offsets') share is m . (s * sum(p)), as for the other types.
 *
 * A pass takes one weight row against up to RT activation rows, each vector of weights
 * unpacked once for them (a row count between the passes' sizes padded up, the padding's rows
 * repeating the last); OB output rows stay in cache while every group of RT rows passes them.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "common.h"
#include "int_activations.h"

#define RT 8   /* activation rows a pass takes (1, 2, 4 or 8) */
#define PREFETCH 2048  /* bytes ahead of the blocks being read (prefetch()) */
#define OB 32  /* output rows a thread takes through every group of activation rows */

/* The activations as vpdpbusd takes them, a vector per two chunks (64 values), [rows][pairs]:
 * lo (int8: the values; int16: their low 7 bits) and hi (int16 only: the rest, p >> 7), off
 * (-offset * each lane's 4 values' sum; NULL for a type without an offset), s (lanes 0-7 the
 * first chunk's scale, 8-15 the second's), sp [rows][chunks] (s * sum(p), the mins') and, for
 * Q6_K's super-block sums, sp16 [rows][2 * chunks] (s * sum(p) a half-chunk, its offsets'). An
 * odd last chunk is paired with zeros. */
typedef struct {
    __m512i *lo, *hi, *off;
    __m512 *s;
    float *sp, *sp16;
    int pairs;
} Planes;

static void planes_free(Planes *a) {
    free(a->lo);
    free(a->hi);
    free(a->off);
    free(a->s);
    free(a->sp);
    free(a->sp16);
}

/* The offset a type's stored integers carry (as unsigned bytes here). */
static inline int type_offset(int type) {
    return type == Q4_0 ? 8 : type == Q6_K ? 32 : type == Q8_0 ? 128 : 0;
}

/* Four 16-byte runs as one vector, the first lowest. */
static inline __m512i join4(const __m128i q[4]) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(q[1], q[0])),
                              _mm256_set_m128i(q[3], q[2]), 1);
}

/* x's rows quantized as generic/quant_linear_int.c's int_rows quantizes them (the same
 * roundings, so not under fast math), straight into planes (sp16 where `half_sums`). Returns -2
 * (nothing held) without memory. */
__attribute__((optimize("no-fast-math")))
static int planes_of(Planes *a, const void *x, int64_t x_stride, int bf16, int rows, int k,
                     int levels, int run, int offset, int half_sums) {
    const int chunks = k / 32, pairs = (chunks + 1) / 2;
    const size_t vectors = (size_t)rows * pairs * 64;
    memset(a, 0, sizeof *a);
    a->pairs = pairs;
    a->lo = aligned_alloc(64, vectors);
    a->s = aligned_alloc(64, vectors);
    a->sp = malloc((size_t)rows * chunks * sizeof(float));
    if (levels > 127) a->hi = aligned_alloc(64, vectors);
    if (offset) a->off = aligned_alloc(64, vectors);
    if (half_sums) a->sp16 = malloc((size_t)rows * chunks * 2 * sizeof(float));
    if (a->lo == NULL || a->s == NULL || a->sp == NULL || (levels > 127 && a->hi == NULL)
        || (offset && a->off == NULL) || (half_sums && a->sp16 == NULL)) {
        planes_free(a);
        return -2;
    }
    float run_amax = 0.0f;
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < pairs; i++) {
            const int64_t at = (int64_t)r * pairs + i;
            __m512 s = _mm512_setzero_ps();
            __m128i lo[4] = {0}, hi[4] = {0};
            for (int h = 0; h < 2 && 2 * i + h < chunks; h++) {
                const int j = 2 * i + h;
                const int64_t e0 = r * x_stride + 32 * j;
                __m512 v0, v1;
                if (bf16) {
                    const uint16_t *xe = (const uint16_t *)x + e0;
                    v0 = bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)xe));
                    v1 = bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(xe + 16)));
                } else {
                    v0 = _mm512_loadu_ps((const float *)x + e0);
                    v1 = _mm512_loadu_ps((const float *)x + e0 + 16);
                }
                if (run > 32 && 32 * j % run == 0)
                    run_amax = magnitude_of(x, r * x_stride + 32 * j, bf16, run);
                const float amax = run > 32 ? run_amax : _mm512_reduce_max_ps(
                    _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
                const float scale = amax / (float)levels;
                const __m512 inverse = _mm512_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
                /* the default rounding: to nearest, halves to even, as rintf */
                const __m512i p0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inverse));
                const __m512i p1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inverse));
                const int32_t lo_sum = _mm512_reduce_add_epi32(p0);
                const int32_t hi_sum = _mm512_reduce_add_epi32(p1);
                a->sp[(int64_t)r * chunks + j] = scale * (float)(lo_sum + hi_sum);
                if (half_sums) {
                    a->sp16[2 * ((int64_t)r * chunks + j)] = scale * (float)lo_sum;
                    a->sp16[2 * ((int64_t)r * chunks + j) + 1] = scale * (float)hi_sum;
                }
                s = _mm512_mask_mov_ps(s, h ? 0xff00 : 0x00ff, _mm512_set1_ps(scale));
                if (a->hi != NULL) {  /* int16: p = 128 hi + lo */
                    hi[2 * h] = _mm512_cvtepi32_epi8(_mm512_srai_epi32(p0, 7));
                    hi[2 * h + 1] = _mm512_cvtepi32_epi8(_mm512_srai_epi32(p1, 7));
                    const __m512i low7 = _mm512_set1_epi32(127);
                    lo[2 * h] = _mm512_cvtepi32_epi8(_mm512_and_si512(p0, low7));
                    lo[2 * h + 1] = _mm512_cvtepi32_epi8(_mm512_and_si512(p1, low7));
                } else {
                    lo[2 * h] = _mm512_cvtepi32_epi8(p0);
                    lo[2 * h + 1] = _mm512_cvtepi32_epi8(p1);
                }
            }
            const __m512i lov = join4(lo);
            _mm512_store_si512(a->lo + at, lov);
            if (a->hi != NULL) _mm512_store_si512(a->hi + at, join4(hi));
            if (a->off != NULL) {  /* each lane's 4 values' sum: 128 hi + lo, summed */
                const __m512i ones = _mm512_set1_epi8(1);
                __m512i lanes = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, lov);
                if (a->hi != NULL)
                    lanes = _mm512_add_epi32(lanes, _mm512_slli_epi32(_mm512_dpbusd_epi32(
                        _mm512_setzero_si512(), ones, _mm512_load_si512(a->hi + at)), 7));
                _mm512_store_si512(a->off + at,
                                   _mm512_mullo_epi32(lanes, _mm512_set1_epi32(-offset)));
            }
            _mm512_store_ps(a->s + at, s);
        }
    return 0;
}

/* Each 16-bit lane of v shifted right by its own count (counts, lane for lane), then each byte
 * masked to `mask`. */
static inline __m512i shifted(__m512i v, __m512i counts, int mask) {
    return _mm512_and_si512(_mm512_srlv_epi16(v, counts), _mm512_set1_epi8((char)mask));
}

static inline __m512i halves(int a, int b) {  /* 16-bit counts: a in the low 256 bits, b above */
    return _mm512_inserti64x4(_mm512_set1_epi16((short)a), _mm256_set1_epi16((short)b), 1);
}

/* The blocks PREFETCH bytes on from these `bytes`: at a decode's few rows the products keep
 * up with memory, and the hardware's own prefetching alone left it idle part of the time. */
static inline void prefetch(const uint8_t *p, int bytes) {
    for (int at = 0; at < bytes; at += 64)
        _mm_prefetch((const char *)p + PREFETCH + at, _MM_HINT_T0);
}

/* A block's fp16 scalar, or its float32 one where widened. */
static inline float scalar(const uint8_t *p, int wide) {
    float f;
    if (!wide) return half_load(p);
    memcpy(&f, p, 4);
    return f;
}

/* The lanes of rt activation rows (at: each one's first vector) for one weight vector q
 * (chunks 2i, 2i + 1) with its factors d: each row's int32 products to float32, times d * s,
 * into acc. */
static ALWAYS_INLINE void rows_step(__m512i q, __m512 d, const Planes *a, const int64_t at[RT],
                                    int64_t i, int rt, int offset, __m512 acc[RT]) {
    #pragma GCC unroll 8
    for (int t = 0; t < rt; t++) {
        const int64_t v = at[t] + i;
        __m512i dot = _mm512_dpbusd_epi32(offset ? a->off[v] : _mm512_setzero_si512(), q,
                                          a->lo[v]);
        if (a->hi != NULL)
            dot = _mm512_add_epi32(dot, _mm512_slli_epi32(
                _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, a->hi[v]), 7));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, a->s[v]), acc[t]);
    }
}

/* Vector g (chunks 2g, 2g + 1) of K-quant super-block b: its stored integers, unsigned (Q4_K's
 * 0 .. 15, Q5_K's 0 .. 31, Q6_K's 0 .. 63), in element order. */
static ALWAYS_INLINE __m512i k_vector(const uint8_t *b, int type, int g) {
    if (type == Q6_K) {  /* chunks 2g, 2g + 1: half h, nibbles t of ql */
        const int h = g >> 1, t = 2 * (g & 1);
        const __m512i ql = _mm512_loadu_si512(b + 64 * h);
        const __m512i qh = _mm512_broadcast_i64x4(
            _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
        return _mm512_or_si512(
            _mm512_and_si512(t ? _mm512_srli_epi16(ql, 4) : ql, _mm512_set1_epi8(15)),
            _mm512_slli_epi16(shifted(qh, halves(2 * t, 2 * t + 2), 3), 4));
    }
    const __m512i q = shifted(_mm512_broadcast_i64x4(_mm256_loadu_si256(
        (const __m256i *)(b + (type == Q4_K ? 16 : 48) + 32 * g))), halves(0, 4), 15);
    if (type == Q4_K) return q;
    /* chunk c's fifth bits: bit c of each of 32 bytes */
    const __m512i fifth = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)));
    return _mm512_or_si512(q, _mm512_slli_epi16(shifted(fifth, halves(2 * g, 2 * g + 1), 1), 4));
}

/* Q4_K/Q5_K super-block b's 6-bit scales (bytes 0-7) and mins (8-15), its mins' factors
 * (-dmin * mn) stored at m for pass's closing FMAs. */
static ALWAYS_INLINE __m128i k_scales_and_mins(const uint8_t *b, float *m) {
    uint32_t u[4];
    k_scales_mins(b, u);
    /* (from registers: a vector load of u's four scalar stores would wait on them) */
    const __m128i scales_mins = _mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]);
    _mm256_storeu_ps(m, _mm256_mul_ps(
        _mm256_set1_ps(-half_load(b + 2)),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(scales_mins, 8)))));
    return scales_mins;
}

/* A K-quant weight row on int8 activations of a scale a super-block, into acc[t]: each
 * vector's vpmaddubsw pairs (|q p + q' p'| <= 63 * 127 * 2 fits 16 bits) take their (Q6_K:
 * half-)chunk's integer scale through vpdpwssd, and the int32 lanes add up through the
 * super-block; d * s once at its end. m: the row's mins, a chunk (Q6_K: its offsets, -32 d a
 * half-chunk), for pass's closing FMAs. */
static ALWAYS_INLINE void pass_superblocks(const uint8_t *row, int type, int chunks,
                                           const Planes *a, const int64_t at[RT], int rt,
                                           float *m, __m512 acc[RT]) {
    for (int sb = 0; sb < chunks / 8; sb++) {
        const uint8_t *b = row + (int64_t)sb * stored_block_bytes(type);
        prefetch(b, stored_block_bytes(type));
        __m512i scales;  /* int16 lanes 0-15: Q6_K's 16 half-chunk scales; else 0-7 the chunks' */
        float dd;
        if (type == Q6_K) {
            dd = half_load(b + 208);
            const __m128i s8 = _mm_loadu_si128((const __m128i *)(b + 192));
            scales = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(s8));
            _mm512_storeu_ps(m + 16 * sb, _mm512_mul_ps(
                _mm512_set1_ps(-32.0f * dd), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s8))));
        } else {
            dd = half_load(b);
            scales = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(
                k_scales_and_mins(b, m + 8 * sb)));
        }
        __m512i sum[RT];
        for (int t = 0; t < RT; t++) sum[t] = _mm512_setzero_si512();
        #pragma GCC unroll 4
        for (int g = 0; g < 4; g++) {
            const __m512i q = k_vector(b, type, g);
            /* int16 lane l pairs bytes 2l, 2l + 1: Q6_K's half-chunk 4g + l / 8, else chunk
             * 2g + l / 16 */
            const __m512i pick = type == Q6_K
                ? _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(
                      _mm_set1_epi16((short)(4 * g + 1)), _mm_set1_epi16((short)(4 * g)))),
                      _mm256_set_m128i(_mm_set1_epi16((short)(4 * g + 3)),
                                       _mm_set1_epi16((short)(4 * g + 2))), 1)
                : halves(2 * g, 2 * g + 1);
            const __m512i sc = _mm512_permutexvar_epi16(pick, scales);
            #pragma GCC unroll 8
            for (int t = 0; t < rt; t++)
                sum[t] = _mm512_dpwssd_epi32(sum[t], _mm512_maddubs_epi16(
                    q, a->lo[at[t] + 4 * sb + g]), sc);
        }
        #pragma GCC unroll 8
        for (int t = 0; t < rt; t++)  /* the super-block's scale: its first chunk's */
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[t]), _mm512_set1_ps(
                dd * _mm512_cvtss_f32(a->s[at[t] + 4 * sb])), acc[t]);
    }
}

/* One weight row against activation rows r0 .. r0 + live (rt of them taken: the rows past
 * live repeat the last): out[t] its dot with each (no bias). m: scratch for the row's mins.
 * `type` and `rt` are constants in each caller. */
static ALWAYS_INLINE void pass(const uint8_t *row, int type, int chunks, const Planes *a, int r0,
                               int rt, int live, int bf16, float *m, float *out) {
    const int offset = type_offset(type);
    int64_t at[RT];
    for (int t = 0; t < rt; t++) at[t] = (int64_t)(r0 + (t < live ? t : live - 1)) * a->pairs;
    __m512 acc[RT];
    for (int t = 0; t < RT; t++) acc[t] = _mm512_setzero_ps();
    const int superblocks = is_k_quant(type) && a->hi == NULL;
    if (superblocks) {
        pass_superblocks(row, type, chunks, a, at, rt, m, acc);
    } else if (is_k_quant(type)) {
        for (int sb = 0; sb < chunks / 8; sb++) {
            const uint8_t *b = row + (int64_t)sb * stored_block_bytes(type);
            prefetch(b, stored_block_bytes(type));
            __m512 sc;
            if (type == Q6_K) {
                sc = _mm512_mul_ps(_mm512_set1_ps(half_load(b + 208)), _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))));
            } else {
                sc = _mm512_castps256_ps512(_mm256_mul_ps(
                    _mm256_set1_ps(half_load(b)),
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(k_scales_and_mins(b, m + 8 * sb)))));
            }
            #pragma GCC unroll 4
            for (int g = 0; g < 4; g++) {
                /* each lane's factor: Q6_K's half-chunk 4g + lane / 4, else chunk 2g + lane / 8 */
                const __m512i lanes = type == Q6_K
                    ? _mm512_set_epi32(4 * g + 3, 4 * g + 3, 4 * g + 3, 4 * g + 3, 4 * g + 2,
                                       4 * g + 2, 4 * g + 2, 4 * g + 2, 4 * g + 1, 4 * g + 1,
                                       4 * g + 1, 4 * g + 1, 4 * g, 4 * g, 4 * g, 4 * g)
                    : _mm512_inserti64x4(_mm512_set1_epi32(2 * g), _mm256_set1_epi32(2 * g + 1), 1);
                rows_step(k_vector(b, type, g), _mm512_permutexvar_ps(lanes, sc), a, at,
                          4 * sb + g, rt, offset, acc);
            }
        }
    } else {
        /* the bfloat16 entry reads Q4_0, Q4_1 and Q8_0 with their scalars widened to float32,
         * as the bfloat16 float kernels do (blocks.py's WIDE_SCALARS) */
        const int wide = bf16 && (type == Q4_0 || type == Q4_1 || type == Q8_0);
        const int scalars = type == Q4_1 ? 2 : 1;
        const int bytes = stored_block_bytes(type) + (wide ? 2 * scalars : 0);
        const int qs = stored_values_at(type) + (wide ? 2 * scalars : 0);
        /* 16-bit counts by 128-bit quarter: low nibbles, high, low, high */
        const __m512i counts = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0, 0,
                                                0x0004000400040004, 0x0004000400040004, 0, 0);
        for (int i = 0; i < a->pairs; i++) {
            const int j0 = 2 * i, j1 = 2 * i + 1 < chunks ? 2 * i + 1 : j0;  /* (zeros' pair) */
            const uint8_t *b0 = row + (int64_t)j0 * bytes, *b1 = row + (int64_t)j1 * bytes;
            prefetch(b0, 2 * bytes);
            const __m512 d = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(scalar(b0, wide)),
                                                  _mm512_set1_ps(scalar(b1, wide)));
            if (has_min(type)) {
                m[j0] = scalar(b0 + (wide ? 4 : 2), wide);
                m[j1] = scalar(b1 + (wide ? 4 : 2), wide);
            }
            __m512i q;
            if (type == Q8_0) {
                q = _mm512_xor_si512(_mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + qs))),
                    _mm256_loadu_si256((const __m256i *)(b1 + qs)), 1),
                    _mm512_set1_epi8((char)0x80));
            } else {
                const __m512i v = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_broadcastsi128_si256(
                        _mm_loadu_si128((const __m128i *)(b0 + qs)))),
                    _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b1 + qs))), 1);
                q = shifted(v, counts, 15);
                if (type == Q5_1) {  /* bit e of a block's qh is weight e's fifth */
                    uint32_t h0, h1;
                    memcpy(&h0, b0 + 4, 4);
                    memcpy(&h1, b1 + 4, 4);
                    q = _mm512_mask_add_epi8(q, (__mmask64)h0 | (__mmask64)h1 << 32, q,
                                             _mm512_set1_epi8(16));
                }
            }
            rows_step(q, d, a, at, i, rt, offset, acc);
        }
    }
    /* the mins' share: m . (s * sum(p)) over the chunks; in the super-block sums Q6_K's
     * offsets too, over its half-chunks */
    const int q6_offsets = superblocks && type == Q6_K;
    if (has_min(type) || q6_offsets)
        for (int t = 0; t < rt; t++) {
            const int groups = q6_offsets ? 2 * chunks : chunks;
            const float *sp = q6_offsets ? a->sp16 + at[t] / a->pairs * groups
                                         : a->sp + at[t] / a->pairs * groups;
            for (int j = 0; j < groups; j += 16) {
                const __mmask16 on = groups - j >= 16 ? 0xffff
                                     : (__mmask16)((1u << (groups - j)) - 1);
                acc[t] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(on, m + j),
                                         _mm512_maskz_loadu_ps(on, sp + j), acc[t]);
            }
        }
    for (int t = 0; t < live; t++) out[t] = _mm512_reduce_add_ps(acc[t]);
}

/* pass() with the type and row count constant (each a specialisation). */
#define PASS_TYPE(RTC) \
    switch (type) { \
    case Q4_0: pass(row, Q4_0, chunks, a, r0, RTC, live, bf16, m, out); break; \
    case Q4_1: pass(row, Q4_1, chunks, a, r0, RTC, live, bf16, m, out); break; \
    case Q5_1: pass(row, Q5_1, chunks, a, r0, RTC, live, bf16, m, out); break; \
    case Q8_0: pass(row, Q8_0, chunks, a, r0, RTC, live, bf16, m, out); break; \
    case Q4_K: pass(row, Q4_K, chunks, a, r0, RTC, live, bf16, m, out); break; \
    case Q5_K: pass(row, Q5_K, chunks, a, r0, RTC, live, bf16, m, out); break; \
    default: pass(row, Q6_K, chunks, a, r0, RTC, live, bf16, m, out); break; \
    }

/* rows r0 .. r0 + live, live <= RT, in one pass of the next size up */
static void pass_rows(const uint8_t *row, int type, int chunks, const Planes *a, int r0,
                      int live, int bf16, float *m, float *out) {
    if (live > 4) { PASS_TYPE(8) }
    else if (live > 2) { PASS_TYPE(4) }
    else if (live == 2) { PASS_TYPE(2) }
    else { PASS_TYPE(1) }
}

static int quant_linear_int(const void *x, int64_t x_stride, int bf16, const uint8_t *w,
                            int64_t row_bytes, int type, const void *bias, void *y,
                            int64_t y_stride, int rows, int n, int k, int levels, int threads) {
    if (!int_linear_takes(type, k, rows, levels)) return -1;
    const int chunks = k / 32, superblocks = is_k_quant(type) && levels == 127;
    Planes a;
    if (planes_of(&a, x, x_stride, bf16, rows, k, levels, activation_run(type, levels),
                  superblocks ? 0 : type_offset(type), superblocks && type == Q6_K) != 0)
        return -2;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *m = malloc((size_t)(2 * chunks + 16) * sizeof(float));
        int n0, n1;
        thread_share(n, &n0, &n1);
        if (m == NULL) failed = 1;
        for (int ob = n0; !failed && ob < n1; ob += OB)
            for (int r0 = 0; r0 < rows; r0 += RT) {
                const int live = rows - r0 < RT ? rows - r0 : RT;
                for (int o = ob; o < n1 && o < ob + OB; o++) {
                    float out[RT];
                    pass_rows(w + (int64_t)o * row_bytes, type, chunks, &a, r0, live, bf16, m,
                              out);
                    const float b = bias != NULL ? elem_load(bias, o, bf16) : 0.0f;
                    for (int t = 0; t < live; t++)
                        elem_store(y, (r0 + t) * y_stride + o, out[t] + b, bf16);
                }
            }
        free(m);
    }
    planes_free(&a);
    return failed ? -2 : 0;
}

INT_LINEAR_F32(quant_linear_int)
INT_LINEAR_BF16(quant_linear_int)
