/* What every tier's quant_linear_int.c (--activation-quant) shares: which calls they take and
 * their entry points. */
#ifndef CONVEYOR_INT_ACTIVATIONS_H
#define CONVEYOR_INT_ACTIVATIONS_H

#include <stdint.h>

#include "blocks.h"
#include "common.h"

/* Whether the integer linears take this type, shape and level count (-1 from them if not). */
static inline int int_linear_takes(int type, int k, int rows, int levels) {
    return reads_type(type) && !is_dense(type) && k % values_per_block(type) == 0 && rows >= 1
           && (levels == 127 || levels == 16383);
}

/* The values one activation scale covers: llama.cpp's numerics, int8 taking one scale per 256
 * (Q8_K) on the K-quants and per 32 (Q8_0) on the other types; int16 per 32. The kernels keep a
 * scale per chunk of 32 either way (a run of 256's eight chunks share theirs). */
static inline int activation_run(int type, int levels) {
    return levels == 127 && is_k_quant(type) ? 256 : 32;
}

/* The entries of a tier's quant_linear_int.c, over its
 * impl(x, x_stride, bf16, w, row_bytes, type, bias, y, y_stride, rows, n, k, levels, threads):
 * float32, and bfloat16 at the tiers that compute it (where Q4_0, Q4_1 and Q8_0 come with
 * their scalars widened, as the bfloat16 float kernels read them). */
#define INT_LINEAR_F32(impl) \
int quant_linear_int_f32(const float *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes, \
                         int type, const float *bias, float *y, int64_t y_stride, int rows, \
                         int n, int k, int levels, int threads) { \
    return impl(x, x_stride, 0, w, row_bytes, type, bias, y, y_stride, rows, n, k, levels, \
                threads); \
}
#define INT_LINEAR_BF16(impl) \
int quant_linear_int_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, \
                          int64_t row_bytes, int type, const uint16_t *bias, uint16_t *y, \
                          int64_t y_stride, int rows, int n, int k, int levels, int threads) { \
    return impl(x, x_stride, 1, w, row_bytes, type, bias, y, y_stride, rows, n, k, levels, \
                threads); \
}

#endif
