/* bfloat16 <-> float32, bit for bit as PyTorch converts (round to nearest even, NaN kept). */
#ifndef CONVEYOR_BF16_H
#define CONVEYOR_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_load(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* The kernels that need AVX-512 (F, BF16) are built where the compiler targets it;
 * elsewhere their entry points return -1 and has_avx512_bf16() (quant_linear.c) says 0. */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define CONVEYOR_AVX512_BF16 1
#include <immintrin.h>

/* 16 bfloat16 values widened to float32 (exact) */
static inline __m512 bf16x16_to_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#else
#define CONVEYOR_AVX512_BF16 0
#endif

/* AMX tiles (quant_linear.c's products, paged_decode.c's scores), where the compiler targets it. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define CONVEYOR_AMX 1
#include <immintrin.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

/* This thread's tiles: all eight 16 rows of 64 bytes. The asm names all 64 bytes of the config
 * as read: GCC 12's _tile_loadconfig names only the first 8, so the compiler may drop the
 * stores of the rest as dead (it did, in a test program: ldtilecfg then faulted). */
static inline void configure_tiles(void) {
    TileConfig cfg = {0};
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}
#else
#define CONVEYOR_AMX 0
#endif

#endif
