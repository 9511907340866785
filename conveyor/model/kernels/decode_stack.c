/* Every decoder layer of a decode step with a few requests, in one call.
 *
 * With one to a few single-token queries the work of a layer is small and the ~20 PyTorch calls
 * that make it up (each with its Python and dispatch cost) are a quarter of the step. This runs
 * the same layer, in the same order and with the same roundings, as model.TransformerBlock on
 * the CPU bfloat16 path: the fused add + RMSNorm, the GGUF-block linears, the fused rope + KV
 * write, the paged decode attention and SiLU(gate) * up are the kernels that path calls one by
 * one.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int quant_linear(const uint16_t *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes,
                 int type, const uint16_t *bias, uint16_t *y, int64_t y_stride, int rows, int n,
                 int k, int threads);
void add_rms_norm(const uint16_t *x, int64_t x_stride, uint16_t *residual,
                  const uint16_t *weight, uint16_t *out, int64_t out_stride, int rows, int dim,
                  float eps, int threads);
void silu_mul(uint16_t *gu, int64_t stride, int rows, int inter, int threads);
void rope_kv_write(uint16_t *qk, int64_t qk_stride, const uint16_t *v, int64_t v_stride,
                   const uint16_t *cos, const uint16_t *sin, int64_t cs_stride,
                   const int64_t *slots, uint16_t *k_cache, uint16_t *v_cache, int tokens,
                   int heads, int kv_heads, int dim, int threads);
int paged_decode_attention(const uint16_t *q, int64_t q_stride,
                           const uint16_t *k_cache, const uint16_t *v_cache,
                           const int32_t *block_tables, int64_t table_stride,
                           const int32_t *context_lens, uint16_t *out, int64_t out_stride,
                           int n, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, float scale, int threads);

/* A GGUF-block matrix: out rows of row_bytes, of ggml type `type`. */
typedef struct {
    const uint8_t *blocks;
    int64_t row_bytes;
    int32_t type;
} Matrix;

typedef struct {
    const uint16_t *attention_norm, *ffn_norm;  /* [hidden] */
    Matrix wqkv, wo, w13, w2;
    const uint16_t *qkv_bias;                   /* [qkv] or NULL */
    uint16_t *k_cache, *v_cache;                /* [blocks, block_size, kv_heads, dim] */
} Layer;

typedef struct {
    int hidden, heads, kv_heads, dim, intermediate, block_size;
    float eps, scale;
} Shape;

/* h: [rows, hidden], the embeddings in, the last layer's output out; residual: [rows, hidden],
 * the stream before that output (as TransformerBlock returns them). cos, sin: [rows, dim];
 * slots: [rows]; block_tables: [rows, table_stride]; context_lens: [rows]. Returns 0, or the
 * first failing kernel's code. */
int decode_stack(const Layer *layers, int num_layers, const Shape *s, uint16_t *h,
                 uint16_t *residual, int rows, const uint16_t *cos, const uint16_t *sin,
                 const int64_t *slots, const int32_t *block_tables, int64_t table_stride,
                 const int32_t *context_lens, int threads) {
    const int hid = s->hidden, q = s->heads * s->dim, kv = s->kv_heads * s->dim;
    const int qkv = q + 2 * kv, inter = s->intermediate;
    uint16_t *x = malloc(sizeof(uint16_t) * rows * (hid + qkv + q + hid + 2 * inter));
    if (x == NULL) return -2;
    uint16_t *t_qkv = x + rows * hid, *o = t_qkv + rows * qkv, *a = o + rows * q;
    uint16_t *gu = a + rows * hid;
    int rc = 0;
    memcpy(residual, h, sizeof(uint16_t) * rows * hid);
    for (int i = 0; i < num_layers && rc == 0; i++) {
        const Layer *l = &layers[i];
        add_rms_norm(h, hid, i == 0 ? NULL : residual, l->attention_norm, x, hid, rows, hid,
                     s->eps, threads);
        rc = quant_linear(x, hid, l->wqkv.blocks, l->wqkv.row_bytes, l->wqkv.type, l->qkv_bias,
                          t_qkv, qkv, rows, qkv, hid, threads);
        if (rc) break;
        rope_kv_write(t_qkv, qkv, t_qkv + q + kv, qkv, cos, sin, s->dim, slots, l->k_cache,
                      l->v_cache, rows, s->heads, s->kv_heads, s->dim, threads);
        rc = paged_decode_attention(t_qkv, qkv, l->k_cache, l->v_cache, block_tables,
                                    table_stride, context_lens, o, q, rows, s->heads,
                                    s->kv_heads, s->dim, s->block_size, s->scale, threads);
        if (rc) break;
        rc = quant_linear(o, q, l->wo.blocks, l->wo.row_bytes, l->wo.type, NULL, a, hid, rows,
                          hid, q, threads);
        if (rc) break;
        add_rms_norm(a, hid, residual, l->ffn_norm, x, hid, rows, hid, s->eps, threads);
        rc = quant_linear(x, hid, l->w13.blocks, l->w13.row_bytes, l->w13.type, NULL, gu,
                          2 * inter, rows, 2 * inter, hid, threads);
        if (rc) break;
        silu_mul(gu, 2 * inter, rows, inter, threads);
        rc = quant_linear(gu, 2 * inter, l->w2.blocks, l->w2.row_bytes, l->w2.type, NULL, h,
                          hid, rows, hid, inter, threads);
    }
    free(x);
    return rc;
}
