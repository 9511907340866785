/* The K-quants rewritten at load into the layout the avx2 tier's int8 kernel reads
 * (repacked.h). Only the avx2 tier has these entries: the avx512 and amx tiers' kernels read
 * the blocks as stored, and without the entries the weights stay so. */
#include <stdint.h>
#include <string.h>

#include "blocks.h"
#include "common.h"
#include "repacked.h"

#if !CONVEYOR_AVX512_BF16

int repacked_row_bytes(int type, int k) {
    return x8_block_bytes(type) == 0 || k % 256 ? -1 : x8_block_bytes(type) * (k / 256);
}

/* Row r (0..7) of a group's super-block o from its stored super-block b (`type` a constant in
 * each caller). */
static ALWAYS_INLINE void repack_block(const uint8_t *b, int type, int r, uint8_t *o) {
    /* its slot among the low or the high rows of a step */
    const int high = r == 2 || r == 3 || r == 6 || r == 7, slot = (r >> 1 & 2) | (r & 1);
    if (type == Q6_K) {
        memcpy(o + X8_D + 2 * r, b + 208, 2);
        for (int g = 0; g < 16; g++) o[X8_SC6 + 8 * g + r] = b[192 + g];
    } else {
        memcpy(o + X8_D + 2 * r, b, 2);
        memcpy(o + X8_DMIN + 2 * r, b + 2, 2);
        uint32_t u[4];
        k_scales_mins(b, u);
        const uint8_t *sm = (const uint8_t *)u;
        for (int j = 0; j < 8; j++) {
            o[X8_SC + 8 * j + r] = sm[j];
            o[X8_MN + 8 * j + r] = sm[8 + j];
        }
    }
    for (int j = 0; j < 8; j++) {
        int q[32];
        chunk_quants(b, type, j, q);  /* (b: a row of one super-block) */
        for (int e = 0; e < 32; e++) {
            const int v = type == Q6_K ? q[e] + 32 : q[e], step = e >> 3;
            const int at = 8 * slot + (e & 7);  /* its byte in the step's 32 */
            const int qs = type == Q6_K ? X8_QL6 : X8_QS;
            o[qs + 128 * j + 32 * step + at] |= (uint8_t)((v & 15) << 4 * high);
            if (type == Q5_K) {
                const int bit = 32 * high + at;
                o[X8_QH5 + 32 * j + 8 * step + bit / 8] |= (uint8_t)((v >> 4 & 1) << bit % 8);
            } else if (type == Q6_K) {
                const int shift = 2 * (at >> 4) + 4 * high;
                o[X8_QH6 + 64 * j + 16 * step + (at & 15)] |= (uint8_t)((v >> 4) << shift);
            }
        }
    }
}

/* w: n rows of k weights in `type` blocks, row_bytes apart, into out: ceil(n / 8) * 8 rows of
 * repacked_row_bytes(type, k) (the padding rows zero). Returns the repacked type, or -1 for a
 * type or width the layout does not take. */
int repack_rows(const uint8_t *w, int64_t row_bytes, int type, int n, int k, uint8_t *out,
                int threads) {
    const int rb = repacked_row_bytes(type, k);
    if (rb < 0) return -1;
    const int sbs = k / 256, gb = 8 * x8_block_bytes(type);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int g = 0; g < (n + 7) / 8; g++)
        for (int sb = 0; sb < sbs; sb++) {
            uint8_t *o = out + (int64_t)g * 8 * rb + (int64_t)sb * gb;
            memset(o, 0, gb);
            for (int r = 0; r < 8 && 8 * g + r < n; r++) {
                const uint8_t *b = w + (int64_t)(8 * g + r) * row_bytes
                                   + (int64_t)sb * stored_block_bytes(type);
                if (type == Q4_K) repack_block(b, Q4_K, r, o);
                else if (type == Q5_K) repack_block(b, Q5_K, r, o);
                else repack_block(b, Q6_K, r, o);
            }
        }
    return X8 + type;
}

#endif
