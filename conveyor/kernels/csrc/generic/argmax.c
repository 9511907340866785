/* Greedy sampling's argmax over each row of float32 logits: the first maximum, as torch.argmax.
 *
 * PyTorch's max(dim=-1) with indices is slow on the CPU (docs/results/design-notes#argmax);
 * a max pass, which the compiler vectorises, and a find-first pass over each row, which stays
 * in the L2 between them, take a fraction of its time. Built with fast math,
 * so NaNs are not looked for (the plain path's choice among them is torch's).
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

static int64_t row_argmax(const float *x, int64_t cols) {
    float top = -INFINITY;
    for (int64_t i = 0; i < cols; i++) top = x[i] > top ? x[i] : top;
    for (int64_t i = 0; i < cols; i++)
        if (x[i] == top) return i;
    return 0;
}

/* out[r] = the index of the first maximum of x[r, :cols] (row stride `stride`). */
void argmax_rows(const float *x, int64_t stride, int rows, int64_t cols, int64_t *out,
                 int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 2)
    for (int r = 0; r < rows; r++) out[r] = row_argmax(x + (int64_t)r * stride, cols);
}
