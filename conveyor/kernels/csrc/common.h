/* What every kernel source shares: bfloat16 <-> float32 conversion, bit for bit as PyTorch
 * converts (round to nearest even, NaN kept); the split of work among OpenMP threads; and what
 * the build targets (AVX-512 BF16, AMX tiles), from the compiler's own macros. */
#ifndef CONVEYOR_COMMON_H
#define CONVEYOR_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "kernels.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX__)
#include <immintrin.h>

/* The sum of a vector's 8 float32 lanes. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#if defined(__AVX2__) && defined(__FMA__)
/* exp(x) for x <= 0 (softmax's x - max): exp2 of the integer part by exponent bits, a degree-5
 * polynomial for the rest (Cephes' coefficients; within 2 float32 steps of expf). */
static inline __m256 exp_neg(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  /* beyond: ~0, and 2^n stays normal */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif
#endif

/* A sliding window of `window` tokens (0: none) over a context of *len tokens whose pages are
 * *table: the pages wholly before the window are dropped (*table advanced, *len shortened by
 * them), and the tokens still before the window in its first page are returned, for the
 * softmax to weigh 0. The decode kernels read only the window's pages this way. */
static inline int window_pages(int window, int block_size, const int32_t **table, int *len) {
    if (window <= 0 || *len <= window) return 0;
    const int first = (*len - window) / block_size;
    *table += first;
    *len -= first * block_size;
    return *len - window;
}

/* Gemma 2's attention logit soft-capping: cap * tanh(s / cap), in place (cap 0: none). */
static inline void soft_cap(float *s, int n, float cap) {
    if (cap > 0.0f)
        for (int t = 0; t < n; t++) s[t] = cap * tanhf(s[t] / cap);
}

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

/* An IEEE half (a GGUF block's scale) as float32, exactly: with F16C one instruction, else
 * by its bits. */
static inline float half_load(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | mant << 13;              /* inf, NaN */
    } else if (exp != 0) {
        bits = sign | (exp + 112) << 23 | mant << 13;        /* normal: rebias 15 -> 127 */
    } else if (mant == 0) {
        bits = sign;                                         /* zero */
    } else {                                                 /* subnormal: normalise it */
        int shift = 0;
        while (!(mant & 0x400)) mant <<= 1, shift++;
        bits = sign | (uint32_t)(113 - shift) << 23 | (mant & 0x3ff) << 13;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* The plain-C kernels (generic/) serve both dtypes from one body: `bf16` is a constant in each
 * entry point, so the compiler makes a specialisation of each. Values are float32 in registers;
 * in memory, elements are float or bfloat16 (strides count elements), and round_to() rounds a
 * float32 result as storing it in the model dtype would (nothing, in float32). */
static inline float elem_load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_load(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void elem_store(void *p, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = bf16_store(v);
    else
        ((float *)p)[i] = v;
}

static inline float round_to(float v, int bf16) { return bf16 ? bf16_load(bf16_store(v)) : v; }

/* The KV cache's storage (kv_type): KV_MODEL, the model dtype; KV_INT8, each token's head a row
 * of head_dim int8 values and then its float32 scale (value = scale * int); KV_F16, IEEE halves
 * of a float32 model's values (rounded to nearest even, as torch's .to(float16)); as
 * model/kv_cache.py writes and reads them. */
enum { KV_MODEL = 0, KV_INT8 = 1, KV_F16 = 2 };
#define KV_SCALE_BYTES 4

/* Bytes of one token's head in a cache. */
static inline int64_t kv_head_bytes(int dim, int kv_type, int bf16) {
    return kv_type == KV_INT8 ? dim + KV_SCALE_BYTES
                              : (int64_t)dim * (kv_type == KV_F16 || bf16 ? 2 : 4);
}

/* A float32 value as an IEEE half, rounded to nearest even (overflow: infinity). */
static inline uint16_t half_store(float v) {
#if defined(__F16C__)
    return _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
#else
    union { _Float16 h; uint16_t bits; } u = {(_Float16)v};
    return u.bits;
#endif
}

/* The scale of an int8 head row (at its end: memcpy, as it need not be aligned). */
static inline float kv_scale(const void *head, int dim) {
    float s;
    memcpy(&s, (const char *)head + dim, sizeof s);
    return s;
}

/* The largest magnitude of `count` values of x (float32 or bfloat16) from element `at`. */
static inline float magnitude_of(const void *x, int64_t at, int bf16, int count) {
    float top = 0.0f;
    for (int e = 0; e < count; e++) top = fmaxf(top, fabsf(elem_load(x, at + e, bf16)));
    return top;
}

/* x (dim values of the model dtype) as an int8 head row: scale = max |x| / 127 (as a product
 * with 1/127 in float32, which fast math leaves as it is), each value rounded to the nearest
 * step (an all-zero head: scale 0, zeros). */
static inline void kv_quantize(const void *x, int64_t at, int dim, int bf16, void *row) {
    const float scale = magnitude_of(x, at, bf16, dim) * (1.0f / 127.0f);
    int8_t *q = row;
    for (int i = 0; i < dim; i++)
        q[i] = scale > 0.0f ? (int8_t)nearbyintf(elem_load(x, at + i, bf16) / scale) : 0;
    memcpy(q + dim, &scale, sizeof scale);
}

static inline double monotonic_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* The shared bodies are inlined into each dtype's entry point. */
#define ALWAYS_INLINE inline __attribute__((always_inline))

/* This OpenMP thread's share [*begin, *end) of `count` items (output rows or strips): one
 * contiguous run, empty for threads past the last item. */
static inline void thread_share(int count, int *begin, int *end) {
    int nt = 1, t = 0;
#ifdef _OPENMP
    nt = omp_get_num_threads();
    t = omp_get_thread_num();
#endif
    const int per = (count + nt - 1) / nt;
    *begin = t * per < count ? t * per : count;
    *end = *begin + per < count ? *begin + per : count;
}

/* The bfloat16 kernels (csrc/avx512/) are built for the avx512 and amx tiers, which target
 * AVX-512 F and BF16. */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define CONVEYOR_AVX512_BF16 1
#include <immintrin.h>

/* 16 bfloat16 values widened to float32 (exact) */
static inline __m512 bf16x16_to_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* exp_neg on 16 lanes, a half at a time */
static inline __m512 exp_neg16(__m512 x) {
    const __m256 lo = exp_neg(_mm512_castps512_ps256(x));
    const __m256 hi = exp_neg(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)),
                                               _mm256_castps_pd(hi), 1));
}
#else
#define CONVEYOR_AVX512_BF16 0
#endif

/* AMX tiles (quant_linear_bf16.c's products, paged_decode_bf16.c's scores, int8 caches'
 * too): the amx tier. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
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
