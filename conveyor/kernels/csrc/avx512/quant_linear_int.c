/* The block linear on integer activations (--activation-quant) with AVX-512: the numerics of
 * generic/quant_linear_int.c (its comment has the formula), in vectors.
 *
 * OT output rows' blocks are unpacked once a call into 32 int16 values a chunk (one vector)
 * with their factors, then every activation row takes them, each chunk of it loaded once for
 * the OT: a chunk is one vpmaddwd of the weights with the activations' int16 (int8 values are
 * held as int16 too), its 16 int32 pair sums become float32 and take s, then d, (Q6_K's two
 * halves their own d) into an accumulator, so the lanes are summed once per output value, not
 * per chunk. The mins' share, m * s * sum(p), is a second vector dot product over the chunks.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "common.h"
#include "int_activations.h"

/* 32 bytes' low (shift 0) or high (shift 4) nibbles, as bytes */
static inline __m256i nibbles32(const uint8_t *p, int shift) {
    return _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)p), shift),
                            _mm256_set1_epi8(15));
}

/* Chunk j's 32 quantized values of a row as int16, offsets applied, as chunk_quants
 * (blocks.h) has them. */
static inline __m512i chunk_ints(const uint8_t *row, int type, int j) {
    const uint8_t *b = chunk_block(row, type, j);
    if (type == Q8_0)
        return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(b + 2)));
    if (type == Q4_K || type == Q5_K) {
        __m256i q = nibbles32(b + (type == Q4_K ? 16 : 48) + 32 * ((j & 7) >> 1), 4 * (j & 1));
        if (type == Q5_K)  /* the fifth bit: bit j of each of 32 bytes */
            q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(
                _mm256_loadu_si256((const __m256i *)(b + 16)), j & 7), _mm256_set1_epi8(1)), 4));
        return _mm512_cvtepu8_epi16(q);
    }
    if (type == Q6_K) {
        const int h = (j & 7) >> 2, t = j & 3;
        const __m256i lo = nibbles32(b + 64 * h + 32 * (t & 1), 4 * (t >> 1));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(
            _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)), 2 * t), _mm256_set1_epi8(3));
        return _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4))),
                                _mm512_set1_epi16(32));
    }
    /* Q4_0, Q4_1, Q5_1: weight e < 16 the low nibble of byte e, weight e + 16 its high one */
    const uint8_t *qs = b + stored_values_at(type);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qs), fifteen = _mm_set1_epi8(15);
    __m512i q = _mm512_cvtepu8_epi16(_mm256_set_m128i(
        _mm_and_si128(_mm_srli_epi16(bytes, 4), fifteen), _mm_and_si128(bytes, fifteen)));
    if (type == Q4_0) q = _mm512_sub_epi16(q, _mm512_set1_epi16(8));
    if (type == Q5_1) {  /* bit e of qh is weight e's fifth */
        uint32_t qh;
        memcpy(&qh, qs - 4, 4);
        q = _mm512_mask_add_epi16(q, (__mmask32)qh, q, _mm512_set1_epi16(16));
    }
    return q;
}

#define OT 4  /* output rows a pass over the activations takes: each chunk of x read once */

/* An output row unpacked: its chunks' ints (wq), each chunk's two half scales as one vector
 * (dlh: lanes 0-7 the first 16 weights', 8-15 the last 16's) and its min (m). */
static void unpack_row(const uint8_t *row, int type, int chunks, int16_t *wq, __m512 *dlh,
                       float *m) {
    for (int j = 0; j < chunks; j++) {
        float d[2];
        if (type == Q4_K || type == Q5_K) {
            if ((j & 7) == 0) {  /* a super-block's 8 chunks at once */
                const uint8_t *b = chunk_block(row, type, j);
                uint32_t u[4];
                k_scales_mins(b, u);
                const float dd = half_load(b), dmin = half_load(b + 2);
                for (int c = 0; c < 8 && j + c < chunks; c++) {
                    dlh[j + c] = _mm512_set1_ps(dd * (float)((const uint8_t *)u)[c]);
                    m[j + c] = -(dmin * (float)((const uint8_t *)u)[8 + c]);
                }
            }
        } else {
            chunk_scales(row, type, j, d, m + j);
            dlh[j] = _mm512_mask_mov_ps(_mm512_set1_ps(d[0]), 0xff00, _mm512_set1_ps(d[1]));
        }
        _mm512_storeu_si512(wq + 32 * j, chunk_ints(row, type, j));
    }
}

static int quant_linear_int(const void *x, int64_t x_stride, int bf16, const uint8_t *w,
                            int64_t row_bytes, int type, const void *bias, void *y,
                            int64_t y_stride, int rows, int n, int k, int levels, int threads) {
    if (!int_linear_takes(type, k, rows, levels)) return -1;
    const int chunks = k / 32;
    IntRows a;
    if (int_rows(&a, x, x_stride, bf16, rows, k, levels) != 0) return -2;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        int16_t *wq = malloc((size_t)OT * k * sizeof(int16_t));
        __m512 *dlh = aligned_alloc(64, (size_t)OT * chunks * sizeof(__m512));
        float *m = malloc((size_t)OT * chunks * sizeof(float));
        int n0, n1;
        thread_share(n, &n0, &n1);
        if (wq == NULL || dlh == NULL || m == NULL) failed = 1;
        for (int o0 = n0; !failed && o0 < n1; o0 += OT) {
            const int ot = n1 - o0 < OT ? n1 - o0 : OT;
            for (int t = 0; t < ot; t++)
                unpack_row(w + (int64_t)(o0 + t) * row_bytes, type, chunks, wq + (int64_t)t * k,
                           dlh + (int64_t)t * chunks, m + (int64_t)t * chunks);
            for (int r = 0; r < rows; r++) {
                const int16_t *pr = a.p + (int64_t)r * k;
                const float *sr = a.s + (int64_t)r * chunks, *spr = a.sp + (int64_t)r * chunks;
                __m512 acc[OT];
                for (int t = 0; t < OT; t++) acc[t] = _mm512_setzero_ps();
                for (int j = 0; j < chunks; j++) {
                    const __m512i pv = _mm512_loadu_si512(pr + 32 * j);
                    const __m512 sv = _mm512_set1_ps(sr[j]);
                    #pragma GCC unroll 4
                    for (int t = 0; t < OT; t++) {
                        if (t >= ot) break;
                        const __m512i pairs = _mm512_madd_epi16(
                            _mm512_loadu_si512(wq + (int64_t)t * k + 32 * j), pv);
                        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(pairs), sv),
                                                 dlh[(int64_t)t * chunks + j], acc[t]);
                    }
                }
                for (int t = 0; t < ot; t++) {
                    __m512 macc = _mm512_setzero_ps();
                    if (has_min(type))
                        for (int j = 0; j < chunks; j += 16) {
                            const __mmask16 live = chunks - j >= 16 ? 0xffff
                                                   : (__mmask16)((1u << (chunks - j)) - 1);
                            macc = _mm512_fmadd_ps(
                                _mm512_maskz_loadu_ps(live, m + (int64_t)t * chunks + j),
                                _mm512_maskz_loadu_ps(live, spr + j), macc);
                        }
                    const float b = bias != NULL ? elem_load(bias, o0 + t, bf16) : 0.0f;
                    elem_store(y, r * y_stride + o0 + t, _mm512_reduce_add_ps(acc[t])
                               + _mm512_reduce_add_ps(macc) + b, bf16);
                }
            }
        }
        free(wq);
        free(dlh);
        free(m);
    }
    int_rows_free(&a);
    return failed ? -2 : 0;
}

INT_LINEAR_ENTRIES(quant_linear_int)
