/* Every entry point of a tier's kernel library, declared once. Each file that defines one
 * includes this (through common.h), so the compiler checks the definition against it;
 * decode_stack.c calls the kernels through it; the bindings take their ctypes signatures from it
 * (kernels/signatures.py). A tier defines the bfloat16 entries only where it computes
 * bfloat16 (CONVEYOR_AVX512_BF16), and has_amx only from the avx512 sources on. */
#ifndef CONVEYOR_KERNELS_H
#define CONVEYOR_KERNELS_H

#include <stdint.h>

struct Layer;  /* decode_stack.c: a decoder layer's weights and caches */
struct Shape;  /* decode_stack.c: the model's sizes */
struct Experts;  /* moe_ffn.c: a layer's router and experts */

/* The entries of one dtype: T its suffix, E its element (bfloat16's bits as uint16_t). */
#define CONVEYOR_KERNELS(T, E) \
int quant_linear_##T(const E *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes, \
                     int type, const E *bias, E *y, int64_t y_stride, int rows, int n, int k, \
                     int invariant, int threads); \
int quant_linear_int_##T(const E *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes, \
                         int type, const E *bias, E *y, int64_t y_stride, int rows, int n, \
                         int k, int levels, int threads); \
int dequant_rows_##T(const uint8_t *w, int64_t row_bytes, int type, const int64_t *ids, int n, \
                     int k, E *out, int64_t out_stride, int threads); \
void add_rms_norm_##T(const E *x, int64_t x_stride, E *residual, const E *weight, E *out, \
                      int64_t out_stride, int rows, int dim, float eps, int threads); \
void silu_mul_##T(E *gu, int64_t stride, int rows, int inter, int threads); \
void gelu_tanh_mul_##T(E *gu, int64_t stride, int rows, int inter, int threads); \
void rope_kv_write_##T(E *qk, int64_t qk_stride, const E *v, int64_t v_stride, const E *cos, \
                       const E *sin, int64_t cs_stride, const int64_t *slots, void *k_cache, \
                       void *v_cache, int kv_type, int tokens, int heads, int kv_heads, int dim, \
                       int threads); \
int paged_decode_attention_##T(const E *q, int64_t q_stride, const void *k_cache, \
                               const void *v_cache, int kv_type, const int32_t *block_tables, \
                               int64_t table_stride, const int32_t *context_lens, E *out, \
                               int64_t out_stride, int n, int num_heads, int num_kv_heads, \
                               int head_dim, int block_size, float scale, int window, \
                               float cap, int threads); \
int moe_ffn_##T(const struct Experts *e, const struct Shape *s, const E *x, int64_t x_stride, \
                E *out, int64_t out_stride, int rows, void *scratch, int threads); \
int decode_stack_##T(const struct Layer *layers, int num_layers, const struct Shape *s, \
                     void *h, void *residual, int rows, const void *const *cos, \
                     const void *const *sin, const int64_t *slots, const int32_t *block_tables, \
                     int64_t table_stride, const int32_t *context_lens, void *scratch, \
                     int threads);

CONVEYOR_KERNELS(f32, float)
CONVEYOR_KERNELS(bf16, uint16_t)

void argmax_rows(const float *x, int64_t stride, int rows, int64_t cols, int64_t *out,
                 int threads);
int sample_rows(const float *x, int64_t stride, int rows, int64_t cols,
                const float *temperature, const int64_t *top_k, const float *top_p,
                const float *min_p, const double *u, int64_t *out, int threads);
int has_amx(void);
/* the avx2 tier's int8 layout of the K-quants (repacked.h), only where the tier reads it */
int repacked_row_bytes(int type, int k);
int repack_rows(const uint8_t *w, int64_t row_bytes, int type, int n, int k, uint8_t *out,
                int threads);
double fma_peak_gflops(int threads, double seconds, int repeats);
/* layout.c: stack.h's struct sizes, field offsets and limits, by name; -1: not one */
int struct_layout(const char *name);

#endif
