/* A linear layer for a few rows, read straight from llama.cpp's Q4_0, Q4_1 or Q8_0 blocks
 * (as the loader keeps them: each block's fp16 scale, and min, widened to float32 in place).
 *
 * At the batch sizes of a decode step with one or a few requests, a bfloat16 linear is bound by
 * reading its weights: 2 bytes a weight. These blocks hold the same weights in 0.63 (Q4_0),
 * 0.75 (Q4_1) or 1.13 (Q8_0) bytes, so reading them and dequantizing in registers is faster.
 * The weights are dequantized exactly as the loader does (float32 d * q, + m: two roundings, no
 * fused multiply-add) and rounded to bfloat16, so they are the bfloat16 model's weights bit for
 * bit; products are summed in float32 as oneDNN's bfloat16 matmul does, and only the order of
 * that sum differs. Dequantizing costs ~7-8 cycles a block of 32, so past a few rows the prepacked
 * bfloat16 matmul (AMX) wins; the caller picks by row count.
 *
 * Needs AVX-512 (F, BF16); elsewhere has_avx512_bf16() says 0 (for this kernel and the decode
 * attention) and the model keeps its bfloat16 linears.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "bf16.h"

int has_avx512_bf16(void) { return CONVEYOR_AVX512_BF16; }

#if CONVEYOR_AVX512_BF16
enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  /* ggml's type numbers */
#define MAX_ROWS 8
#define EXACT (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

static inline float f32_load(const uint8_t *p) {
    float f;
    memcpy(&f, p, 4);
    return f;
}

/* 16 float32 to bfloat16 (round to nearest even), widened back to float32 */
static inline __m512 round_bf16(__m512 v) {
    return bf16x16_to_f32((__m256i)_mm512_cvtneps_pbh(v));
}

/* One block's 32 weights, rounded to bfloat16 and held in float32: elements 0-15 in *lo, 16-31
 * in *hi. (Float32 multiply-adds run 2x the multiply-accumulates of AVX-512 BF16 dot products
 * on this hardware, so the weights are widened rather than the activations narrowed.) */
static inline void dequant_block(const uint8_t *b, int type, __m512 *lo, __m512 *hi) {
    if (type == Q8_0) {
        const __m512 d = _mm512_set1_ps(f32_load(b));
        const __m512 l = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 4))));
        const __m512 h = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 20))));
        *lo = round_bf16(_mm512_mul_round_ps(l, d, EXACT));
        *hi = round_bf16(_mm512_mul_round_ps(h, d, EXACT));
        return;
    }
    /* A 4-bit block has 16 distinct weights: dequantize those once into a table and pick each
     * of the 32 by its nibble (element j is the low nibble of byte j, element j + 16 its high). */
    const int has_min = type == Q4_1;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 q = has_min ? iota : _mm512_sub_ps(iota, _mm512_set1_ps(8.0f));
    __m512 table = _mm512_mul_round_ps(q, _mm512_set1_ps(f32_load(b)), EXACT);
    if (has_min) table = _mm512_add_round_ps(table, _mm512_set1_ps(f32_load(b + 4)), EXACT);
    table = round_bf16(table);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 4 + 4 * has_min)));
    *lo = _mm512_permutexvar_ps(bytes, table);  /* vpermps uses the index's low 4 bits only */
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}

static inline int block_bytes(int type) {
    return type == Q8_0 ? 36 : type == Q4_1 ? 24 : 20;
}

/* y[r, n] = sum_k x[r, k] w[n, k] for r < R, output rows [n0, n1); x here is float32, [R, k]. */
static inline __attribute__((always_inline)) void rows_times_blocks(
        int R, const float *x, int k, const uint8_t *w, int64_t row_bytes, int type,
        const uint16_t *bias, uint16_t *y, int64_t y_stride, int n0, int n1) {
    const int bb = block_bytes(type), blocks = k / 32;
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (int64_t)n * row_bytes;
        __m512 acc[MAX_ROWS][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int j = 0; j < blocks; j++) {
            __m512 lo, hi;
            dequant_block(row + (int64_t)j * bb, type, &lo, &hi);
            for (int r = 0; r < R; r++) {
                const float *xr = x + (int64_t)r * k + 32 * j;
                acc[r][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[r][1]);
            }
        }
        const float b = bias != NULL ? bf16_load(bias[n]) : 0.0f;
        for (int r = 0; r < R; r++)
            y[r * y_stride + n] = bf16_store(
                _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])) + b);
    }
}

#define CASE(R) case R: rows_times_blocks(R, xf, k, w, row_bytes, type, bias, y, y_stride, \
                                         n0, n1); break;
#endif

/* y = x w^T (+ bias). x: [rows, k] bfloat16, y: [rows, n] bfloat16 (row strides given), w: n
 * rows of k / 32 blocks of `type`, row_bytes apart; bias: [n] bfloat16 or NULL. Returns -1 for
 * a type or shape it does not handle, -2 without memory for its scratch. */
int quant_linear(const uint16_t *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes,
                 int type, const uint16_t *bias, uint16_t *y, int64_t y_stride, int rows, int n,
                 int k, int threads) {
#if !CONVEYOR_AVX512_BF16
    return -1;  /* not built for this CPU */
#else
    if ((type != Q4_0 && type != Q4_1 && type != Q8_0) || k % 32 != 0 || rows < 1
            || rows > MAX_ROWS)
        return -1;
    float *xf = malloc(sizeof(float) * rows * k);  /* the activations in float32, once */
    if (xf == NULL) return -2;
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < k; i++) xf[(int64_t)r * k + i] = bf16_load(x[r * x_stride + i]);
    #pragma omp parallel num_threads(threads)
    {
        int nt = 1, t = 0;
#ifdef _OPENMP
        nt = omp_get_num_threads();
        t = omp_get_thread_num();
#endif
        const int per = (n + nt - 1) / nt;
        const int n0 = t * per, n1 = n0 + per < n ? n0 + per : n;
        switch (rows) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) }
    }
    free(xf);
    return 0;
#endif
}
