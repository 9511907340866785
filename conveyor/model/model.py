"""The Llama-family network (Llama, Mistral, Qwen2, Qwen3, Phi-3) as a few plain PyTorch modules;
Gemma's differences are ``conveyor.model.gemma``'s.

Weights arrive under the names ``conveyor.model.loader`` gives them; q/k/v and gate/up are fused
here, once, at load, so each layer runs two matmuls fewer (a matrix read from its GGUF blocks
keeps its parts, each a run of output rows of the kernel's call).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels.bindings import AddRMSNorm, DecodeStack, DequantRows, GatedMul, QuantLinear
from conveyor.kernels.blocks import QuantizedWeight
from conveyor.model.attention import AttentionMetadata, Scores, paged_attention, write_kv
from conveyor.model.config import ModelConfig
from conveyor.model.rope import apply_rope

# The matmuls run fused, one per group: the fused name and its parts, in order (a feed-forward's
# w13 wherever it is: an expert's too).
FUSED = {"wqkv": ("wq", "wk", "wv"), "w13": ("w1", "w3")}


def fused_parts(name: str) -> list[str]:
    """A linear's loader names: a fused one's parts (``a.b.w13`` -> ``a.b.w1``, ``a.b.w3``)."""
    head, dot, last = name.rpartition(".")
    return [head + dot + part for part in FUSED[last]] if last in FUSED else [name]


class Linear(nn.Linear):
    """``nn.Linear`` whose weight is either read from its GGUF blocks by the CPU kernel (then
    there is no dense weight at all), or dense, and then possibly reordered once into oneDNN's
    blocked layout: on the CPU in bfloat16 the prepacked matmul is faster at the row counts a
    step has (1-64; docs/results/design-notes#prepacked-linear) and gives the same bits as
    ``F.linear`` (checked in tests/model/test_model_layers.py)."""

    packed: torch.Tensor | None = None
    # batch invariance: a dense weight multiplies this many rows a call (in_pieces)
    rows_a_call: int | None = None
    # The weight in GGUF blocks: runs of output rows (a fused linear's parts), one call each.
    quantized: tuple[QuantizedWeight, ...] | None = None
    quant_linear: QuantLinear | None = None

    def reset_parameters(self) -> None:
        """Nothing: every weight is loaded (a random init on the meta device costs seconds)."""

    def prepack(self) -> None:
        """Reorder the weight for oneDNN; the dense weight is then dropped (the packed copy
        replaces it)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 64)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_linear is not None:
            return self.quant_linear(x, self.quantized, self.bias)
        if self.rows_a_call is not None:
            return in_pieces(self._dense, x, self.rows_a_call)
        return self._dense(x)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class RMSNorm(nn.Module):
    """Given a residual, normalises ``residual + x`` and returns that sum too (the next residual),
    as vLLM's fused add-norm does; the CPU kernel, when attached, does both in one call."""

    fused: AddRMSNorm | None = None

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused is not None:
            out = self.fused(x, residual, self.weight, self.eps)  # updates residual in place
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale in the model dtype, exactly as transformers does.
        # (F.rms_norm is that formula in one kernel: the same bits, fewer ops.)
        h = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * h.to(x.dtype)


# A layer's rope: its positions' cos and signed sin, [T, 1, head_dim] each; the model's
# tables, one per rope a layer may read (``ModelConfig.rope_index``).
Rope = tuple[torch.Tensor, torch.Tensor]


def in_pieces(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
              rows: int) -> torch.Tensor:
    """``fn(x)`` taken ``rows`` rows at a time, the last piece padded with zero rows: every call
    has one shape, so a dense matmul sums each row in one order whatever rows share its step
    (batch invariance; a GEMM's blocking, and with it the order, follows its shape)."""
    pad = -x.shape[0] % rows
    if pad:
        x = torch.cat((x, x.new_zeros(pad, *x.shape[1:])))
    out = torch.cat([fn(piece) for piece in x.split(rows)])
    return out[:out.shape[0] - pad]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.scores = Scores(config.attention_scale, config.window(layer), config.attn_softcap)
        self.rope = config.rope_index(layer)
        self.n_heads, self.n_kv_heads, self.head_dim = (config.num_heads, config.num_kv_heads,
                                                        config.head_dim)
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv_heads * self.head_dim
        self.wqkv = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                           bias=config.attention_bias)
        self.wo = Linear(self.q_size, config.hidden_size, bias=config.output_bias)
        self.qk_norm_whole = config.qk_norm_whole
        if config.qk_norm:  # each head's, or (OLMoE) the whole projection's
            whole = config.qk_norm_whole
            self.q_norm = RMSNorm(self.q_size if whole else self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size if whole else self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, ropes: list[Rope],
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        cos, sin = ropes[self.rope]
        qkv = self.wqkv(x)
        if self.qk_norm_whole:
            qk = self.q_size + self.kv_size
            qkv = torch.cat((self.q_norm(qkv[:, :self.q_size]),
                             self.k_norm(qkv[:, self.q_size:qk]), qkv[:, qk:]), dim=1)
        qkv = qkv.view(T, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        qk, v = qkv[:, :self.n_heads + self.n_kv_heads], qkv[:, self.n_heads + self.n_kv_heads:]
        if self.q_norm is not None and not self.qk_norm_whole:
            qk = torch.cat((self.q_norm(qk[:, :self.n_heads]), self.k_norm(qk[:, self.n_heads:])),
                           dim=1)
        if meta.rope_kv_write is not None:
            meta.rope_kv_write(qk, v, cos, sin, meta.slot_mapping, *kv_cache)
        else:
            qk = apply_rope(qk, cos, sin)  # q and k heads together: one set of ops, not two
            write_kv(qk[:, self.n_heads:], v, *kv_cache, meta.slot_mapping)
        q, k = qk[:, :self.n_heads], qk[:, self.n_heads:]
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scores)
        return self.wo(o.reshape(T, self.q_size))


class FeedForward(nn.Module):
    """act(gate) * up, then down: SwiGLU (SiLU) or Gemma's GeGLU (tanh-approximated GELU)."""

    gated_mul: GatedMul | None = None  # the CPU kernel of act(gate) * up, when attached

    def __init__(self, config: ModelConfig, intermediate: int | None = None) -> None:
        """intermediate: its features where not the config's (an expert's)."""
        super().__init__()
        self.act = config.hidden_act
        self.intermediate = intermediate or config.intermediate_size
        self.w13 = Linear(config.hidden_size, 2 * self.intermediate, bias=False)
        self.w2 = Linear(self.intermediate, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated_mul is not None:
            return self.w2(self.gated_mul(self.w13(x)))
        gate, up = self.w13(x).split(self.intermediate, dim=-1)
        gate = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
        return self.w2(gate * up)


class TransformerBlock(nn.Module):
    # Tensor parallel: sums the ranks' partial outputs of the row-parallel linears, in place.
    all_reduce: Callable[[torch.Tensor], None] | None = None

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config, layer)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = FeedForward(config)
        # norms of the attention's and the feed-forward's outputs (Gemma's block has them)
        self.post_attention_norm: RMSNorm | None = None
        self.post_ffn_norm: RMSNorm | None = None

    def forward(self, h, residual, ropes, kv_cache, meta):
        """h: the previous block's output, residual: the stream before it (None at the first
        block, where h is the embeddings). Returns this block's output and the stream before it:
        the same sums as ``h = x + attn(norm(x)); h + ffn(norm(h))`` (with after-norms,
        ``h = x + post(attn(norm(x))); h + post(ffn(norm(h)))``), fusable with the norms."""
        if residual is None:
            x, residual = self.attention_norm(h), h
        else:
            x, residual = self.attention_norm(h, residual)
        x = self.attention(x, ropes, kv_cache, meta)
        if self.all_reduce is not None:
            self.all_reduce(x)
        if self.post_attention_norm is not None:
            x = self.post_attention_norm(x)
        x, residual = self.ffn_norm(x, residual)
        x = self.feed_forward(x)
        if self.all_reduce is not None:
            self.all_reduce(x)
        if self.post_ffn_norm is not None:
            x = self.post_ffn_norm(x)
        return x, residual


class Transformer(nn.Module):
    """Build it on the meta device (no memory), then place its weights and backend with
    ``conveyor.model.backend.apply_backend``."""

    block = TransformerBlock  # a family's own layer, where it differs (conveyor.model.gemma)

    def __init__(self, config: ModelConfig, head_rows: int | None = None) -> None:
        """head_rows: the output matrix's rows where not the vocabulary (a tensor-parallel
        rank's share of it)."""
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, _weight=torch.empty(
            config.vocab_size, config.hidden_size))  # (given: no random init)
        self.layers = nn.ModuleList(self.block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output = (None if config.tie_word_embeddings
                       else Linear(config.hidden_size, head_rows or config.vocab_size,
                                   bias=False))
        self.packed_head: torch.Tensor | None = None  # the tied head, when prepacked
        # The embedding table in GGUF blocks, its rows dequantized as a step looks them up;
        # the tied head reads the same blocks.
        self.embedding_blocks: QuantizedWeight | None = None
        self.embedding_rows: DequantRows | None = None
        self.head_blocks: QuantizedWeight | None = None
        self.head_kernel: QuantLinear | None = None
        self.decode_stack: DecodeStack | None = None  # all layers in one call, at a few decodes
        self.head_rows_a_call: int | None = None  # a dense tied head's, as Linear.rows_a_call

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embedding_rows is not None:
            return self.embedding_rows(self.embedding_blocks, input_ids)
        return self.tok_embeddings(input_ids)

    def forward(self, input_ids: torch.Tensor, ropes: list[Rope],
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids: [T]; ropes: each rope table's cos/sin at each token's position. Returns
        [T, D]."""
        h, residual = self.embed(input_ids), None
        if (self.decode_stack is not None and not meta.prefills
                and len(input_ids) <= self.decode_stack.max_rows):
            residual = torch.empty_like(h)
            (group,) = meta.decodes
            self.decode_stack(h, residual, ropes, meta.slot_mapping, group.block_tables,
                              group.context_lens)
            return self.norm(h, residual)[0]
        for layer, kv_cache in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, ropes, kv_cache, meta)
        return self.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_rows_a_call is not None:
            return in_pieces(self._logits, hidden, self.head_rows_a_call)
        return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_kernel is not None:
            return self.head_kernel(hidden, self.head_blocks).float()
        if self.output is not None:
            return self.output(hidden).float()
        if self.packed_head is not None:
            return torch.ops.mkldnn._linear_pointwise(hidden, self.packed_head, None, "none", [],
                                                      "").float()
        return F.linear(hidden, self.tok_embeddings.weight).float()
