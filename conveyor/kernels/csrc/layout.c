/* stack.h's structs as this compiler lays them out, for the test that holds kernels/structs.py's
 * ctypes copies to them: a struct's size ("Layer"), a field's offset ("Layer.window"), or a
 * shared limit ("MAX_RUNS"); -1 for a name it does not know. */
#include <stddef.h>
#include <string.h>

#include "stack.h"

#define SIZE(T) if (strcmp(name, #T) == 0) return (int)sizeof(T);
#define AT(T, f) if (strcmp(name, #T "." #f) == 0) return (int)offsetof(T, f);

int struct_layout(const char *name) {
    SIZE(Run) AT(Run, blocks) AT(Run, row_bytes) AT(Run, type) AT(Run, rows)
    SIZE(Matrix) AT(Matrix, run) AT(Matrix, runs)
    SIZE(Experts) AT(Experts, router) AT(Experts, w13) AT(Experts, w2) AT(Experts, experts)
    AT(Experts, used) AT(Experts, intermediate) AT(Experts, norm_topk) AT(Experts, max_rows)
    AT(Experts, stats)
    SIZE(Layer) AT(Layer, attention_norm) AT(Layer, ffn_norm) AT(Layer, wqkv) AT(Layer, wo)
    AT(Layer, w13) AT(Layer, w2) AT(Layer, qkv_bias) AT(Layer, k_cache) AT(Layer, v_cache)
    AT(Layer, window) AT(Layer, rope) AT(Layer, q_norm) AT(Layer, k_norm)
    AT(Layer, post_attention_norm) AT(Layer, post_ffn_norm) AT(Layer, experts)
    SIZE(Shape) AT(Shape, hidden) AT(Shape, heads) AT(Shape, kv_heads) AT(Shape, dim)
    AT(Shape, intermediate) AT(Shape, block_size) AT(Shape, eps) AT(Shape, scale)
    AT(Shape, softcap) AT(Shape, gelu) AT(Shape, levels) AT(Shape, int_rows)
    AT(Shape, superblock_rows) AT(Shape, invariant) AT(Shape, kv_type)
    if (strcmp(name, "MAX_RUNS") == 0) return MAX_RUNS;
    return -1;
}
