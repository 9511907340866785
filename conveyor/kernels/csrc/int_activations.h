/* The integer linears' activations (--activation-quant): each run of 32 values of a row scaled
 * to its largest magnitude and rounded to the nearest integer, halves to even, as
 * conveyor/kernels/activations.py (the reference) does. Shared by every tier's
 * quant_linear_int.c. */
#ifndef CONVEYOR_INT_ACTIVATIONS_H
#define CONVEYOR_INT_ACTIVATIONS_H

#include <math.h>
#include <stdint.h>

#include "common.h"

/* Row r's runs of x quantized: p [rows][k] int16, s [rows][k / 32], psum the runs' sums.
 * Not under fast math: the scale is amax / levels and its inverse 1 / scale, rounded as the
 * reference rounds them (a reciprocal instead of the division could move a value across a
 * rounding boundary). */
__attribute__((optimize("no-fast-math")))
static void quantize_runs(const void *x, int64_t x_stride, int bf16, int rows, int k,
                          int levels, int16_t *p, float *s, int32_t *psum) {
    const int chunks = k / 32;
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
                p[((int64_t)r * chunks + j) * 32 + e] = q;
                sum += q;
            }
            s[(int64_t)r * chunks + j] = scale;
            psum[(int64_t)r * chunks + j] = sum;
        }
}

#endif
