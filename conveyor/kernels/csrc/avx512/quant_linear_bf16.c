/* A linear layer read straight from llama.cpp's blocks: Q4_0, Q4_1 and Q8_0 as the loader keeps
 * them for these kernels (each block's fp16 scale, and min, widened to float32 in place), Q5_1
 * and the K-quants (Q4_K, Q5_K, Q6_K) as the file stores them (blocks.h).
 *
 * At the batch sizes of a decode step a bfloat16 linear is bound by reading its weights: 2 bytes
 * a weight. These blocks hold the same weights in 0.56 (Q4_K) to 1.13 (Q8_0) bytes, so reading
 * them and dequantizing on the fly is faster; and no dense copy of the model is kept.
 *
 * Three ways to multiply: with AMX tiles (Sapphire Rapids on) past FMA_FIRST_ROWS rows, where the
 * weights are dequantized exactly as the loader does (float32 d * q, + m: two roundings) and
 * rounded to bfloat16, the bfloat16 model's weights bit for bit, and products are summed in
 * float32 as oneDNN's bfloat16 matmul does; otherwise with AVX-512 FMAs for one or two rows, the
 * block scales factored out of float32 sums of the activations times the quantized values (a
 * one-hot row still reads the loader's weight, rounded to bfloat16 once), and with bfloat16
 * dot products on those weights for 3 to 8. The caller takes more rows than these in pieces
 * (QuantLinear). The avx512 and amx tiers only: float32 models use
 * quant_linear_f32.c.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "common.h"

#if !CONVEYOR_AVX512_BF16
#error "built for the avx512 and amx tiers only (AVX-512 F and BF16)"
#endif

#define MAX_ROWS 8
/* Up to this many rows the FMA kernel runs even where AMX is on: on a 1024 x 4096 matrix (one
 * thread, the two builds alternated) it took 0.73x AMX's time at 2 rows and tied at 3 in Q4_K,
 * 1.1x at 4 (Q6_K: 0.66x at 2, 0.78x at 3, 0.84x at 4, 1.1x at 5). */
#define FMA_FIRST_ROWS 3
/* Without AMX, from this many rows on (up to MAX_ROWS) the bfloat16 dot products (dot_rows)
 * are faster than the FMA kernel: each chunk is dequantized once for all the rows, where the
 * FMA kernel's products a row cost more (docs/results/moe#dot-rows). */
#define DOT_FIRST_ROWS 3
/* Up to this many rows AMX goes a column of blocks at a time (quant_matmul_amx_few). */
#define AMX_FEW_ROWS 32
#define EXACT (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

static inline float f32_load(const uint8_t *p) {
    float f;
    memcpy(&f, p, 4);
    return f;
}

/* The bytes a block takes in these kernels' format: Q4_0, Q4_1 and Q8_0 widened, the others as
 * stored. */
static inline int block_bytes(int type) {
    return type == Q8_0 ? 36 : type == Q4_1 ? 24 : type == Q4_0 ? 20 : stored_block_bytes(type);
}

static inline int reads_bf16(int type) {
    return type == Q4_0 || type == Q4_1 || type == Q8_0 || type == Q5_1 || is_k_quant(type);
}

/* ---- A chunk of 32 weights: its quantized values and its block's factors. ---- */

/* Chunk jj (of its block: 0 but in the K-quants) of block b: the 32 quantized values as they
 * are stored, unsigned (Q8_0's signed), a byte each in element order. */
static ALWAYS_INLINE __m256i chunk_bytes(const uint8_t *b, int type, int jj) {
    const __m256i fifteen = _mm256_set1_epi8(15);
    if (type == Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 4));
    if (type == Q6_K) {  /* each half of 128: chunks t = 0..3 take the low (t < 2) or high
                          * nibbles of 32 bytes of ql, and 2 bits of 32 bytes of qh */
        const int h = jj >> 2, t = jj & 3;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (t & 1)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql, 4 * (t >> 1)), fifteen),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * t),
                                                                  _mm256_set1_epi8(3)), 4));
    }
    if (type == Q4_K || type == Q5_K) {  /* chunks 2g, 2g + 1: the low and high nibbles of 32
                                          * bytes; Q5_K's fifth bit of element e is bit jj of
                                          * byte e of qh */
        const __m256i qs = _mm256_loadu_si256(
            (const __m256i *)(b + (type == Q4_K ? 16 : 48) + 32 * (jj >> 1)));
        const __m256i q = _mm256_and_si256(jj & 1 ? _mm256_srli_epi16(qs, 4) : qs, fifteen);
        if (type == Q4_K) return q;
        return _mm256_or_si256(q, _mm256_maskz_set1_epi8(_mm256_test_epi8_mask(
            _mm256_loadu_si256((const __m256i *)(b + 16)), _mm256_set1_epi8((char)(1 << jj))), 16));
    }
    /* Q4_0, Q4_1, Q5_1: element e < 16 the low nibble of byte e, e + 16 its high; Q5_1's fifth
     * bit of element e is bit e of qh */
    const __m128i qs = _mm_loadu_si128((const __m128i *)(b + (type == Q4_0 ? 4 : 8)));
    const __m256i q = _mm256_and_si256(
        _mm256_inserti128_si256(_mm256_castsi128_si256(qs), _mm_srli_epi16(qs, 4), 1), fifteen);
    if (type != Q5_1) return q;
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    return _mm256_or_si256(q, _mm256_maskz_set1_epi8(qh, 16));
}

/* What the loader subtracts from a stored value: w = d * (q - offset) (+ m). */
static inline int offset_of(int type) { return type == Q4_0 ? 8 : type == Q6_K ? 32 : 0; }

/* 16 bytes (offset applied) as float32, exactly. */
static ALWAYS_INLINE __m512 bytes_to_f32(__m128i q, int type) {
    const __m128i v = _mm_sub_epi8(q, _mm_set1_epi8((char)offset_of(type)));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}

/* A block's factors, as chunk_scales (blocks.h) has them, for its chunks (one, or a K-quant
 * super-block's eight): chunk c's weights are d_c * (q - offset) (+ m_c). A K-quant's d_c is
 * d[c] and its m_c m[8 + c] (Q6_K: its halves' scales d[2c] and d[2c + 1]); the other types'
 * are d[0] and m[0]. They are computed in vectors and stored whole, then read a float at a time
 * as broadcasts (a load each, no shuffle: the shuffle unit is what dequantizing is short of);
 * the 6-bit unpacking's words go to a vector through registers, not memory (scalar stores read
 * back as one vector cannot be forwarded, and stalled every super-block). */
typedef struct {
    float d[16] __attribute__((aligned(64)));
    float m[16] __attribute__((aligned(64)));
} Factors;

static ALWAYS_INLINE void block_factors(const uint8_t *b, int type, Factors *f) {
    if (type == Q6_K) {  /* d * sc, an int8 sc per 16 weights */
        _mm512_store_ps(f->d, _mm512_mul_ps(_mm512_set1_ps(half_load(b + 208)), _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192))))));
    } else if (type == Q4_K || type == Q5_K) {  /* d * sc and -dmin * mn, 6-bit sc and mn */
        uint32_t u[4];
        k_scales_mins(b, u);
        const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_setr_epi32((int)u[0], (int)u[1], (int)u[2], (int)u[3])));  /* sc 0-7, mn 8-15 */
        _mm512_store_ps(f->d, _mm512_mul_ps(_mm512_set1_ps(half_load(b)), v));
        _mm512_store_ps(f->m, _mm512_mul_ps(_mm512_set1_ps(-half_load(b + 2)), v));
    } else if (type == Q5_1) {
        f->d[0] = half_load(b);
        f->m[0] = half_load(b + 2);
    } else {  /* widened: float32 d (and m) */
        f->d[0] = f32_load(b);
        f->m[0] = type == Q4_1 ? f32_load(b + 4) : 0.0f;
    }
}

/* Chunk c's scale of its first (h = 0) or last 16 weights, and its min, in every lane. */
static ALWAYS_INLINE __m512 chunk_d(const Factors *f, int type, int c, int h) {
    return _mm512_set1_ps(f->d[type == Q6_K ? 2 * c + h : is_k_quant(type) ? c : 0]);
}

static ALWAYS_INLINE __m512 chunk_m(const Factors *f, int type, int c) {
    return _mm512_set1_ps(f->m[is_k_quant(type) ? 8 + c : 0]);
}

/* Chunk c of block b's 32 weights in bfloat16, in order: the loader's float32 weights, rounded.
 * The 4- and 5-bit types compute the 16 or 32 weights their values can take, d * (q - offset)
 * + m (one fused rounding: d * q is exact, so it is the loader's d * q, then + m), and pick
 * from them (vpermw, which reads 5 bits of each index: a table of 16 is written twice over 32
 * words); Q8_0 and Q6_K scale each value. */
static ALWAYS_INLINE __m512i chunk_weights(const uint8_t *b, int type, int c, const Factors *f) {
    const __m256i q = chunk_bytes(b, type, c);
    if (type == Q8_0 || type == Q6_K)
        return (__m512i)_mm512_cvtne2ps_pbh(
            _mm512_mul_ps(bytes_to_f32(_mm256_extracti128_si256(q, 1), type),
                          chunk_d(f, type, c, 1)),
            _mm512_mul_ps(bytes_to_f32(_mm256_castsi256_si128(q), type), chunk_d(f, type, c, 0)));
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 d = chunk_d(f, type, c, 0), m = chunk_m(f, type, c);
    const __m512 lo = _mm512_fmadd_ps(_mm512_sub_ps(iota, _mm512_set1_ps((float)offset_of(type))),
                                      d, m);
    const __m512 hi = type == Q5_1 || type == Q5_K
        ? _mm512_fmadd_ps(_mm512_add_ps(iota, _mm512_set1_ps(16.0f)), d, m) : lo;
    return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* Chunks j0 .. j0 + count - 1 (count <= 8, j0 a multiple of 8) of a row as bfloat16, 32 words
 * each, into out: a K-quant's super-block, or eight blocks of the others, each chunk's position
 * in its block known at compile time (the loop is unrolled), its block's factors computed once. */
static ALWAYS_INLINE void dequant_group(const uint8_t *row, int type, int j0, int count,
                                        uint16_t *out) {
    Factors f;
    if (is_k_quant(type)) {
        const uint8_t *b = row + (int64_t)(j0 >> 3) * block_bytes(type);
        block_factors(b, type, &f);
        #pragma GCC unroll 8
        for (int c = 0; c < 8; c++)
            if (c < count) _mm512_store_si512(out + 32 * c, chunk_weights(b, type, c, &f));
        return;
    }
    #pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
        if (c >= count) break;
        const uint8_t *b = row + (int64_t)(j0 + c) * block_bytes(type);
        block_factors(b, type, &f);
        _mm512_store_si512(out + 32 * c, chunk_weights(b, type, 0, &f));
    }
}

/* ---- A few rows, AVX-512 FMAs: each output row's chunks multiplied in registers, the scales
 * factored out of the sums (as quant_linear_f32.c's few-rows path). ----
 * y = sum over chunks c of d_c * (x_c . q_c) (+ m_c * sum(x_c)): the quantized values are
 * widened to float32 (exact) and never scaled one by one, the activations are float32, so the
 * work a chunk is widening and float32 multiply-adds, two a cycle here, where this CPU's
 * bfloat16 instructions (vdpbf16ps, vcvtne2ps2bf16) take two cycles each. The mins' term is one
 * multiply-add a block (a K-quant's eight mins against its chunks' sums of x). A one-hot row
 * still reads a weight as the loader has it (d * q, then + m: two roundings), rounded to
 * bfloat16 once. */

/* 16 bytes at p widened to 32-bit lanes. */
static ALWAYS_INLINE __m512i widen16(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}

/* Chunk c of block b as float32 values, unscaled, offset as the loader offsets them (Q4_0:
 * q - 8, Q6_K: q - 32): elements 0-15 in *lo, 16-31 in *hi. Nibbles are split in 32-bit lanes,
 * where a K-quant's two chunks come from one widening of their bytes. */
static ALWAYS_INLINE void chunk_f32(const uint8_t *b, int type, int c, __m512 *lo, __m512 *hi) {
    const __m512i fifteen = _mm512_set1_epi32(15);
    __m512i q0, q1;
    if (type == Q4_K) {
        const uint8_t *qs = b + 16 + 32 * (c >> 1);
        q0 = widen16(qs);
        q1 = widen16(qs + 16);
        if (c & 1) {
            q0 = _mm512_srli_epi32(q0, 4);
            q1 = _mm512_srli_epi32(q1, 4);
        } else {
            q0 = _mm512_and_si512(q0, fifteen);
            q1 = _mm512_and_si512(q1, fifteen);
        }
    } else if (type == Q4_0 || type == Q4_1) {
        const __m512i q = widen16(b + (type == Q4_0 ? 4 : 8));
        q0 = _mm512_and_si512(q, fifteen);
        q1 = _mm512_srli_epi32(q, 4);
        if (type == Q4_0) {
            q0 = _mm512_sub_epi32(q0, _mm512_set1_epi32(8));
            q1 = _mm512_sub_epi32(q1, _mm512_set1_epi32(8));
        }
    } else if (type == Q8_0) {
        q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 4)));
        q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 20)));
    } else {  /* Q5_1, Q5_K, Q6_K: their bytes (chunk_bytes), offset */
        const __m256i q = _mm256_sub_epi8(chunk_bytes(b, type, c),
                                          _mm256_set1_epi8((char)offset_of(type)));
        q0 = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(q));
        q1 = _mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1));
    }
    *lo = _mm512_cvtepi32_ps(q0);
    *hi = _mm512_cvtepi32_ps(q1);
}

/* y[r, n] = sum_k x[r, k] w[n, k] (+ bias) for r < R, output rows [n0, n1). x: float32 [R, k];
 * xs: for types with a min, each row's chunk sums of x ([R][chunks]). chains: 2 keeps two
 * chains of each sum (alternate chunks), so the FMA latency does not bound one or two rows. */
static ALWAYS_INLINE void rows_times_blocks(int R, int chains, const float *x, int k,
                                            const float *xs,
                                            const uint8_t *w, int64_t row_bytes, int type,
                                            const uint16_t *bias, uint16_t *y, int64_t y_stride,
                                            int n0, int n1) {
    const int chunks = k / 32, per = is_k_quant(type) ? 8 : 1, bb = block_bytes(type);
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (int64_t)n * row_bytes;
        __m512 acc[MAX_ROWS][2];
        __m256 macc[MAX_ROWS];
        float mins[MAX_ROWS];
        for (int r = 0; r < R; r++) {
            acc[r][0] = acc[r][1] = _mm512_setzero_ps();
            macc[r] = _mm256_setzero_ps();
            mins[r] = 0.0f;
        }
        for (int j0 = 0; j0 < chunks; j0 += per) {
            const uint8_t *b = row + (int64_t)(j0 / per) * bb;
            Factors f;
            block_factors(b, type, &f);
            _mm_prefetch((const char *)b + 4 * row_bytes, _MM_HINT_T0);
            #pragma GCC unroll 8
            for (int c = 0; c < per; c++) {
                const int j = j0 + c, h = chains == 2 ? j & 1 : 0;
                __m512 lo, hi;
                chunk_f32(b, type, c, &lo, &hi);
                const __m512 d0 = chunk_d(&f, type, c, 0), d1 = chunk_d(&f, type, c, 1);
                for (int r = 0; r < R; r++) {
                    const float *xr = x + (int64_t)r * k + 32 * j;
                    if (type == Q6_K) {  /* its halves have scales of their own */
                        acc[r][h] = _mm512_fmadd_ps(d0, _mm512_mul_ps(lo, _mm512_loadu_ps(xr)),
                                                    acc[r][h]);
                        acc[r][h] = _mm512_fmadd_ps(d1, _mm512_mul_ps(hi,
                                                    _mm512_loadu_ps(xr + 16)), acc[r][h]);
                    } else {
                        const __m512 s = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16),
                                                         _mm512_mul_ps(lo, _mm512_loadu_ps(xr)));
                        acc[r][h] = _mm512_fmadd_ps(d0, s, acc[r][h]);
                    }
                }
            }
            if (has_min(type))
                for (int r = 0; r < R; r++) {
                    const float *xr = xs + (int64_t)r * chunks + j0;
                    if (per == 8)
                        macc[r] = _mm256_fmadd_ps(_mm256_load_ps(f.m + 8), _mm256_loadu_ps(xr),
                                                  macc[r]);
                    else
                        mins[r] += f.m[0] * xr[0];
                }
        }
        const float bv = bias != NULL ? bf16_load(bias[n]) : 0.0f;
        for (int r = 0; r < R; r++) {
            const __m512 a = chains == 2 ? _mm512_add_ps(acc[r][0], acc[r][1]) : acc[r][0];
            const __m128 m4 = _mm_add_ps(_mm256_castps256_ps128(macc[r]),
                                         _mm256_extractf128_ps(macc[r], 1));
            const float m = _mm_cvtss_f32(_mm_hadd_ps(_mm_hadd_ps(m4, m4), _mm_hadd_ps(m4, m4)))
                            + mins[r];
            y[r * y_stride + n] = bf16_store(_mm512_reduce_add_ps(a) + m + bv);
        }
    }
}

/* ---- Batch invariance: bfloat16 dot products, every row in one order at any row count. ----
 * Each chunk of 32 weights is dequantized once (chunk_weights: the loader's weights rounded to
 * bfloat16, as AMX and the dense rows take them) and multiplied with up to DOT_ROWS activation
 * rows as they are (vdpbf16ps: 32 products an instruction into 16 float32 lanes); a row's lanes
 * take the chunks in order and are summed at the end, whatever the other rows. */
#define DOT_ROWS 16

static ALWAYS_INLINE void rows_dot_blocks(int R, const uint16_t *x, int64_t x_stride, int k,
                                          const uint8_t *w, int64_t row_bytes, int type,
                                          const uint16_t *bias, uint16_t *y, int64_t y_stride,
                                          int n0, int n1) {
    const int chunks = k / 32, per = is_k_quant(type) ? 8 : 1, bb = block_bytes(type);
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (int64_t)n * row_bytes;
        __m512 acc[DOT_ROWS];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
        for (int j0 = 0; j0 < chunks; j0 += per) {
            const uint8_t *b = row + (int64_t)(j0 / per) * bb;
            Factors f;
            block_factors(b, type, &f);
            _mm_prefetch((const char *)b + 4 * row_bytes, _MM_HINT_T0);
            #pragma GCC unroll 8
            for (int c = 0; c < per; c++) {
                const __m512bh wv = (__m512bh)chunk_weights(b, type, c, &f);
                for (int r = 0; r < R; r++)
                    acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(
                        x + r * x_stride + 32 * (j0 + c)), wv);
            }
        }
        const float bv = bias != NULL ? bf16_load(bias[n]) : 0.0f;
        for (int r = 0; r < R; r++)
            y[r * y_stride + n] = bf16_store(_mm512_reduce_add_ps(acc[r]) + bv);
    }
}

/* M(T) for the block type `type`, one specialisation a type: no type tests in the inner loops. */
#define EACH_TYPE(M) switch (type) { \
    case Q4_0: M(Q4_0) break; \
    case Q4_1: M(Q4_1) break; \
    case Q5_1: M(Q5_1) break; \
    case Q8_0: M(Q8_0) break; \
    case Q4_K: M(Q4_K) break; \
    case Q5_K: M(Q5_K) break; \
    default: M(Q6_K) break; }

#define DOT(R, T) case R: rows_dot_blocks(R, xm, x_stride, k, w, row_bytes, T, bias, ym, \
                                          y_stride, b0, b1); break;
#define DOT_TYPE(T) switch (piece) { DOT(1, T) DOT(2, T) DOT(3, T) DOT(4, T) DOT(5, T) DOT(6, T) \
    DOT(7, T) DOT(8, T) DOT(9, T) DOT(10, T) DOT(11, T) DOT(12, T) DOT(13, T) DOT(14, T) \
    DOT(15, T) DOT(16, T) }

/* rows_dot_blocks on any number of rows (quant_linear_bf16's arguments): each thread's outputs
 * DOT_OUTPUTS at a time, whose blocks stay in its L2 while every piece of DOT_ROWS rows passes,
 * so that a prompt's rows do not stream the weights from memory once a piece. */
#define DOT_OUTPUTS 128

static void dot_rows(const uint16_t *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes,
                     int type, const uint16_t *bias, uint16_t *y, int64_t y_stride, int rows,
                     int n, int k, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        int n0, n1;
        thread_share(n, &n0, &n1);
        for (int b0 = n0; b0 < n1; b0 += DOT_OUTPUTS) {
            const int b1 = n1 - b0 < DOT_OUTPUTS ? n1 : b0 + DOT_OUTPUTS;
            for (int m0 = 0; m0 < rows; m0 += DOT_ROWS) {
                const int piece = rows - m0 < DOT_ROWS ? rows - m0 : DOT_ROWS;
                const uint16_t *xm = x + m0 * x_stride;
                uint16_t *ym = y + m0 * y_stride;
                EACH_TYPE(DOT_TYPE)
            }
        }
    }
}

/* ---- Many rows: AMX. ----
 * The weights are the tiles' A operand: sixteen output rows' blocks, dequantized to bfloat16
 * in their natural order, are one 16 x 32 tile, so no weight is shuffled. The activations are the
 * B operand, transposed once a call into bfloat16 pairs ("VNNI": row i of a tile holds x[m][2i],
 * x[m][2i+1] for 16 rows m), and the 16 x 16 float32 results are transposed back on the way out.
 * Dequantizing a block costs the same at any row count, while the tile products grow with the
 * rows: up to ~64 rows the dequantizing is most of the time
 * (docs/results/design-notes#amx-dequantizing). */
#if CONVEYOR_AMX
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_BUILT 1

/* 16 rows of 16 dwords (64 bytes) at src, src_stride bytes apart, transposed into dst. */
static inline void transpose16(const void *src, int64_t src_stride, void *dst,
                               int64_t dst_stride) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const char *)src + i * src_stride);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* now r[4g + j] holds, in each 128-bit lane L, column 4L.. of rows 4g..4g+3 at index j */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_si512((char *)dst + i * dst_stride, r[i]);
}

static int amx_permitted = -1;

/* Linux hands out the 8 KB of tile state only to a process that asks (once, for all threads). */
static int amx_usable(void) {
    if (amx_permitted < 0)  /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
        amx_permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_permitted;
}

/* The activations as B tiles: for m tile t and block j, 16 rows (pairs of k) of 16 dwords (one
 * per activation row, zero past `rows`), at xb + (t * blocks + j) * 256. */
static void activations_to_tiles(const uint16_t *x, int64_t x_stride, int rows, int k,
                                 uint32_t *xb) {
    const int blocks = k / 32, tiles = (rows + 15) / 16;
    #pragma omp for schedule(static)
    for (int i = 0; i < tiles * blocks; i++) {
        const int t = i / blocks, j = i % blocks, m0 = 16 * t;
        const uint16_t *src = x + m0 * x_stride + 32 * j;
        int64_t stride = 2 * x_stride;
        uint16_t pad[16 * 32];
        if (m0 + 16 > rows) {  /* the last, partial tile: its missing rows are zero */
            memset(pad, 0, sizeof pad);
            for (int m = m0; m < rows; m++)
                memcpy(pad + 32 * (m - m0), x + m * x_stride + 32 * j, 64);
            src = pad;
            stride = 64;
        }
        transpose16(src, stride, xb + (int64_t)i * 256, 64);
    }
}

/* One 16 x 16 float32 result tile (rows: 16 outputs from n0, columns: 16 activation rows from
 * m0), transposed, biased, rounded to bfloat16 and stored where both are in range. */
static void store_tile(const float *c, const uint16_t *bias, uint16_t *y, int64_t y_stride,
                       int m0, int rows, int n0, int n) {
    if (n0 >= n) return;
    float ct[256] __attribute__((aligned(64)));
    transpose16(c, 64, ct, 64);
    const __mmask16 mask = n - n0 >= 16 ? 0xffff : (__mmask16)((1u << (n - n0)) - 1);
    const __m512 b = bias != NULL ? bf16x16_to_f32(_mm256_maskz_loadu_epi16(mask, bias + n0))
                                  : _mm512_setzero_ps();
    for (int i = 0; i < 16 && m0 + i < rows; i++) {
        const __m512 v = _mm512_add_ps(_mm512_load_ps(ct + 16 * i), b);
        _mm256_mask_storeu_epi16(y + (m0 + i) * y_stride + n0, mask,
                                 (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* Result tiles 0-3 (see quant_matmul_amx) stored; 1 and 3 when `both` m tiles exist. */
static void store_results(float *c, const uint16_t *bias, uint16_t *y, int64_t y_stride,
                          int m0, int rows, int n0, int n, int both) {
    _tile_stored(0, c, 64); store_tile(c, bias, y, y_stride, m0, rows, n0, n);
    _tile_stored(2, c, 64); store_tile(c, bias, y, y_stride, m0, rows, n0 + 16, n);
    if (!both) return;
    _tile_stored(1, c, 64); store_tile(c, bias, y, y_stride, m0 + 16, rows, n0, n);
    _tile_stored(3, c, 64); store_tile(c, bias, y, y_stride, m0 + 16, rows, n0 + 16, n);
}

/* Where dequantizing a strip (32 weight rows, from n0, into bfloat16) has got to, in groups of
 * eight chunks (dequant_group). Strips are dequantized a few groups at a time between the tile
 * products of the previous one, so that the vector units and the tile unit work at once. */
typedef struct {
    const uint8_t *row;  /* the current row's blocks */
    uint16_t *out;       /* its bfloat16 row in the strip */
    int r, j, rows;      /* row in the strip, chunk in the row (a multiple of 8), rows that
                          * exist (< n) */
} StripCursor;

static inline void strip_start(StripCursor *c, const uint8_t *w, int64_t row_bytes, int n0,
                               int n, uint16_t *strip) {
    c->row = w + (int64_t)n0 * row_bytes;
    c->out = strip;
    c->r = c->j = 0;
    c->rows = n - n0 < 32 ? n - n0 : 32;
}

/* Up to `count` more groups; rows past n are zero. */
static ALWAYS_INLINE void strip_advance(StripCursor *c, int count, int type, int64_t row_bytes,
                                        int k) {
    const int chunks = k / 32;
    for (; count > 0 && c->r < 32; count--) {
        const int have = chunks - c->j < 8 ? chunks - c->j : 8;
        if (c->r < c->rows)
            dequant_group(c->row, type, c->j, have, c->out + 32 * c->j);
        else
            memset(c->out + 32 * c->j, 0, 64 * (size_t)have);
        c->j += 8;
        if (c->j >= chunks) {
            c->j = 0;
            c->r++;
            c->row += row_bytes;
            c->out += k;
        }
    }
}

/* Up to 32 rows (one or two m tiles): the four result tiles hold a strip's whole product, so the
 * strip's weights are taken eight chunks (a K-quant super-block) at a time: its 32 rows' group
 * (dequant_group) is a 16 KB buffer in L1, multiplied chunk by chunk (a weights tile is 16 rows
 * of one chunk, 512 bytes apart), while the next group is dequantized into the other buffer and
 * the next strip's bytes (a contiguous run of 32 rows) are prefetched a few lines a group. The
 * dequantized weights never leave L1, where the many-row path writes and rereads a whole strip
 * (36-96 KB) through L2. */
static ALWAYS_INLINE int amx_few(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                                  int64_t row_bytes, int type, const uint16_t *bias, uint16_t *y,
                                  int64_t y_stride, int rows, int n, int k, int threads) {
    const int blocks = k / 32, both = rows > 16, strips = (n + 31) / 32;
    const int groups = (blocks + 7) / 8;
    const int lines = (int)((32 * row_bytes + 63) / 64), per_group = (lines + groups - 1) / groups;
    uint32_t *xb = aligned_alloc(64, (size_t)(both + 1) * blocks * 1024);
    uint16_t *bufs = aligned_alloc(64, (size_t)threads * 2 * 32 * 256 * 2);
    if (xb == NULL || bufs == NULL) {
        free(xb);
        free(bufs);
        return -2;
    }
    #pragma omp parallel num_threads(threads)
    {
        activations_to_tiles(x, x_stride, rows, k, xb);  /* ends with a barrier */
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        uint16_t *buf[2] = {bufs + (size_t)t * 2 * 32 * 256, bufs + ((size_t)t * 2 + 1) * 32 * 256};
        float c[256] __attribute__((aligned(64)));
        configure_tiles();
        int s0, s1;
        thread_share(strips, &s0, &s1);
        for (int s = s0; s < s1; s++) {
            const int n0 = 32 * s, have = n - n0 < 32 ? n - n0 : 32;
            const uint8_t *strip = w + (int64_t)n0 * row_bytes;
            const char *next = (const char *)(strip + 32 * row_bytes);
            const int prefetch = s + 1 < s1 ? per_group : 0;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int g = 0; g < groups; g++) {
                uint16_t *gb = buf[g & 1];
                const int j0 = 8 * g, count = blocks - j0 < 8 ? blocks - j0 : 8;
                for (int r = 0; r < 32; r++) {
                    if (r < have)
                        dequant_group(strip + r * row_bytes, type, j0, count, gb + 256 * r);
                    else
                        memset(gb + 256 * r, 0, 64 * (size_t)count);
                }
                for (int i = 0; i < prefetch; i++)
                    _mm_prefetch(next + 64 * (g * per_group + i), _MM_HINT_T0);
                for (int cc = 0; cc < count; cc++) {
                    const uint32_t *b = xb + (int64_t)(j0 + cc) * 256;
                    _tile_loadd(4, gb + 32 * cc, 512);
                    _tile_loadd(6, b, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_loadd(5, gb + 16 * 256 + 32 * cc, 512);
                    _tile_dpbf16ps(2, 5, 6);
                    if (both) {
                        _tile_loadd(7, b + blocks * 256, 64);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
            }
            store_results(c, bias, y, y_stride, 0, rows, n0, n, both);
        }
        _tile_release();
    }
    free(bufs);
    free(xb);
    return 0;
}

/* Tiles: 0-3 results (n tile 0 x m tiles t, t + 1; n tile 1 x the same), 4-5 weights, 6-7
 * activations. Each loaded tile feeds two products, and the next block's loads wait on one
 * product, not on all of them (tiles are not renamed). */
static ALWAYS_INLINE int amx_many(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                                   int64_t row_bytes, int type, const uint16_t *bias, uint16_t *y,
                                   int64_t y_stride, int rows, int n, int k, int threads) {
    const int blocks = k / 32, m_tiles = (rows + 15) / 16, strips = (n + 31) / 32;
    /* The next strip's groups are dequantized evenly over this strip's products, a few at a
     * time, so that the products waiting on the tile unit never fill the reorder buffer. */
    const int64_t groups = 32 * ((blocks + 7) / 8), steps = (int64_t)(m_tiles + 1) / 2 * blocks;
    uint32_t *xb = aligned_alloc(64, (size_t)m_tiles * blocks * 1024);
    if (xb == NULL) return -2;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        StripCursor cur = {0};
        activations_to_tiles(x, x_stride, rows, k, xb);  /* ends with a barrier */
        uint16_t *a = aligned_alloc(64, (size_t)128 * k);  /* two strips */
        float c[256] __attribute__((aligned(64)));
        configure_tiles();
        int s0, s1;
        thread_share(strips, &s0, &s1);
        if (a == NULL) failed = 1;
        else if (s0 < s1) {
            strip_start(&cur, w, row_bytes, 32 * s0, n, a);
            strip_advance(&cur, (int)groups, type, row_bytes, k);
        }
        for (int s = s0; a != NULL && s < s1; s++) {
            const uint16_t *strip = a + (s - s0) % 2 * 32 * k;
            const int n0 = 32 * s, next = s + 1 < s1;
            if (next) strip_start(&cur, w, row_bytes, n0 + 32, n, a + (s + 1 - s0) % 2 * 32 * k);
            int64_t step = 0, done = 0;
            for (int t = 0; t < m_tiles; t += 2) {
                const int both = t + 1 < m_tiles;
                const uint32_t *b = xb + (int64_t)t * blocks * 256;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int j = 0; j < blocks; j++, b += 256) {
                    _tile_loadd(4, strip + 32 * j, 2 * k);
                    _tile_loadd(6, b, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_loadd(5, strip + 16 * k + 32 * j, 2 * k);
                    _tile_dpbf16ps(2, 5, 6);
                    if (both) {
                        _tile_loadd(7, b + blocks * 256, 64);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    const int64_t want = next ? groups * ++step / steps : 0;
                    strip_advance(&cur, (int)(want - done), type, row_bytes, k);
                    done = want;
                }
                store_results(c, bias, y, y_stride, 16 * t, rows, n0, n, both);
            }
            if (next) strip_advance(&cur, (int)groups, type, row_bytes, k);  /* any rest */
        }
        _tile_release();
        free(a);
    }
    free(xb);
    return failed ? -2 : 0;
}
/* One specialisation of each AMX path a block type: no type tests where a chunk is
 * dequantized. */
#define BY_TYPE(fn) \
    switch (type) { \
    case Q4_0: return fn(x, x_stride, w, row_bytes, Q4_0, bias, y, y_stride, rows, n, k, threads); \
    case Q4_1: return fn(x, x_stride, w, row_bytes, Q4_1, bias, y, y_stride, rows, n, k, threads); \
    case Q5_1: return fn(x, x_stride, w, row_bytes, Q5_1, bias, y, y_stride, rows, n, k, threads); \
    case Q8_0: return fn(x, x_stride, w, row_bytes, Q8_0, bias, y, y_stride, rows, n, k, threads); \
    case Q4_K: return fn(x, x_stride, w, row_bytes, Q4_K, bias, y, y_stride, rows, n, k, threads); \
    case Q5_K: return fn(x, x_stride, w, row_bytes, Q5_K, bias, y, y_stride, rows, n, k, threads); \
    default: return fn(x, x_stride, w, row_bytes, Q6_K, bias, y, y_stride, rows, n, k, threads); \
    }

static int quant_matmul_amx_few(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                                int64_t row_bytes, int type, const uint16_t *bias, uint16_t *y,
                                int64_t y_stride, int rows, int n, int k, int threads) {
    BY_TYPE(amx_few)
}

static int quant_matmul_amx(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                            int64_t row_bytes, int type, const uint16_t *bias, uint16_t *y,
                            int64_t y_stride, int rows, int n, int k, int threads) {
    BY_TYPE(amx_many)
}
#else
#define AMX_BUILT 0
#endif

/* Whether quant_linear_bf16 multiplies with AMX here (past FMA_FIRST_ROWS rows, any number of
 * them) rather than only with AVX-512 FMAs (up to MAX_ROWS rows): built for the amx tier and
 * allowed by the OS. */
int has_amx(void) {
#if AMX_BUILT
    return amx_usable();
#else
    return 0;
#endif
}

/* Up to two rows keep two chains of each sum. */
#define CASE(R, T) case R: rows_times_blocks(R, R <= 2 ? 2 : 1, xf, k, xs, w, row_bytes, T, \
                                             bias, y, y_stride, n0, n1); break;
#define ROWS(T) switch (rows) { CASE(1, T) CASE(2, T) CASE(3, T) CASE(4, T) CASE(5, T) \
                                CASE(6, T) CASE(7, T) CASE(8, T) }

/* The FMA kernel on up to MAX_ROWS rows (quant_linear_bf16's arguments). */
static int fma_rows(const uint16_t *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes,
                    int type, const uint16_t *bias, uint16_t *y, int64_t y_stride, int rows,
                    int n, int k, int threads) {
    const int chunks = k / 32;
    /* the activations in float32, once, and each chunk's sum (what a min multiplies) */
    float *xf = aligned_alloc(64, sizeof(float) * rows * (k + chunks) + 64);
    if (xf == NULL) return -2;
    float *xs = xf + rows * k;
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < chunks; j++) {
            float *xr = xf + (int64_t)r * k + 32 * j;
            const __m512 a = bf16x16_to_f32(_mm256_loadu_si256(
                (const __m256i *)(x + r * x_stride + 32 * j)));
            const __m512 b = bf16x16_to_f32(_mm256_loadu_si256(
                (const __m256i *)(x + r * x_stride + 32 * j + 16)));
            _mm512_store_ps(xr, a);
            _mm512_store_ps(xr + 16, b);
            xs[(int64_t)r * chunks + j] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
        }
    #pragma omp parallel num_threads(threads)
    {
        int n0, n1;
        thread_share(n, &n0, &n1);
        EACH_TYPE(ROWS)
    }
    free(xf);
    return 0;
}

/* y = x w^T (+ bias). x: [rows, k] bfloat16, y: [rows, n] bfloat16 (row strides given), w: n
 * rows of k / 32 blocks of `type`, row_bytes apart; bias: [n] bfloat16 or NULL. invariant: each
 * row's result the same whatever the other rows (rows_dot_blocks at any row count). Returns -1
 * for a type or shape it does not handle, -2 without memory for its scratch. */
int quant_linear_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes,
                      int type, const uint16_t *bias, uint16_t *y, int64_t y_stride, int rows,
                      int n, int k, int invariant, int threads) {
    if (!reads_bf16(type) || k % values_per_block(type) != 0 || rows < 1) return -1;
    if (invariant) {
        dot_rows(x, x_stride, w, row_bytes, type, bias, y, y_stride, rows, n, k, threads);
        return 0;
    }
#if AMX_BUILT
    if (rows > FMA_FIRST_ROWS && rows <= AMX_FEW_ROWS && has_amx())
        return quant_matmul_amx_few(x, x_stride, w, row_bytes, type, bias, y, y_stride, rows, n, k,
                                    threads);
    if (rows > FMA_FIRST_ROWS && has_amx())
        return quant_matmul_amx(x, x_stride, w, row_bytes, type, bias, y, y_stride, rows, n, k,
                                threads);
#endif
    if (rows > MAX_ROWS) return -1;
    if (rows >= DOT_FIRST_ROWS && !has_amx()) {
        dot_rows(x, x_stride, w, row_bytes, type, bias, y, y_stride, rows, n, k, threads);
        return 0;
    }
    return fma_rows(x, x_stride, w, row_bytes, type, bias, y, y_stride, rows, n, k, threads);
}

/* out[r] = row ids[r] of w (n rows of k weights, in this file's block format) in bfloat16: the
 * bfloat16 model's weights (the embedding's rows a step looks up; the rows of a matrix the
 * FMA kernel multiplies densely past MAX_ROWS). Returns -1 for a type it does not read. */
int dequant_rows_bf16(const uint8_t *w, int64_t row_bytes, int type, const int64_t *ids, int n,
                      int k, uint16_t *out, int64_t out_stride, int threads) {
    if (!reads_bf16(type) || k % values_per_block(type) != 0) return -1;
    const int chunks = k / 32;
    #pragma omp parallel for schedule(static) num_threads(threads) if (n >= 2 * threads)
    for (int r = 0; r < n; r++) {
        uint16_t *dst = out + r * out_stride;
        for (int j0 = 0; j0 < chunks; j0 += 8) {  /* via an aligned group: dst may not be */
            uint16_t group[256] __attribute__((aligned(64)));
            const int count = chunks - j0 < 8 ? chunks - j0 : 8;
            dequant_group(w + ids[r] * row_bytes, type, j0, count, group);
            memcpy(dst + 32 * j0, group, 64 * (size_t)count);
        }
    }
    return 0;
}
