/* Every decoder layer of a step of single-token queries, in one call, in the model dtype.
 *
 * With one to a few dozen single-token queries the work of a layer is small and the ~20 PyTorch
 * calls that make it up (each with its Python and dispatch cost) are a large share of the step.
 * This runs the same layer, in the same order and with the same roundings, as
 * model.TransformerBlock (and gemma.GemmaBlock) on the CPU kernel path: the fused add + RMSNorm,
 * the GGUF-block linears, the per-head q/k norms (Qwen3, Gemma 3), the fused rope + KV write,
 * the paged decode attention (its window, scale and soft cap), Gemma's norms after attention
 * and feed-forward, and act(gate) * up are the kernels that path calls one by one. The same at
 * every tier; the kernels are the tier's.
 */
#include <stdint.h>
#include <string.h>

#include "blocks.h"
#include "common.h"

#if CONVEYOR_AVX512_BF16
#define BY_DTYPE(name, ...) (bf16 ? name##_bf16(__VA_ARGS__) : name##_f32(__VA_ARGS__))
#else
#define BY_DTYPE(name, ...) name##_f32(__VA_ARGS__)
#endif

/* A linear's weight in GGUF blocks: runs of output rows, each of one ggml type (a fused
 * linear whose parts the file stores in different types, as llama.cpp's K-quant mixes do with
 * v rows, has more than one). */
#define MAX_RUNS 3

typedef struct {
    const uint8_t *blocks;
    int64_t row_bytes;
    int32_t type, rows;
} Run;

typedef struct {
    Run run[MAX_RUNS];
    int32_t runs;
} Matrix;

typedef struct Layer {
    const void *attention_norm, *ffn_norm;  /* [hidden] */
    Matrix wqkv, wo, w13, w2;
    const void *qkv_bias;                   /* [qkv] or NULL */
    void *k_cache, *v_cache;                /* [blocks, block_size, kv_heads, dim] (kv_type) */
    int32_t window;                         /* its sliding window's tokens; 0: none */
    int32_t rope;                           /* its rope table: 0, or 1 (the local one) */
    const void *q_norm, *k_norm;            /* [dim] or NULL */
    const void *post_attention_norm, *post_ffn_norm;  /* [hidden] or NULL */
} Layer;

typedef struct Shape {
    int hidden, heads, kv_heads, dim, intermediate, block_size;
    float eps, scale, softcap;              /* softcap: the scores'; 0: none */
    int gelu;                               /* the gate's activation: 0 SiLU, 1 GELU (tanh) */
    int levels, int_rows;                   /* --activation-quant: a step of at most int_rows
                                               rows on the integer linears (levels 0: none) */
    int superblock_rows;                    /* and K-quant runs at any row count */
    int invariant;                          /* --batch-invariant: the linears' (quant_linear) */
    int kv_type;                            /* the caches' storage (common.h) */
} Shape;

/* y = x m^T (+ bias): each run's block linear into its columns of y. */
static ALWAYS_INLINE int matrix_linear(const void *x, int64_t x_stride, const Matrix *m,
                                       const void *bias, void *y, int64_t y_stride, int rows,
                                       int k, const Shape *s, int threads, int bf16) {
    const size_t elem = bf16 ? 2 : 4;
    int rc = 0;
    for (int i = 0, n0 = 0; i < m->runs && rc == 0; n0 += m->run[i++].rows) {
        const Run *r = &m->run[i];
        const void *b = bias == NULL ? NULL : (const char *)bias + elem * n0;
        /* (as bindings.IntQuantLinear.takes routes a call) */
        if (s->levels && (rows <= s->int_rows || (s->superblock_rows && is_k_quant(r->type))))
            rc = BY_DTYPE(quant_linear_int, x, x_stride, r->blocks, r->row_bytes, r->type, b,
                          (char *)y + elem * n0, y_stride, rows, r->rows, k, s->levels, threads);
        else
            rc = BY_DTYPE(quant_linear, x, x_stride, r->blocks, r->row_bytes, r->type, b,
                          (char *)y + elem * n0, y_stride, rows, r->rows, k, s->invariant,
                          threads);
    }
    return rc;
}

/* h: [rows, hidden], the embeddings in, the last layer's output out; residual: [rows, hidden],
 * the stream before that output (as TransformerBlock returns them). cos, sin: [2][rows, dim]
 * (the local table NULL where no layer reads it);
 * slots: [rows]; block_tables: [rows, table_stride]; context_lens: [rows]; scratch: rows x
 * (2 hidden + q + 2 kv + q + 2 intermediate) elements (the caller keeps it: a fresh one a
 * step of 2048 rows is 47 MB of pages to fault in). Returns 0, or the first failing kernel's
 * code. */
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
        rc = matrix_linear(x, hid, &l->w13, NULL, gu, 2 * inter, rows, hid, s, threads, bf16);
        if (rc) break;
        if (s->gelu)
            BY_DTYPE(gelu_tanh_mul, gu, 2 * inter, rows, inter, threads);
        else
            BY_DTYPE(silu_mul, gu, 2 * inter, rows, inter, threads);
        rc = matrix_linear(gu, 2 * inter, &l->w2, NULL, h, hid, rows, inter, s, threads, bf16);
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
