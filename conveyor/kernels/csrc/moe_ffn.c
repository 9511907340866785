/* A layer's mixture of experts for a step's rows, in one call, in the model dtype: what
 * model/moe.py's SparseMoE computes (its shared expert aside), in its order and roundings.
 *
 * A decode step gives each chosen expert one to a few rows, so a layer is many small block
 * linears; called one by one from Python, each pays its dispatch, and the experts run one
 * after another. Here the router, the grouping and every chosen expert are one call, and the
 * experts run side by side, one a thread, where a step has enough of them.
 *
 * - The router in float32 at either dtype (the block linear on dense float32 rows), softmax,
 *   each row's `used` most probable experts (the lower index first among equals), their
 *   weights renormalised where the family does.
 * - The (row, slot) pairs grouped by expert, rows ascending within one: each expert runs once
 *   over its rows (in pieces of the block linear's most rows), gate+up, act, down.
 * - Each row's sum over its experts in ascending expert order, each term w * y rounded to the
 *   model dtype and added in it: the index_add_ of the Python path, term by term.
 * - Its time and the experts it ran added to the layer's stats (the step's /metrics).
 */

#include <stdint.h>
#include <string.h>

#include "stack.h"

/* The next 64-byte-aligned piece of the scratch (experts.MoEKernel.scratch_bytes counts
 * them). */
static inline void *take(char **at, size_t bytes) {
    char *p = (char *)(((uintptr_t)*at + 63) & ~(uintptr_t)63);
    *at = p + bytes;
    return p;
}

/* probs: one row's router logits, turned into its probabilities; its `used` largest go to
 * chosen / weight in descending order (then the taken ones are marked -1). */
static void choose(float *probs, int experts, int used, int norm_topk, int32_t *chosen,
                   float *weight) {
    float top = probs[0], sum = 0.0f;
    for (int e = 1; e < experts; e++) top = probs[e] > top ? probs[e] : top;
    for (int e = 0; e < experts; e++) sum += probs[e] = expf(probs[e] - top);
    const float inv = 1.0f / sum;
    for (int e = 0; e < experts; e++) probs[e] *= inv;
    float total = 0.0f;
    for (int u = 0; u < used; u++) {
        int best = 0;
        for (int e = 1; e < experts; e++) best = probs[e] > probs[best] ? e : best;
        chosen[u] = best;
        total += weight[u] = probs[best];
        probs[best] = -1.0f;
    }
    if (norm_topk)
        for (int u = 0; u < used; u++) weight[u] /= total;
}

/* Expert ex over its n gathered rows xs (ys: their outputs), in pieces of the block linear's
 * most rows, threads for each kernel. */
static ALWAYS_INLINE int run_expert(const Experts *e, const Shape *s, int ex, int n,
                                    const char *xs, char *gu, char *ys, int threads, int bf16) {
    const int hid = s->hidden, inter = e->intermediate;
    const size_t elem = bf16 ? 2 : 4;
    int rc = 0;
    for (int m0 = 0; m0 < n && rc == 0; m0 += e->max_rows) {
        const int m = n - m0 < e->max_rows ? n - m0 : e->max_rows;
        rc = gated_ffn(xs + elem * m0 * hid, hid, &e->w13[ex], &e->w2[ex],
                       gu + elem * m0 * 2 * inter, ys + elem * m0 * hid, hid, m, inter, s,
                       threads, bf16);
    }
    return rc;
}

/* out: [rows, hidden] = the experts' weighted sum for x: [rows, hidden]. Returns 0, or a
 * failing kernel's (negative) code. */
static ALWAYS_INLINE int moe_ffn(const Experts *e, const Shape *s, const void *x,
                                 int64_t x_stride, void *out, int64_t out_stride, int rows,
                                 void *scratch, int threads, int bf16) {
    const int hid = s->hidden, experts = e->experts, used = e->used, pairs = rows * used;
    const size_t elem = bf16 ? 2 : 4;
    const double begin = monotonic_seconds();
    char *at = scratch;
    float *probs = take(&at, sizeof(float) * rows * experts);
    float *weight = take(&at, sizeof(float) * pairs);      /* (row, slot) order */
    int32_t *chosen = take(&at, sizeof(int32_t) * pairs);
    int32_t *start = take(&at, sizeof(int32_t) * (experts + 1));
    int32_t *pair_row = take(&at, sizeof(int32_t) * pairs);  /* by expert: each pair's row */
    int32_t *place = take(&at, sizeof(int32_t) * pairs);     /* (row, slot) -> by expert */
    char *xs = take(&at, elem * pairs * hid);
    char *gu = take(&at, elem * pairs * 2 * e->intermediate);
    char *ys = take(&at, elem * pairs * hid);
    const float *xr = x;
    int64_t xr_stride = x_stride;
    if (bf16) {  /* the router's input widened (exact) */
        float *xf = take(&at, sizeof(float) * rows * hid);
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < hid; i++)
                xf[(int64_t)r * hid + i] = elem_load(x, r * x_stride + i, 1);
        xr = xf;
        xr_stride = hid;
    }
    int rc = quant_linear_f32(xr, xr_stride, (const uint8_t *)e->router, 4 * (int64_t)hid, F32,
                              NULL, probs, experts, rows, experts, hid, s->invariant, threads);
    if (rc) return rc;
    memset(start, 0, sizeof(int32_t) * (experts + 1));
    for (int r = 0; r < rows; r++) {
        choose(probs + (int64_t)r * experts, experts, used, e->norm_topk, chosen + r * used,
               weight + r * used);
        for (int u = 0; u < used; u++) start[chosen[r * used + u] + 1]++;
    }
    int groups = 0;
    for (int ex = 0; ex < experts; ex++) {
        groups += start[ex + 1] > 0;
        start[ex + 1] += start[ex];
    }
    int32_t *cursor = take(&at, sizeof(int32_t) * experts);
    memcpy(cursor, start, sizeof(int32_t) * experts);
    for (int i = 0; i < pairs; i++) {  /* rows ascending within each expert */
        place[i] = cursor[chosen[i]]++;
        pair_row[place[i]] = i / used;
    }
    for (int p = 0; p < pairs; p++)
        memcpy(xs + elem * p * hid, (const char *)x + elem * pair_row[p] * x_stride, elem * hid);

    /* the experts: one a thread where there are enough of them, else one at a time (the
     * region inactive, so that each kernel's own threads run) */
    const int apart = threads > 1 && groups >= 2 * threads;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (apart) \
        reduction(min: rc)
    for (int ex = 0; ex < experts; ex++) {
        const int64_t p = start[ex];
        const int n = start[ex + 1] - start[ex];
        if (n == 0) continue;
        const int code = run_expert(e, s, ex, n, xs + elem * p * hid,
                                    gu + elem * p * 2 * e->intermediate, ys + elem * p * hid,
                                    apart ? 1 : threads, bf16);
        rc = code < rc ? code : rc;
    }
    if (rc) return rc;

    /* each row's terms in ascending expert order */
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 2 * threads)
    for (int r = 0; r < rows; r++) {
        int32_t order[used];
        for (int u = 0; u < used; u++) {  /* the row's slots by expert (insertion) */
            int v = u;
            for (; v > 0 && chosen[r * used + order[v - 1]] > chosen[r * used + u]; v--)
                order[v] = order[v - 1];
            order[v] = u;
        }
        void *o = (char *)out + elem * r * out_stride;
        for (int i = 0; i < hid; i++) elem_store(o, i, 0.0f, bf16);
        for (int u = 0; u < used; u++) {
            const int i = r * used + order[u];
            const float w = weight[i];
            const char *y = ys + elem * place[i] * hid;
            for (int j = 0; j < hid; j++)
                elem_store(o, j, elem_load(o, j, bf16)
                                 + round_to(w * elem_load(y, j, bf16), bf16), bf16);
        }
    }
    e->stats[0] += (int64_t)(1e9 * (monotonic_seconds() - begin));
    e->stats[1] += groups;
    return 0;
}

#define ENTRY(T, E, BF16) \
int moe_ffn_##T(const Experts *e, const Shape *s, const E *x, int64_t x_stride, E *out, \
                int64_t out_stride, int rows, void *scratch, int threads) { \
    return moe_ffn(e, s, x, x_stride, out, out_stride, rows, scratch, threads, BF16); \
}
ENTRY(f32, float, 0)
#if CONVEYOR_AVX512_BF16
ENTRY(bf16, uint16_t, 1)
#endif
