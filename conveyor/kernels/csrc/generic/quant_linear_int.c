/* A block linear on integer activations (--activation-quant int16 | int8), in plain C.
 *
 * Each row of x is cut into runs of 32 values (a chunk of the weights' row), or of 256 (int8
 * on the K-quants: activation_run), each run scaled to its largest magnitude and rounded to the
 * nearest integer, halves to even: int16 (levels 16383: 15 bits, so that the VNNI kernels take
 * each value as two signed bytes) or int8 (127: llama.cpp's Q8_0, or Q8_K), x ~ s * p. A
 * chunk of weights is w = d * q + m (blocks.h; Q6_K has a d per 16), so its share of y is
 *
 *     (d * s) * (q . p) + (m * s) * sum(p)
 *
 * with q . p an exact integer dot product (|q| <= 128, |p| <= 16383, 16 of them: within
 * int32) and the rest float32. conveyor/kernels/activations.py is the quantization's
 * reference; the sums are F.linear's on the quantized activations up to float32 rounding.
 * avx2/quant_linear_int.c replaces this file from the avx2 tier on, avx512/quant_linear_int.c
 * at the tiers with VNNI.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "common.h"
#include "int_activations.h"

/* x's rows as an integer linear multiplies them: p [rows][k] int16, and per chunk of 32 its
 * run's scale s and s * sum(p) (sp: what a chunk's min multiplies) [rows][k / 32]. */
typedef struct {
    int16_t *p;
    float *s, *sp;
} IntRows;

static inline void int_rows_free(IntRows *a) {
    free(a->p);
    free(a->s);
    free(a->sp);
}

/* Each run of `run` values scaled to amax / levels, rounded with its inverse 1 / scale. Not under
 * fast math: both rounded as the reference rounds them (a reciprocal instead of the division
 * could move a value across a rounding boundary). Returns -2 (nothing held) without memory. */
__attribute__((optimize("no-fast-math")))
static int int_rows(IntRows *a, const void *x, int64_t x_stride, int bf16, int rows, int k,
                    int levels, int run) {
    const int chunks = k / 32;
    a->p = malloc((size_t)rows * k * sizeof(int16_t));
    a->s = malloc((size_t)rows * chunks * sizeof(float));
    a->sp = malloc((size_t)rows * chunks * sizeof(float));
    if (a->p == NULL || a->s == NULL || a->sp == NULL) {
        int_rows_free(a);
        return -2;
    }
    float amax = 0.0f;
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < chunks; j++) {
            if (32 * j % run == 0) amax = magnitude_of(x, r * x_stride + 32 * j, bf16, run);
            float v[32];
            for (int e = 0; e < 32; e++) v[e] = elem_load(x, r * x_stride + 32 * j + e, bf16);
            const float scale = amax / (float)levels;
            const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
            int32_t sum = 0;
            for (int e = 0; e < 32; e++) {
                const int16_t q = (int16_t)rintf(v[e] * inverse);
                a->p[((int64_t)r * chunks + j) * 32 + e] = q;
                sum += q;
            }
            a->s[(int64_t)r * chunks + j] = scale;
            a->sp[(int64_t)r * chunks + j] = scale * (float)sum;
        }
    return 0;
}

/* sum of a[e] * b[e] over 16 int16 pairs (exact in int32) */
static inline int32_t dot16(const int16_t *a, const int16_t *b) {
    int32_t sum = 0;
    for (int e = 0; e < 16; e++) sum += (int32_t)a[e] * b[e];
    return sum;
}

/* y = x w^T (+ bias), x and y float32 or bfloat16 (bf16) with row strides; w: n rows of k
 * weights in blocks of `type` (not a dense type: those run in floating point), row_bytes
 * apart. Returns -1 for a type, shape or level it does not handle, -2 without memory. */
static int quant_linear_int(const void *x, int64_t x_stride, int bf16, const uint8_t *w,
                            int64_t row_bytes, int type, const void *bias, void *y,
                            int64_t y_stride, int rows, int n, int k, int levels, int threads) {
    if (!int_linear_takes(type, k, rows, levels)) return -1;
    const int chunks = k / 32;
    IntRows a;
    if (int_rows(&a, x, x_stride, bf16, rows, k, levels, activation_run(type, levels)) != 0)
        return -2;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        int16_t *qw = malloc((size_t)k * sizeof(int16_t));
        float *d = malloc((size_t)chunks * 2 * sizeof(float)), *m = malloc(chunks * sizeof(float));
        int n0, n1;
        thread_share(n, &n0, &n1);
        if (qw == NULL || d == NULL || m == NULL) failed = 1;  /* (its rows are not computed) */
        for (int o = n0; !failed && o < n1; o++) {
            const uint8_t *row = w + (int64_t)o * row_bytes;
            for (int j = 0; j < chunks; j++) {  /* the row's integers and factors, once */
                int q[32];
                chunk_scales(row, type, j, d + 2 * j, m + j);
                chunk_quants(row, type, j, q);
                for (int e = 0; e < 32; e++) qw[32 * j + e] = (int16_t)q[e];
            }
            const float b = bias != NULL ? elem_load(bias, o, bf16) : 0.0f;
            for (int r = 0; r < rows; r++) {
                const int16_t *pr = a.p + (int64_t)r * k;
                const float *sr = a.s + (int64_t)r * chunks, *spr = a.sp + (int64_t)r * chunks;
                float acc = 0.0f;
                for (int j = 0; j < chunks; j++) {
                    const float lo = (float)dot16(qw + 32 * j, pr + 32 * j);
                    const float hi = (float)dot16(qw + 32 * j + 16, pr + 32 * j + 16);
                    acc += sr[j] * (d[2 * j] * lo + d[2 * j + 1] * hi) + m[j] * spr[j];
                }
                elem_store(y, r * y_stride + o, acc + b, bf16);
            }
        }
        free(qw);
        free(d);
        free(m);
    }
    int_rows_free(&a);
    return failed ? -2 : 0;
}

INT_LINEAR_F32(quant_linear_int)
