/* The GGUF block formats the block linears read, as llama.cpp's files store them (ggml's type
 * numbers), and what each chunk of 32 weights of a row is: the float32 factors and quantized
 * values gguf-py's dequantize (the loader's) computes its weights from, w = d * q + m in two
 * roundings; or, for the dense types (F32, F16, BF16: a GGUF's or a safetensors folder's
 * matrices), the weights themselves, widened exactly.
 *
 * - Q4_0, Q4_1, Q5_1, Q8_0: blocks of 32 weights, an fp16 scale d (and min m) each (the
 *   loader rewrites Q5_0 as Q8_0, see gguf_file._kernel_blocks).
 * - Q4_K, Q5_K: super-blocks of 256 (8 chunks): fp16 d and dmin, 12 bytes of 6-bit scales sc
 *   and mins mn, one pair a chunk: w = (d * sc) * q - dmin * mn.
 * - Q6_K: super-blocks of 256: an int8 scale sc per 16 weights, fp16 d: w = (d * sc) * (q - 32).
 * The products d * sc are exact in float32 (11 x 8 bits), so factoring them is the loader's
 * arithmetic too. */
#ifndef CONVEYOR_BLOCKS_H
#define CONVEYOR_BLOCKS_H

#include <stdint.h>

#include "common.h"

enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14,
       BF16 = 30 };

static inline int is_k_quant(int type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

static inline int is_dense(int type) { return type == F32 || type == F16 || type == BF16; }

static inline int reads_type(int type) {
    return type == Q4_0 || type == Q4_1 || type == Q5_1 || type == Q8_0 || is_k_quant(type)
           || is_dense(type);
}

/* The weights a block holds (the dense types: taken 32 at a time). */
static inline int values_per_block(int type) { return is_k_quant(type) ? 256 : 32; }

static inline int stored_block_bytes(int type) {
    switch (type) {
    case F32: return 128;
    case F16: case BF16: return 64;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    default: return 210;  /* Q6_K */
    }
}

/* Where a 32-weight block's quantized bytes start (after its scale, min and high bits). */
static inline int stored_values_at(int type) {
    return type == Q4_1 ? 4 : type == Q5_1 ? 8 : 2;
}

/* Types whose weights add a min (w = d * q + m); the others are d * q. */
static inline int has_min(int type) {
    return type == Q4_1 || type == Q5_1 || type == Q4_K || type == Q5_K;
}

/* The block holding chunk j of a row. */
static inline const uint8_t *chunk_block(const uint8_t *row, int type, int j) {
    return is_k_quant(type) ? row + (int64_t)(j >> 3) * stored_block_bytes(type)
                            : row + (int64_t)j * stored_block_bytes(type);
}

/* A Q4_K / Q5_K super-block's 12 bytes of 6-bit pairs unpacked, as ggml does: the 8 chunks'
 * scales to bytes 0-7 of u, their mins to bytes 8-15. */
static inline void k_scales_mins(const uint8_t *b, uint32_t u[4]) {
    memcpy(u, b + 4, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    const uint32_t mins_lo = u[1] & 0x3f3f3f3f;
    u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = mins_lo;
    u[0] &= 0x3f3f3f3f;
}

/* Chunk j's factors: d[0] scales its first 16 weights, d[1] the last 16 (equal but in Q6_K),
 * *m is added to each (0 where the type has none). */
static inline void chunk_scales(const uint8_t *row, int type, int j, float d[2], float *m) {
    const uint8_t *b = chunk_block(row, type, j);
    *m = 0.0f;
    if (is_dense(type)) {
        d[0] = d[1] = 1.0f;
    } else if (type == Q6_K) {
        const float dd = half_load(b + 208);
        d[0] = dd * (float)(int8_t)b[192 + 2 * (j & 7)];
        d[1] = dd * (float)(int8_t)b[193 + 2 * (j & 7)];
    } else if (type == Q4_K || type == Q5_K) {
        uint32_t u[4];
        k_scales_mins(b, u);
        d[0] = d[1] = half_load(b) * (float)((const uint8_t *)u)[j & 7];
        *m = -(half_load(b + 2) * (float)((const uint8_t *)u)[8 + (j & 7)]);
    } else {
        d[0] = d[1] = half_load(b);
        if (type == Q4_1 || type == Q5_1) *m = half_load(b + 2);
    }
}

/* Chunk j's 32 weights of a dense type, as float32 (exact). */
static inline void dense_values(const uint8_t *row, int type, int j, float w[32]) {
    const uint8_t *b = chunk_block(row, type, j);
    if (type == F32) {
        memcpy(w, b, 128);
        return;
    }
    for (int e = 0; e < 32; e++) {
        uint16_t h;
        memcpy(&h, b + 2 * e, 2);
        w[e] = type == BF16 ? bf16_load(h) : half_load(b + 2 * e);
    }
}

/* Chunk j's 32 quantized values (not of a dense type), offsets applied (Q4_0: q - 8, Q6_K:
 * q - 32). */
static inline void chunk_quants(const uint8_t *row, int type, int j, int q[32]) {
    const uint8_t *b = chunk_block(row, type, j);
    if (type == Q8_0) {
        for (int e = 0; e < 32; e++) q[e] = (int8_t)b[2 + e];
    } else if (type == Q4_K || type == Q5_K) {
        /* chunks 2g and 2g + 1: the low and high nibbles of 32 bytes; Q5_K's fifth bit is bit
         * j of byte e of qh */
        const uint8_t *qs = b + (type == Q4_K ? 16 : 48) + 32 * ((j & 7) >> 1);
        const int shift = 4 * (j & 1);
        for (int e = 0; e < 32; e++) {
            q[e] = (qs[e] >> shift) & 15;
            if (type == Q5_K) q[e] |= ((b[16 + e] >> (j & 7)) & 1) << 4;
        }
    } else if (type == Q6_K) {
        /* each half of 128: chunks t = 0..3 take the low (t < 2) or high nibbles of 32 bytes
         * of ql, and 2 bits of 32 bytes of qh */
        const int h = (j & 7) >> 2, t = j & 3;
        const uint8_t *ql = b + 64 * h + 32 * (t & 1), *qh = b + 128 + 32 * h;
        for (int e = 0; e < 32; e++)
            q[e] = (((ql[e] >> (4 * (t >> 1))) & 15) | (((qh[e] >> (2 * t)) & 3) << 4)) - 32;
    } else {
        /* weight e < 16: the low nibble of byte e, weight e + 16 its high nibble; Q5_1's fifth
         * bit of weight e is bit e of a 32-bit qh */
        const uint8_t *qs = b + stored_values_at(type);
        uint32_t qh = 0;
        if (type == Q5_1) memcpy(&qh, b + stored_values_at(type) - 4, 4);
        const int offset = type == Q4_0 ? 8 : 0;
        for (int e = 0; e < 32; e++) {
            const int nibble = e < 16 ? qs[e] & 15 : qs[e - 16] >> 4;
            q[e] = (nibble | (int)((qh >> e) & 1) << 4) - offset;
        }
    }
}

#endif
