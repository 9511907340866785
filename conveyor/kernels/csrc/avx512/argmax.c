/* argmax_rows (generic/argmax.c) in AVX-512: 16 lanes a compare, masked tails
 * (docs/results/design-notes#argmax). */
#include <stdint.h>
#include <immintrin.h>

#include "common.h"

static int64_t row_argmax(const float *x, int64_t cols) {
    __m512 acc = _mm512_set1_ps(-__builtin_inff());
    int64_t i = 0;
    for (; i + 16 <= cols; i += 16) acc = _mm512_max_ps(acc, _mm512_loadu_ps(x + i));
    const __mmask16 tail = (__mmask16)((1u << (cols - i)) - 1);
    acc = _mm512_mask_max_ps(acc, tail, acc, _mm512_maskz_loadu_ps(tail, x + i));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(acc));
    for (i = 0; i + 16 <= cols; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), m, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(tail, _mm512_maskz_loadu_ps(tail, x + i), m,
                                                  _CMP_EQ_OQ);
    return hit ? i + __builtin_ctz(hit) : 0;
}

/* out[r] = the index of the first maximum of x[r, :cols] (row stride `stride`). */
void argmax_rows(const float *x, int64_t stride, int rows, int64_t cols, int64_t *out,
                 int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 2)
    for (int r = 0; r < rows; r++) out[r] = row_argmax(x + (int64_t)r * stride, cols);
}
