/* Residual add and RMSNorm in one pass over each row, for the CPU, in bfloat16.
 *
 * The same arithmetic as the model's unfused PyTorch path (and transformers): the residual sum
 * is rounded to bfloat16, normalised in float32, rounded to bfloat16, then scaled by the weight
 * with one more rounding. Only the order of the float32 sum of squares differs, so a value can
 * differ from the unfused path by one bfloat16 step, rarely. One call replaces ~10 small PyTorch
 * ops, whose fixed cost is most of a norm at small batch sizes.
 */
#include <stdint.h>
#include <math.h>

#include "bf16.h"

/* x, out: [rows, dim] with row strides; residual: [rows, dim] contiguous, or NULL. With a
 * residual, residual += x (in bfloat16) and the sum is normalised; otherwise x is. */
void add_rms_norm(const uint16_t *x, int64_t x_stride, uint16_t *residual,
                  const uint16_t *weight, uint16_t *out, int64_t out_stride, int rows, int dim,
                  float eps, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 2 * threads)
    for (int i = 0; i < rows; i++) {
        const uint16_t *xi = x + i * x_stride;
        uint16_t *oi = out + i * out_stride;
        float h[dim];
        if (residual != NULL) {
            uint16_t *ri = residual + (int64_t)i * dim;
            for (int d = 0; d < dim; d++) {
                ri[d] = bf16_store(bf16_load(ri[d]) + bf16_load(xi[d]));
                h[d] = bf16_load(ri[d]);
            }
        } else {
            for (int d = 0; d < dim; d++) h[d] = bf16_load(xi[d]);
        }
        float squares = 0.0f;
        for (int d = 0; d < dim; d++) squares += h[d] * h[d];
        const float inv = 1.0f / sqrtf(squares / dim + eps);
        for (int d = 0; d < dim; d++)
            oi[d] = bf16_store(bf16_load(weight[d]) * bf16_load(bf16_store(h[d] * inv)));
    }
}
