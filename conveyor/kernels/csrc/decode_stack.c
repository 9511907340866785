/* Every decoder layer of a step of single-token queries, in one call, in the model dtype.
 *
 * With one to a few dozen single-token queries the work of a layer is small and the ~20 PyTorch
 * calls that make it up (each with its Python and dispatch cost) are a large share of the step.
 * This runs the same layer, in the same order and with the same roundings, as
 * model.TransformerBlock (and gemma.GemmaBlock) on the CPU kernel path: the fused add + RMSNorm,
 * the GGUF-block linears, the per-head q/k norms (Qwen3, Gemma 3), the fused rope + KV write,
 * the paged decode attention (its window, scale and soft cap), Gemma's norms after attention
 * and feed-forward, and act(gate) * up (or a layer's experts, moe_ffn.c) are the kernels that
 * path calls one by one. The same at every tier; the kernels are the tier's.
 */
#include <stdint.h>
#include <string.h>

#include "stack.h"

/* h: [rows, hidden], the embeddings in, the last layer's output out; residual: [rows, hidden],
 * the stream before that output (as TransformerBlock returns them). cos, sin: [2][rows, dim]
 * (the local table NULL where no layer reads it);
 * slots: [rows]; block_tables: [rows, table_stride]; context_lens: [rows]; scratch: rows x
 * (2 hidden + q + 2 kv + q + 2 intermediate) elements, then moe_ffn's where a layer has
 * experts (the caller keeps it: a fresh one a step of 2048 rows is 47 MB of pages to fault
 * in). Returns 0, or the first failing kernel's code. */
static ALWAYS_INLINE int decode_stack(const Layer *layers, int num_layers, const Shape *s,
                                      void *h, void *residual, int rows,
                                      const void *const *cos, const void *const *sin,
                                      const int64_t *slots,
                                      const int32_t *block_tables, int64_t table_stride,
                                      const int32_t *context_lens, void *scratch, int threads,
                                      int bf16) {
    const int hid = s->hidden, q = s->heads * s->dim, kv = s->kv_heads * s->dim;
    const int qkv = q + 2 * kv, inter = s->intermediate;
    const size_t elem = bf16 ? 2 : 4;
    char *x = scratch;
    char *t_qkv = x + elem * rows * hid, *o = t_qkv + elem * rows * qkv, *a = o + elem * rows * q;
    char *gu = a + elem * rows * hid;
    int rc = 0;
    memcpy(residual, h, elem * rows * hid);
    for (int i = 0; i < num_layers && rc == 0; i++) {
        const Layer *l = &layers[i];
        BY_DTYPE(add_rms_norm, h, hid, i == 0 ? NULL : residual, l->attention_norm, x, hid, rows,
                 hid, s->eps, threads);
        rc = matrix_linear(x, hid, &l->wqkv, l->qkv_bias, t_qkv, qkv, rows, hid, s, threads,
                           bf16);
        if (rc) break;
        if (l->q_norm != NULL)  /* each head of q, then of k, normalised in place */
            for (int r = 0; r < rows; r++) {
                char *row = t_qkv + elem * r * qkv;
                BY_DTYPE(add_rms_norm, row, s->dim, NULL, l->q_norm, row, s->dim, s->heads,
                         s->dim, s->eps, 1);
                BY_DTYPE(add_rms_norm, row + elem * q, s->dim, NULL, l->k_norm, row + elem * q,
                         s->dim, s->kv_heads, s->dim, s->eps, 1);
            }
        BY_DTYPE(rope_kv_write, t_qkv, qkv, t_qkv + elem * (q + kv), qkv, cos[l->rope],
                 sin[l->rope], s->dim, slots, l->k_cache, l->v_cache, s->kv_type, rows,
                 s->heads, s->kv_heads, s->dim, threads);
        rc = BY_DTYPE(paged_decode_attention, t_qkv, qkv, l->k_cache, l->v_cache, s->kv_type,
                      block_tables, table_stride, context_lens, o, q, rows, s->heads,
                      s->kv_heads, s->dim, s->block_size, s->scale, l->window, s->softcap,
                      threads);
        if (rc) break;
        rc = matrix_linear(o, q, &l->wo, NULL, a, hid, rows, q, s, threads, bf16);
        if (rc) break;
        if (l->post_attention_norm != NULL)
            BY_DTYPE(add_rms_norm, a, hid, NULL, l->post_attention_norm, a, hid, rows, hid,
                     s->eps, threads);
        BY_DTYPE(add_rms_norm, a, hid, residual, l->ffn_norm, x, hid, rows, hid, s->eps, threads);
        if (l->experts != NULL)  /* (its scratch after the dense feed-forward's) */
            rc = BY_DTYPE(moe_ffn, l->experts, s, x, hid, h, hid, rows,
                          gu + elem * rows * 2 * inter, threads);
        else
            rc = gated_ffn(x, hid, &l->w13, &l->w2, gu, h, hid, rows, inter, s, threads, bf16);
        if (rc) break;
        if (l->post_ffn_norm != NULL)
            BY_DTYPE(add_rms_norm, h, hid, NULL, l->post_ffn_norm, h, hid, rows, hid, s->eps,
                     threads);
    }
    return rc;
}

#define ENTRY(T, BF16) \
int decode_stack_##T(const Layer *layers, int num_layers, const Shape *s, void *h, \
                     void *residual, int rows, const void *const *cos, const void *const *sin, \
                     const int64_t *slots, const int32_t *block_tables, int64_t table_stride, \
                     const int32_t *context_lens, void *scratch, int threads) { \
    return decode_stack(layers, num_layers, s, h, residual, rows, cos, sin, slots, block_tables, \
                        table_stride, context_lens, scratch, threads, BF16); \
}
ENTRY(f32, 0)
#if CONVEYOR_AVX512_BF16
ENTRY(bf16, 1)
#endif
