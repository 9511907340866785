/* SiLU(gate) * up for the feed-forward, for the CPU, in bfloat16, in one pass.
 *
 * The same roundings as F.silu(gate) * up in bfloat16: SiLU in float32 rounded to bfloat16, then
 * the product rounded. The float32 exp and division can round apart from PyTorch's by one
 * bfloat16 step, rarely. One call replaces two PyTorch ops and the split between them, and the
 * product is written over the gate, so no new tensor is made.
 */
#include <stdint.h>
#include <math.h>

#include "bf16.h"

/* gu: [rows, 2 * inter] with row stride, gate then up in each row; the products go into the
 * gate's half. */
void silu_mul(uint16_t *gu, int64_t stride, int rows, int inter, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 2 * threads)
    for (int r = 0; r < rows; r++) {
        uint16_t *g = gu + (int64_t)r * stride, *u = g + inter;
        for (int j = 0; j < inter; j++) {
            const float v = bf16_load(g[j]);
            g[j] = bf16_store(bf16_load(bf16_store(v / (1.0f + expf(-v)))) * bf16_load(u[j]));
        }
    }
}
