/* act(gate) * up for the feed-forward, in the model dtype (float32 or bfloat16), in one pass:
 * SiLU (SwiGLU: Llama, Qwen, Mistral, Phi) or GELU's tanh approximation (GeGLU: Gemma).
 *
 * The same roundings as F.silu(gate) * up and F.gelu(gate, approximate="tanh") * up: the
 * activation in float32 rounded to the model dtype, then the product rounded. The float32 exp,
 * tanh and division can round apart from PyTorch's by one bfloat16 step, rarely. One call
 * replaces two PyTorch ops and the split between them, and the product is written over the
 * gate, so no new tensor is made.
 */
#include <stdint.h>
#include <math.h>

#include "common.h"

static ALWAYS_INLINE float activation(float v, int gelu) {
    if (gelu)  /* 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as PyTorch spells it */
        return 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * (v * v * v))));
    return v / (1.0f + expf(-v));
}

/* gu: [rows, 2 * inter] with row stride, gate then up in each row; the products go into the
 * gate's half. */
static ALWAYS_INLINE void glu_mul(void *gu, int64_t stride, int rows, int inter, int threads,
                                  int bf16, int gelu) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 2 * threads)
    for (int r = 0; r < rows; r++) {
        /* the gate and up halves as pointers of their own, which never overlap: one vector
         * loop, the same for every row (batch invariance), not one picked by a run-time
         * overlap check */
        const size_t elem = bf16 ? 2 : 4;
        void *restrict gate = (char *)gu + elem * (int64_t)r * stride;
        const void *restrict up = (const char *)gate + elem * inter;
        for (int j = 0; j < inter; j++) {
            const float v = elem_load(gate, j, bf16);
            elem_store(gate, j, round_to(activation(v, gelu), bf16) * elem_load(up, j, bf16),
                       bf16);
        }
    }
}

void silu_mul_f32(float *gu, int64_t stride, int rows, int inter, int threads) {
    glu_mul(gu, stride, rows, inter, threads, 0, 0);
}

void silu_mul_bf16(uint16_t *gu, int64_t stride, int rows, int inter, int threads) {
    glu_mul(gu, stride, rows, inter, threads, 1, 0);
}

void gelu_tanh_mul_f32(float *gu, int64_t stride, int rows, int inter, int threads) {
    glu_mul(gu, stride, rows, inter, threads, 0, 1);
}

void gelu_tanh_mul_bf16(uint16_t *gu, int64_t stride, int rows, int inter, int threads) {
    glu_mul(gu, stride, rows, inter, threads, 1, 1);
}
