/* Residual add and RMSNorm in one pass over each row, in the model dtype (float32 or bfloat16).
 *
 * The same arithmetic as the model's unfused PyTorch path (and transformers): the residual sum
 * is rounded to the model dtype, normalised in float32, rounded, then scaled by the weight with
 * one more rounding. Only the order of the float32 sum of squares differs, so a bfloat16 value
 * can differ from the unfused path by one step, rarely. One call replaces ~10 small PyTorch
 * ops, whose fixed cost is most of a norm at small batch sizes.
 */
#include <stdint.h>
#include <math.h>

#include "common.h"

/* x, out: [rows, dim] with row strides; residual: [rows, dim] contiguous, or NULL. With a
 * residual, residual += x (in the model dtype) and the sum is normalised; otherwise x is. */
static ALWAYS_INLINE void add_rms_norm(const void *x, int64_t x_stride, void *residual,
                                       const void *weight, void *out, int64_t out_stride,
                                       int rows, int dim, float eps, int threads, int bf16) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 2 * threads)
    for (int i = 0; i < rows; i++) {
        const int64_t xi = i * x_stride, oi = i * out_stride, ri = (int64_t)i * dim;
        float h[dim];
        if (residual != NULL) {
            for (int d = 0; d < dim; d++) {
                h[d] = round_to(elem_load(residual, ri + d, bf16) + elem_load(x, xi + d, bf16),
                                bf16);
                elem_store(residual, ri + d, h[d], bf16);
            }
        } else {
            for (int d = 0; d < dim; d++) h[d] = elem_load(x, xi + d, bf16);
        }
        float squares = 0.0f;
        for (int d = 0; d < dim; d++) squares += h[d] * h[d];
        const float inv = 1.0f / sqrtf(squares / dim + eps);
        for (int d = 0; d < dim; d++)
            elem_store(out, oi + d, elem_load(weight, d, bf16) * round_to(h[d] * inv, bf16),
                       bf16);
    }
}

void add_rms_norm_f32(const float *x, int64_t x_stride, float *residual, const float *weight,
                      float *out, int64_t out_stride, int rows, int dim, float eps, int threads) {
    add_rms_norm(x, x_stride, residual, weight, out, out_stride, rows, dim, eps, threads, 0);
}

void add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, uint16_t *residual,
                       const uint16_t *weight, uint16_t *out, int64_t out_stride, int rows,
                       int dim, float eps, int threads) {
    add_rms_norm(x, x_stride, residual, weight, out, out_stride, rows, dim, eps, threads, 1);
}
