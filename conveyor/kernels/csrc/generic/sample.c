/* Random sampling of each row of float32 logits under temperature, top_k, top_p and min_p:
 * one draw a row from the renormalised distribution the rules leave, exactly, without sorting
 * the vocabulary (a sort, and PyTorch's masked fills, topk and rand over a batch's logits, cost
 * about a decode step on a CPU: docs/results/real-size).
 *
 * A row: p_i = exp((x_i - max) / T), unnormalised (the most likely token's is 1), in one
 * vectorised pass. The rules keep a prefix of the tokens ranked by p (top_k the k most likely;
 * top_p the fewest most likely whose mass reaches top_p of the top_k's; min_p those with
 * p >= min_p), so the tokens they keep all lie above some threshold: candidates are the tokens
 * with p >= 2^-4, else 2^-6, ..., the first that holds them all (a few dozen to a few
 * thousand). The prefix is then found by quickselect on the candidates (by count for top_k,
 * by mass for top_p), never a sort, and the token drawn by inverse CDF with the caller's
 * uniform. A row no rule restricts is drawn from the whole vocabulary.
 *
 * Masked logits (-inf, from grammars and min_tokens) have p = 0 and are never drawn.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

#define CHUNK 1024 /* tokens a partial sum covers */

/* p[i] = exp((x[i] - top) * inv_t), 0 for masked logits, in one vectorised pass; the sums of
 * p by chunks of CHUNK (for the inverse CDF). Returns the sum of all. */
static double row_exp(const float *x, int64_t n, float top, float inv_t, float *p,
                      float *chunk_sums) {
    double total = 0.0;
    for (int64_t c = 0; c * CHUNK < n; c++) {
        int64_t end = (c + 1) * CHUNK < n ? (c + 1) * CHUNK : n;
        float part = 0.0f;
        for (int64_t i = c * CHUNK; i < end; i++) {
            float d = (x[i] - top) * inv_t;
            p[i] = d > -88.0f ? expf(d) : 0.0f;
            part += p[i];
        }
        chunk_sums[c] = part;
        total += part;
    }
    return total;
}

/* The mass of the p at or above t, and their count. */
static double mass_above(const float *p, int64_t n, float t, int64_t *count) {
    double mass = 0.0;
    *count = 0;
    for (int64_t c = 0; c * CHUNK < n; c++) {
        int64_t end = (c + 1) * CHUNK < n ? (c + 1) * CHUNK : n;
        float part = 0.0f, in = 0.0f;
        for (int64_t i = c * CHUNK; i < end; i++) {
            part += p[i] >= t ? p[i] : 0.0f;
            in += p[i] >= t ? 1.0f : 0.0f;
        }
        mass += part;
        *count += (int64_t)in;
    }
    return mass;
}

static void swap(float *v, int32_t *id, int64_t a, int64_t b) {
    float fv = v[a]; v[a] = v[b]; v[b] = fv;
    int32_t t = id[a]; id[a] = id[b]; id[b] = t;
}

/* Reorders v[0:n) (with its ids) so that its first `return value` entries are the fewest
 * largest whose weight reaches `target`: weight 1 each (by_mass 0: the `target` largest) or
 * their value (by_mass 1). Ties at the boundary are taken in the order they stand. Expected
 * O(n): three-way partitions around the middle element's value, into the part that holds the
 * boundary. */
static int64_t select_prefix(float *v, int32_t *id, int64_t n, double target, int by_mass) {
    int64_t lo = 0, hi = n;  /* the boundary lies in [lo, hi); everything before lo is kept */
    while (hi - lo > 1) {
        float pivot = v[lo + (hi - lo) / 2];
        int64_t gt = lo, i = lo, lt = hi;  /* [lo,gt) > pivot, [gt,i) == pivot, [lt,hi) < */
        while (i < lt) {
            if (v[i] > pivot) swap(v, id, gt++, i++);
            else if (v[i] < pivot) swap(v, id, i, --lt);
            else i++;
        }
        double above = 0.0, equal = 0.0;
        for (int64_t j = lo; j < gt; j++) above += by_mass ? v[j] : 1.0;
        for (int64_t j = gt; j < lt; j++) equal += by_mass ? v[j] : 1.0;
        if (above >= target && gt > lo) {
            hi = gt;
        } else if (above + equal >= target) {  /* the boundary is among the ties */
            double w = by_mass ? pivot : 1.0;
            int64_t take = (int64_t)ceil((target - above) / w);
            if (take < 1) take = 1;
            return gt + (take < lt - gt ? take : lt - gt);
        } else {
            target -= above + equal;
            lo = lt;
        }
    }
    return hi;
}

/* The index drawn with probability proportional to w: the first whose running sum passes
 * u times the total (never one of weight 0). */
static int64_t inverse_cdf(const float *w, const int32_t *id, int64_t n, double total, double u) {
    double goal = u * total, run = 0.0;
    int64_t last = -1;
    for (int64_t i = 0; i < n; i++) {
        if (w[i] <= 0.0f) continue;
        run += w[i];
        last = i;
        if (run > goal) break;
    }
    if (last < 0) return 0;
    return id ? id[last] : last;
}

/* inverse_cdf over a whole row, the chunk first by its sum, then the token in it. */
static int64_t inverse_cdf_row(const float *p, int64_t n, const float *chunk_sums, double total,
                               double u) {
    double goal = u * total, run = 0.0;
    int64_t chunks = (n + CHUNK - 1) / CHUNK, c = 0;
    for (; c < chunks - 1; c++) {  /* (rounding past the end: the last chunk) */
        if (run + chunk_sums[c] > goal && chunk_sums[c] > 0.0f) break;
        run += chunk_sums[c];
    }
    int64_t len = n - c * CHUNK < CHUNK ? n - c * CHUNK : CHUNK;
    double sum = 0.0;
    for (int64_t i = 0; i < len; i++) sum += p[c * CHUNK + i];
    return c * CHUNK + inverse_cdf(p + c * CHUNK, NULL, len, sum, (goal - run) / sum);
}

static int64_t sample_row(const float *x, int64_t n, float temperature, int64_t top_k,
                          float top_p, float min_p, double u, float *p, float *cv, int32_t *cid,
                          float *chunk_sums) {
    float top = -INFINITY;
    for (int64_t i = 0; i < n; i++) top = x[i] > top ? x[i] : top;
    double total = row_exp(x, n, top, 1.0f / temperature, p, chunk_sums);
    if (!(total > 0.0)) return 0;  /* every token masked: the caller reports such rows */
    int ranked_k = top_k > 0 && top_k < n;
    if (!ranked_k && top_p >= 1.0f && min_p <= 0.0f)
        return inverse_cdf_row(p, n, chunk_sums, total, u);

    /* Candidates: the tokens above the highest threshold that holds every token kept. */
    float floor_p = 0.0f;
    for (float t = 0x1p-4f; t >= 0x1p-120f; t *= 0x1p-2f) {
        if (t <= min_p) { floor_p = min_p; break; }  /* min_p keeps nothing below it */
        int64_t count;
        double mass = mass_above(p, n, t, &count);
        if (ranked_k ? count >= top_k : mass >= (double)top_p * total) { floor_p = t; break; }
    }
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {  /* (branch-free: a row's candidates come in any order) */
        cv[m] = p[i];
        cid[m] = (int32_t)i;
        m += p[i] > 0.0f && p[i] >= floor_p;
    }

    double kept = total;
    if (ranked_k) {
        if (top_k < m) m = select_prefix(cv, cid, m, (double)top_k, 0);
        kept = 0.0;
        for (int64_t i = 0; i < m; i++) kept += cv[i];
    }
    if (top_p < 1.0f) m = select_prefix(cv, cid, m, (double)top_p * kept, 1);
    double mass = 0.0;
    for (int64_t i = 0; i < m; i++) {  /* min_p: relative to the most likely token's p of 1 */
        if (cv[i] < min_p) cv[i] = 0.0f;
        mass += cv[i];
    }
    return inverse_cdf(cv, cid, m, mass, u);
}

/* out[r] = a token drawn from row r of x (stride `stride`, `cols` logits) under its
 * temperature (> 0), top_k (0: off), top_p (1: off) and min_p (0: off), with the uniform
 * u[r] in [0, 1). Returns 0, or -1 if scratch memory could not be had. */
int sample_rows(const float *x, int64_t stride, int rows, int64_t cols, const float *temperature,
                const int64_t *top_k, const float *top_p, const float *min_p, const double *u,
                int64_t *out, int threads) {
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (rows >= 2) reduction(|:failed)
    {
        float *p = malloc(sizeof(float) * (cols * 2 + cols / CHUNK + 1));
        int32_t *cid = malloc(sizeof(int32_t) * cols);
        #pragma omp for schedule(static)
        for (int r = 0; r < rows; r++) {  /* every thread reaches the loop, with memory or not */
            if (!p || !cid) { failed = 1; out[r] = 0; continue; }
            out[r] = sample_row(x + (int64_t)r * stride, cols, temperature[r], top_k[r],
                                top_p[r], min_p[r], u[r], p, p + cols, cid, p + 2 * cols);
        }
        free(p);
        free(cid);
    }
    return failed ? -1 : 0;
}
