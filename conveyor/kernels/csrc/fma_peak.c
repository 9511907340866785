/* The machine's float32 multiply-add peak at this tier's vector width, measured: 12 independent
 * chains of FMAs in registers on every thread (enough to cover the FMA units' latency), no
 * memory traffic. What benchmarks set the kernels' rates against. */
#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "common.h"

#define CHAINS 12

/* Seconds `threads` threads take for `iters` rounds of CHAINS FMAs each; *flop gets the
 * floating-point operations done (2 a lane a multiply-add), *sink a result that keeps the
 * compiler from dropping the loop. */
static double run(int threads, int64_t iters, double *flop, float *sink) {
    const double t0 = monotonic_seconds();
    float total = 0.0f;
    int width = 1;
    #pragma omp parallel num_threads(threads) reduction(+ : total)
    {
#if defined(__AVX512F__)
        __m512 a[CHAINS];
        const __m512 m = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-3f);
        for (int i = 0; i < CHAINS; i++) a[i] = _mm512_set1_ps((float)i);
        for (int64_t it = 0; it < iters; it++)
            for (int i = 0; i < CHAINS; i++) a[i] = _mm512_fmadd_ps(a[i], m, c);
        for (int i = 0; i < CHAINS; i++) total += _mm512_reduce_add_ps(a[i]);
        width = 16;
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 a[CHAINS];
        const __m256 m = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-3f);
        for (int i = 0; i < CHAINS; i++) a[i] = _mm256_set1_ps((float)i);
        for (int64_t it = 0; it < iters; it++)
            for (int i = 0; i < CHAINS; i++) a[i] = _mm256_fmadd_ps(a[i], m, c);
        float lanes[8];
        for (int i = 0; i < CHAINS; i++) {
            _mm256_storeu_ps(lanes, a[i]);
            for (int l = 0; l < 8; l++) total += lanes[l];
        }
        width = 8;
#else
        float a[CHAINS];
        for (int i = 0; i < CHAINS; i++) a[i] = (float)i;
        for (int64_t it = 0; it < iters; it++)
            for (int i = 0; i < CHAINS; i++) a[i] = a[i] * 0.999f + 1e-3f;
        for (int i = 0; i < CHAINS; i++) total += a[i];
#endif
    }
    *sink = total;
    *flop = 2.0 * width * CHAINS * (double)iters * threads;
    return monotonic_seconds() - t0;
}

/* GFLOP/s of float32 multiply-adds on `threads` threads, the best of `repeats` runs of about
 * `seconds` each. */
double fma_peak_gflops(int threads, double seconds, int repeats) {
    double flop, best = 0.0;
    float sink;
    int64_t iters = 1 << 16;
    while (run(threads, iters, &flop, &sink) < seconds / 4) iters *= 2;
    iters = (int64_t)(iters * (seconds / run(threads, iters, &flop, &sink)));
    for (int r = 0; r < repeats; r++) {
        const double t = run(threads, iters, &flop, &sink);
        best = flop / t / 1e9 > best ? flop / t / 1e9 : best;
    }
    return sink == 12345.0f ? -best : best;  /* reads the sink: never true in practice */
}
