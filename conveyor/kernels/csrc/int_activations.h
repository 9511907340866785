/* The integer linears' activations (--activation-quant): each run of 32 values of a row scaled
 * to its largest magnitude and rounded to the nearest integer, halves to even, as
 * conveyor/kernels/activations.py (the reference) does. Shared by every tier's
 * quant_linear_int.c. */
#ifndef CONVEYOR_INT_ACTIVATIONS_H
#define CONVEYOR_INT_ACTIVATIONS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "blocks.h"
#include "common.h"

/* x's rows as an integer linear multiplies them: p [rows][k] int16, and per run of 32 its
 * scale s and s * sum(p) (sp: what a chunk's min multiplies) [rows][k / 32]. */
typedef struct {
    int16_t *p;
    float *s, *sp;
} IntRows;

/* Whether the integer linears take this type, shape and level count (-1 from them if not). */
static inline int int_linear_takes(int type, int k, int rows, int levels) {
    return reads_type(type) && !is_dense(type) && k % values_per_block(type) == 0 && rows >= 1
           && (levels == 127 || levels == 32767);
}

static inline void int_rows_free(IntRows *a) {
    free(a->p);
    free(a->s);
    free(a->sp);
}

/* Each run of 32 values scaled to amax / levels, rounded with its inverse 1 / scale. Not under
 * fast math: both rounded as the reference rounds them (a reciprocal instead of the division
 * could move a value across a rounding boundary). Returns -2 (nothing held) without memory. */
__attribute__((optimize("no-fast-math")))
static int int_rows(IntRows *a, const void *x, int64_t x_stride, int bf16, int rows, int k,
                    int levels) {
    const int chunks = k / 32;
    a->p = malloc((size_t)rows * k * sizeof(int16_t));
    a->s = malloc((size_t)rows * chunks * sizeof(float));
    a->sp = malloc((size_t)rows * chunks * sizeof(float));
    if (a->p == NULL || a->s == NULL || a->sp == NULL) {
        int_rows_free(a);
        return -2;
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < chunks; j++) {
            float v[32], amax = 0.0f;
            for (int e = 0; e < 32; e++) {
                v[e] = elem_load(x, r * x_stride + 32 * j + e, bf16);
                amax = fmaxf(amax, fabsf(v[e]));
            }
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

/* The two entries of a tier's quant_linear_int.c, over its
 * impl(x, x_stride, bf16, w, row_bytes, type, bias, y, y_stride, rows, n, k, levels, threads). */
#define INT_LINEAR_ENTRIES(impl) \
int quant_linear_int_f32(const float *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes, \
                         int type, const float *bias, float *y, int64_t y_stride, int rows, \
                         int n, int k, int levels, int threads) { \
    return impl(x, x_stride, 0, w, row_bytes, type, bias, y, y_stride, rows, n, k, levels, \
                threads); \
} \
int quant_linear_int_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, \
                          int64_t row_bytes, int type, const uint16_t *bias, uint16_t *y, \
                          int64_t y_stride, int rows, int n, int k, int levels, int threads) { \
    return impl(x, x_stride, 1, w, row_bytes, type, bias, y, y_stride, rows, n, k, levels, \
                threads); \
}

#endif
