/* Rows of a matrix in GGUF blocks (blocks.h) as float32: the embedding table's rows a step looks
 * up, read where the table lies (the tied head's blocks), so no dense copy of it is kept.
 *
 * Each weight is the loader's: gguf-py's d * q, + m for the types with a min (two roundings;
 * the build does not contract them into one), the dense types' values widened exactly. The
 * bfloat16 tiers' entry (dequant_rows_bf16) reads their kernels' block format, in
 * avx512/quant_linear_bf16.c.
 */
#include <stdint.h>

#include "blocks.h"
#include "common.h"

/* out[r] = row ids[r] of w (n rows, k weights each); returns -1 for a type it does not read. */
int dequant_rows_f32(const uint8_t *w, int64_t row_bytes, int type, const int64_t *ids, int n,
                     int k, float *out, int64_t out_stride, int threads) {
    if (!reads_type(type) || k % values_per_block(type) != 0) return -1;
    #pragma omp parallel for schedule(static) num_threads(threads) if (n >= 2 * threads)
    for (int r = 0; r < n; r++) {
        const uint8_t *row = w + ids[r] * row_bytes;
        float *dst = out + r * out_stride;
        for (int j = 0; j < k / 32; j++) {
            if (is_dense(type)) {
                dense_values(row, type, j, dst + 32 * j);
                continue;
            }
            int q[32];
            float d[2], m;
            chunk_scales(row, type, j, d, &m);
            chunk_quants(row, type, j, q);
            for (int e = 0; e < 32; e++) {
                const float v = d[e >> 4] * (float)q[e];
                dst[32 * j + e] = has_min(type) ? v + m : v;
            }
        }
    }
    return 0;
}
