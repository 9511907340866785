"""Backend choices for a built ``Transformer``, applied by one function, ``apply_backend``, in one
order: weights placed (read from their GGUF blocks by the CPU kernels, or dense, and in bfloat16
on the CPU prepacked for oneDNN), then the fused elementwise kernels, then the tensor-parallel
all-reduce or the one-call decode stack. The network itself (``model.py``) only has the slots
these fill."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from conveyor.kernels import isa
from conveyor.kernels.bindings import StackLayer
from conveyor.kernels.blocks import DENSE_TYPES, QuantizedWeight
from conveyor.kernels.library import CPUKernels
from conveyor.model.gguf_file import matrices_by_type
from conveyor.model.model import FeedForward, Linear, RMSNorm, Transformer, fused_parts
from conveyor.model.moe import SparseMoE

logger = logging.getLogger("conveyor")

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]

# Batch invariance: the rows of a dense matmul's every call (a decode's one row pays for eight;
# a dense weight is read whole at any row count)
INVARIANT_ROWS = 8
# The block linears read rows in chunks of 32 values (a block type's blocks hold whole chunks):
# dense rows of another width run as dense weights.
KERNEL_CHUNK = 32


@torch.no_grad()
def apply_backend(model: Transformer, weights: dict[str, torch.Tensor],
                  quantized: dict[str, QuantizedWeight], *, dtype: torch.dtype,
                  device: torch.device, kernels: CPUKernels | None, kv_caches: KVCaches,
                  all_reduce: Callable[[torch.Tensor], None] | None = None,
                  batch_invariant: bool = False, decode_stack: bool = True) -> None:
    """Place the weights in ``model`` (built on the meta device) and attach what runs them:
    the CPU kernels where they apply, the all-reduce of a tensor-parallel shard (which the
    one-call decode stack cannot make, so it is only used without one). batch_invariant:
    dense weights multiply a fixed number of rows a call (the kernels get it from
    ``cpu_kernels``). decode_stack: False where attention must go through the layers
    (FlexAttention)."""
    _place_weights(model, weights, quantized, dtype, device, kernels)
    model.eval()
    if batch_invariant:
        _use_fixed_shapes(model)
    if all_reduce is not None:
        _use_all_reduce(model, all_reduce)
    if kernels is not None:
        _use_elementwise_kernels(model, kernels)
        _use_moe_kernel(model, kernels)
        if all_reduce is None and decode_stack:
            _use_decode_stack(model, kernels, kv_caches)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's bfloat16 prepacking needs a CPU tier with bfloat16 arithmetic (it refuses
    others, and a forced lower tier must behave as such a CPU) and oneDNN's own say-so."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and isa.current().native_bf16
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _place_weights(model: Transformer, weights: dict[str, torch.Tensor],
                   quantized: dict[str, QuantizedWeight], dtype: torch.dtype,
                   device: torch.device, kernels: CPUKernels | None) -> None:
    """Place the loader-named tensors (``LoadedModel``'s ``weights`` and ``quantized``) in
    the model, built on the meta device. A matrix whose blocks the CPU kernels read (all of
    a fused group's parts) is read from them at every row count and never made dense; the
    embedding too, a step's rows at a time. Every other tensor is made dense in the model
    dtype one at a time (fused groups concatenated), and in bfloat16 on the CPU prepacked
    for oneDNN. One line names the matrices that run dense for want of a kernel."""
    kernel = kernels.quant_linear if kernels is not None else None
    prepack = can_prepack(device, dtype)
    unread: list[tuple[str, int]] = []  # matrices in blocks the kernel does not read

    def dense(name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        w = weights[name] if name in weights else quantized[name].dequantize()
        return w.to(dtype=as_dtype, device=device)

    def blocks(names: list[str], lookup: bool = False) -> tuple[QuantizedWeight, ...] | None:
        """The parts' blocks as the kernel reads them, or None (then they run dense); lookup:
        an embedding table's, whose rows are looked up (in the float kernels' format; as the
        kernel reads them only where the table is the head too: the file's blocks then stay
        mapped even where a copy replaces them)."""
        found = [quantized.get(name) for name in names]
        if kernel is not None and all(q is not None and q.ggml_type in kernel.types
                                      and q.in_features % KERNEL_CHUNK == 0 for q in found):
            read = (kernel.lookup_format if lookup and model.output is not None
                    else kernel.in_format)
            runs = tuple(read(q) for q in found)
            for q, run in zip(found, runs):
                if run is not q and q.release is not None and not lookup:  # a copy replaces it
                    q.release()
            return runs
        unread.extend((n, q.ggml_type) for n, q in zip(names, found) if q is not None
                      and q.ggml_type not in DENSE_TYPES.values())
        return None

    def place(module: Linear, prefixes: list[str]) -> None:
        runs = blocks([p + ".weight" for p in prefixes])
        if runs is not None:
            module.quantized, module.quant_linear = runs, kernel
            module.weight = nn.Parameter(torch.empty(0, dtype=dtype, device=device),
                                         requires_grad=False)
        else:
            module.weight = nn.Parameter(torch.cat([dense(p + ".weight") for p in prefixes]),
                                         requires_grad=False)
            if prepack:
                module.prepack()
        if module.bias is not None:
            module.bias = nn.Parameter(torch.cat([dense(p + ".bias") for p in prefixes]),
                                       requires_grad=False)

    for i, layer in enumerate(model.layers):
        for local, module in layer.named_modules():
            if isinstance(module, Linear):
                place(module, [f"layers.{i}.{part}" for part in fused_parts(local)])
            elif isinstance(module, RMSNorm):
                module.weight = nn.Parameter(dense(f"layers.{i}.{local}.weight"),
                                             requires_grad=False)
            elif isinstance(module, SparseMoE):  # (its router in float32, at any dtype)
                module.router = nn.Parameter(
                    dense(f"layers.{i}.{local}.router.weight", torch.float32),
                    requires_grad=False)
    model.norm.weight = nn.Parameter(dense("norm.weight"), requires_grad=False)
    if model.output is not None:
        place(model.output, ["output"])
    embedding = "tok_embeddings.weight"
    table = blocks([embedding], lookup=True) if kernels is not None else None
    if table is not None:
        # the lookup reads the float kernels' format; a tied head repacked for the integer
        # kernel is a copy beside it (the lookup touches only a step's rows of the file's)
        stored = quantized[embedding]
        model.embedding_blocks = (kernel.lookup_format(stored) if table[0].repacked
                                  else table[0])
        model.embedding_rows = kernels.dequant_rows
        if model.embedding_blocks is not stored and stored.release is not None:
            stored.release()
        if model.output is None:
            model.head_blocks, model.head_kernel = table[0], kernel
        model.tok_embeddings.weight = nn.Parameter(torch.empty(0, dtype=dtype, device=device),
                                                  requires_grad=False)
    else:
        model.tok_embeddings.weight = nn.Parameter(dense(embedding), requires_grad=False)
        if model.output is None and prepack:
            model.packed_head = torch.ops.mkldnn._reorder_linear_weight(
                model.tok_embeddings.weight, 64)
    if unread:
        logger.info("the %s block linears do not read these types; they run as dense "
                    "weights: %s", str(dtype).removeprefix("torch."), matrices_by_type(unread))
    assert not any(p.is_meta for p in model.parameters()), "a weight was not placed"


def _use_fixed_shapes(model: Transformer) -> None:
    """Every dense matmul on INVARIANT_ROWS rows a call (model.in_pieces)."""
    for m in model.modules():
        if isinstance(m, Linear) and m.quant_linear is None:
            m.rows_a_call = INVARIANT_ROWS
    if model.output is None and model.head_kernel is None:
        model.head_rows_a_call = INVARIANT_ROWS


def _use_all_reduce(model: Transformer, all_reduce: Callable[[torch.Tensor], None]) -> None:
    """This rank holds a tensor-parallel shard: sum the attention and feed-forward outputs
    over the ranks (2 all-reduces a layer)."""
    for layer in model.layers:
        layer.all_reduce = all_reduce


def _use_elementwise_kernels(model: Transformer, kernels: CPUKernels) -> None:
    """Run the residual-stream norms (not the per-head q/k norms) and SiLU(gate) * up with the
    CPU kernels. GeGLU stays PyTorch's here: the C kernel is scalar, and at Gemma's widths
    PyTorch's vectorised gelu is faster (docs/results/model-families); the decode stack, which
    must stay in C, uses it."""
    for layer in model.layers:
        for norm in layer.children():
            if isinstance(norm, RMSNorm):
                norm.fused = kernels.add_rms_norm
        for feed_forward in layer.modules():  # (the dense one, or each expert)
            if isinstance(feed_forward, FeedForward) and feed_forward.act == "silu":
                feed_forward.gated_mul = kernels.gated_mul["silu"]
    model.norm.fused = kernels.add_rms_norm


def _use_moe_kernel(model: Transformer, kernels: CPUKernels) -> None:
    """Each layer's router and experts in one call (SparseMoE.kernel), where every expert's
    linears are read from their blocks."""
    for layer in model.layers:
        moe = layer.feed_forward
        if not isinstance(moe, SparseMoE) or any(
                linear.quantized is None for e in moe.experts for linear in (e.w13, e.w2)):
            continue
        moe.kernel = kernels.moe(moe.router, [e.w13.quantized for e in moe.experts],
                                 [e.w2.quantized for e in moe.experts], used=moe.used,
                                 norm_topk=moe.norm_topk, act=moe.experts[0].act,
                                 stats=moe.stats)


def _use_decode_stack(model: Transformer, kernels: CPUKernels,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Run a step of a few decodes through all layers in one kernel call, when every layer
    is what that kernel computes: whole heads rotated, every linear in GGUF blocks, no output
    bias, a dense feed-forward or experts on their kernel without a shared expert (q/k norms,
    windows, Gemma's after-norms, GeGLU and soft cap it takes)."""
    linears = [m for layer in model.layers for m in layer.modules() if isinstance(m, Linear)]
    moe = model.config.moe
    if (model.config.rotary_dim is not None
            or (moe is not None and (moe.shared_intermediate or any(
                layer.feed_forward.kernel is None for layer in model.layers)))
            or model.config.qk_norm_whole or any(m.quantized is None for m in linears)
            or any(layer.attention.wo.bias is not None for layer in model.layers)
            or any(layer.attention.rope > 1 for layer in model.layers)):  # (it takes two)
        return
    c = model.config

    def weight(norm: RMSNorm | None) -> torch.Tensor | None:
        return None if norm is None else norm.weight

    def feed_forward(layer: nn.Module) -> dict:
        ff = layer.feed_forward
        if isinstance(ff, SparseMoE):
            return {"w13": (), "w2": (), "experts": ff.kernel}
        return {"w13": ff.w13.quantized, "w2": ff.w2.quantized}

    model.decode_stack = kernels.decode_stack(
        [StackLayer(layer.attention_norm.weight, layer.ffn_norm.weight,
                    layer.attention.wqkv.quantized, layer.attention.wo.quantized,
                    qkv_bias=layer.attention.wqkv.bias, k_cache=kv_cache[0],
                    v_cache=kv_cache[1], window=layer.attention.scores.window,
                    rope=layer.attention.rope, q_norm=weight(layer.attention.q_norm),
                    k_norm=weight(layer.attention.k_norm),
                    post_attention_norm=weight(layer.post_attention_norm),
                    post_ffn_norm=weight(layer.post_ffn_norm), **feed_forward(layer))
         for layer, kv_cache in zip(model.layers, kv_caches)],
        heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        intermediate=c.intermediate_size, eps=c.rms_norm_eps, scale=c.attention_scale,
        softcap=c.attn_softcap, act=c.hidden_act)
