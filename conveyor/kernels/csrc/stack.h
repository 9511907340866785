/* What decode_stack.c and moe_ffn.c share: the structs kernels/structs.py copies (a linear's
 * runs of GGUF blocks, a layer's experts, the model's sizes; layout.c tells their layout) and
 * the block linear over a matrix's runs, routed to the float or the integer kernel as the
 * Python side routes it. */
#ifndef CONVEYOR_STACK_H
#define CONVEYOR_STACK_H

#include <stdint.h>

#include "blocks.h"
#include "common.h"
#include "repacked.h"

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

/* A layer's experts (moe_ffn.c): the float32 router, each expert's fused gate+up and down. */
typedef struct Experts {
    const float *router;                    /* [experts, hidden] */
    const Matrix *w13, *w2;                 /* [experts] */
    int32_t experts, used, intermediate;
    int32_t norm_topk;                      /* the chosen weights renormalised to sum to 1 */
    int32_t max_rows;                       /* the rows a block-linear call takes */
    int64_t *stats;                         /* added to by each call: its nanoseconds, and
                                               the distinct experts it ran */
} Experts;

typedef struct Layer {
    const void *attention_norm, *ffn_norm;  /* [hidden] */
    Matrix wqkv, wo, w13, w2;
    const void *qkv_bias;                   /* [qkv] or NULL */
    void *k_cache, *v_cache;                /* [blocks, block_size, kv_heads, dim] (kv_type) */
    int32_t window;                         /* its sliding window's tokens; 0: none */
    int32_t rope;                           /* its rope table: 0, or 1 (the local one) */
    const void *q_norm, *k_norm;            /* [dim] or NULL */
    const void *post_attention_norm, *post_ffn_norm;  /* [hidden] or NULL */
    const Experts *experts;                 /* the feed-forward's experts; NULL: w13, w2 */
} Layer;

typedef struct Shape {
    int hidden, heads, kv_heads, dim, intermediate, block_size;
    float eps, scale, softcap;              /* softcap: the scores'; 0: none */
    int gelu;                               /* the gate's activation: 0 SiLU, 1 GELU (tanh) */
    int levels, int_rows;                   /* --activation-quant: a step of at most int_rows
                                               rows on the integer linears (levels 0: none) */
    int superblock_rows;                    /* and K-quant runs of up to this many */
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
        /* (as bindings.IntQuantLinear.takes routes a call: dense rows never, repacked ones
         * always) */
        if (is_repacked(r->type) || (s->levels && !is_dense(r->type)
            && (rows <= s->int_rows || (rows <= s->superblock_rows && is_k_quant(r->type)))))
            rc = BY_DTYPE(quant_linear_int, x, x_stride, r->blocks, r->row_bytes, r->type, b,
                          (char *)y + elem * n0, y_stride, rows, r->rows, k, s->levels, threads);
        else
            rc = BY_DTYPE(quant_linear, x, x_stride, r->blocks, r->row_bytes, r->type, b,
                          (char *)y + elem * n0, y_stride, rows, r->rows, k, s->invariant,
                          threads);
    }
    return rc;
}

/* y = w2 (act(x w1^T) * (x w3^T)), w13 the fused gate and up rows: a dense feed-forward or one
 * expert's. gu: [rows, 2 inter] of scratch. */
static ALWAYS_INLINE int gated_ffn(const void *x, int64_t x_stride, const Matrix *w13,
                                   const Matrix *w2, void *gu, void *y, int64_t y_stride,
                                   int rows, int inter, const Shape *s, int threads, int bf16) {
    int rc = matrix_linear(x, x_stride, w13, NULL, gu, 2 * inter, rows, s->hidden, s, threads,
                           bf16);
    if (rc) return rc;
    if (s->gelu)
        BY_DTYPE(gelu_tanh_mul, gu, 2 * inter, rows, inter, threads);
    else
        BY_DTYPE(silu_mul, gu, 2 * inter, rows, inter, threads);
    return matrix_linear(gu, 2 * inter, w2, NULL, y, y_stride, rows, inter, s, threads, bf16);
}

#endif
