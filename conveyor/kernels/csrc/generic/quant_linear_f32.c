/* A float32 linear read straight from llama.cpp's Q4_0, Q4_1 or Q8_0 blocks, as the file stores
 * them (each block's fp16 scale, and min, then its quantized values), in plain C.
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

#include "common.h"

/* One block's 32 weights, as the loader computes them. Element j of a 4-bit block is the low
 * nibble of byte j, element j + 16 its high nibble. */
static inline void dequant_block(const uint8_t *b, int type, float *w) {
    const float d = half_load(b);
    if (type == Q8_0) {
        for (int j = 0; j < 32; j++) w[j] = d * (float)(int8_t)b[stored_values_at(type) + j];
        return;
    }
    const uint8_t *q = b + stored_values_at(type);
    if (type == Q4_1) {
        const float m = half_load(b + 2);
        for (int j = 0; j < 16; j++) {
            w[j] = d * (float)(q[j] & 15) + m;
            w[j + 16] = d * (float)(q[j] >> 4) + m;
        }
    } else {
        for (int j = 0; j < 16; j++) {
            w[j] = d * (float)((q[j] & 15) - 8);
            w[j + 16] = d * (float)((q[j] >> 4) - 8);
        }
    }
}

/* y = x w^T (+ bias). x: [rows, k], y: [rows, n] float32 (row strides given), w: n rows of
 * k / 32 blocks of `type`, row_bytes apart; bias: [n] or NULL. Returns -1 for a type or shape
 * it does not handle. */
int quant_linear_f32(const float *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes,
                     int type, const float *bias, float *y, int64_t y_stride, int rows, int n,
                     int k, int threads) {
    if ((type != Q4_0 && type != Q4_1 && type != Q8_0) || k % 32 != 0 || rows < 1) return -1;
    const int bb = stored_block_bytes(type), blocks = k / 32;
    #pragma omp parallel num_threads(threads)
    {
        float wr[k];
        int n0, n1;
        thread_share(n, &n0, &n1);
        for (int o = n0; o < n1; o++) {
            const uint8_t *row = w + (int64_t)o * row_bytes;
            for (int j = 0; j < blocks; j++)
                dequant_block(row + (int64_t)j * bb, type, wr + 32 * j);
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
