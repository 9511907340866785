/* A float32 linear read straight from llama.cpp's blocks (blocks.h), as the file stores them
 * (or dense float32, float16 or bfloat16 rows), in plain C.
 *
 * Each weight is dequantized exactly as the loader does (float32 d * q, + m: two roundings; the
 * build does not contract them into a fused multiply-add), so these are the float32 model's
 * weights bit for bit, and the products are summed in float32: only the order of that sum
 * differs from F.linear. An output row's blocks are dequantized once a call into a buffer that
 * stays in L1, then every activation row is multiplied by it. The avx2 tier replaces this file.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "common.h"

/* Chunk j's 32 weights of a row, as the loader computes them. */
static inline void dequant_chunk(const uint8_t *row, int type, int j, float *w) {
    if (is_dense(type)) {
        dense_values(row, type, j, w);
        return;
    }
    float d[2], m;
    int q[32];
    chunk_scales(row, type, j, d, &m);
    chunk_quants(row, type, j, q);
    for (int e = 0; e < 32; e++) {
        w[e] = d[e >> 4] * (float)q[e];
        if (has_min(type)) w[e] += m;
    }
}

/* y = x w^T (+ bias). x: [rows, k], y: [rows, n] float32 (row strides given), w: n rows of
 * k weights in blocks of `type`, row_bytes apart; bias: [n] or NULL. invariant: each row's
 * result the same whatever the other rows, which it always is here (a row's sum is in k's
 * order). Returns -1 for a type or shape it does not handle. */
int quant_linear_f32(const float *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes,
                     int type, const float *bias, float *y, int64_t y_stride, int rows, int n,
                     int k, int invariant, int threads) {
    (void)invariant;
    if (!reads_type(type) || k % values_per_block(type) != 0 || rows < 1) return -1;
    #pragma omp parallel num_threads(threads)
    {
        float wr[k];
        int n0, n1;
        thread_share(n, &n0, &n1);
        for (int o = n0; o < n1; o++) {
            const uint8_t *row = w + (int64_t)o * row_bytes;
            for (int j = 0; j < k / 32; j++) dequant_chunk(row, type, j, wr + 32 * j);
            const float b = bias != NULL ? bias[o] : 0.0f;
            for (int r = 0; r < rows; r++) {
                const float *xr = x + r * x_stride;
                float sum = 0.0f;
                for (int i = 0; i < k; i++) sum += xr[i] * wr[i];
                y[r * y_stride + o] = sum + b;
            }
        }
    }
    return 0;
}
