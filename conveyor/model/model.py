"""The Llama-family network (Llama, Mistral, Qwen2, Qwen3, Phi-3) as a few plain PyTorch modules.

Weights arrive under the names ``conveyor.model.loader`` gives them; q/k/v and gate/up are fused
here, once, at load, so each layer runs two matmuls fewer (a matrix read from its GGUF blocks
keeps its parts, each a run of output rows of the kernel's call).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels.bindings import AddRMSNorm, DecodeStack, DequantRows, QuantLinear, SiluMul
from conveyor.kernels.blocks import QuantizedWeight
from conveyor.model.attention import AttentionMetadata, paged_attention, write_kv
from conveyor.model.config import ModelConfig

# The matmuls run fused, one per group: the fused name and its parts, in order.
FUSED = {"attention.wqkv": ("attention.wq", "attention.wk", "attention.wv"),
         "feed_forward.w13": ("feed_forward.w1", "feed_forward.w3")}


class Linear(nn.Linear):
    """``nn.Linear`` whose weight is either read from its GGUF blocks by the CPU kernel (then
    there is no dense weight at all), or dense, and then possibly reordered once into oneDNN's
    blocked layout: on the CPU in bfloat16 the prepacked matmul is faster at the row counts a
    step has (1-64; docs/results/design-notes#prepacked-linear) and gives the same bits as
    ``F.linear`` (checked in tests/test_model_layers.py)."""

    packed: torch.Tensor | None = None
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


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(config)
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend in between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(config: ModelConfig) -> torch.Tensor:
    """YaRN: each dimension's frequency interpolated (divided by ``factor``) where it turns
    fewer than ``beta_slow`` times over the pretrained length, kept where it turns more than
    ``beta_fast`` times, a linear ramp between (as transformers computes it)."""
    s, dim, base = config.rope_scaling, config.head_dim, config.rope_theta
    old_len = s["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:  # the dimension that turns this often over old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    return (1.0 / (s["factor"] * pos_freqs) * (1 - extrapolated)
            + 1.0 / pos_freqs * extrapolated)


def rope_attention_factor(config: ModelConfig) -> float:
    """What YaRN scales cos and sin by (so q.k by its square): ``attention_factor``, else from
    ``factor`` and ``mscale``/``mscale_all_dim``; 1 for every other rope."""
    s = config.rope_scaling
    if s is None or s["rope_type"] != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return float(mscale(s["factor"], s["mscale"]) / mscale(s["factor"], s["mscale_all_dim"]))
    return mscale(s["factor"])


def rope_tables(config: ModelConfig, max_len: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin of every position, [max_len, head_dim], in the model dtype: the sin's
    first half is negated so that rotating a vector is one ``roll`` (see ``apply_rope``)."""
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), rope_inv_freq(config))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    factor = rope_attention_factor(config)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    sin[:, :freqs.shape[1]].neg_()
    return cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D] (the half-rotation layout transformers uses, whose
    ``cat(-x2, x1) * sin`` equals ``roll(x) * signed sin`` bit for bit)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (config.num_heads, config.num_kv_heads,
                                                        config.head_dim)
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv_heads * self.head_dim
        self.wqkv = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                           bias=config.attention_bias)
        self.wo = Linear(self.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.wqkv(x).view(T, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        qk, v = qkv[:, :self.n_heads + self.n_kv_heads], qkv[:, self.n_heads + self.n_kv_heads:]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :self.n_heads]), self.k_norm(qk[:, self.n_heads:])),
                           dim=1)
        if meta.rope_kv_write is not None:
            meta.rope_kv_write(qk, v, cos, sin, meta.slot_mapping, *kv_cache)
        else:
            qk = apply_rope(qk, cos, sin)  # q and k heads together: one set of ops, not two
            write_kv(qk[:, self.n_heads:], v, *kv_cache, meta.slot_mapping)
        q, k = qk[:, :self.n_heads], qk[:, self.n_heads:]
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.wo(o.reshape(T, self.q_size))


class FeedForward(nn.Module):
    silu_mul: SiluMul | None = None  # the CPU kernel, when attached

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.w13 = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w2 = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.silu_mul is not None:
            return self.w2(self.silu_mul(self.w13(x)))
        gate, up = self.w13(x).split(self.intermediate, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    # Tensor parallel: sums the ranks' partial outputs of the row-parallel linears, in place.
    all_reduce: Callable[[torch.Tensor], None] | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, h, residual, cos, sin, kv_cache, meta):
        """h: the previous block's output, residual: the stream before it (None at the first
        block, where h is the embeddings). Returns this block's output and the stream before it:
        the same sums as ``h = x + attn(norm(x)); h + ffn(norm(h))``, fusable with the norms."""
        if residual is None:
            x, residual = self.attention_norm(h), h
        else:
            x, residual = self.attention_norm(h, residual)
        x = self.attention(x, cos, sin, kv_cache, meta)
        if self.all_reduce is not None:
            self.all_reduce(x)
        x, residual = self.ffn_norm(x, residual)
        x = self.feed_forward(x)
        if self.all_reduce is not None:
            self.all_reduce(x)
        return x, residual


class Transformer(nn.Module):
    """Build it on the meta device (no memory), then place its weights and backend with
    ``conveyor.model.backend.apply_backend``."""

    def __init__(self, config: ModelConfig, head_rows: int | None = None) -> None:
        """head_rows: the output matrix's rows where not the vocabulary (a tensor-parallel
        rank's share of it)."""
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, _weight=torch.empty(
            config.vocab_size, config.hidden_size))  # (given: no random init)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
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

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embedding_rows is not None:
            return self.embedding_rows(self.embedding_blocks, input_ids)
        return self.tok_embeddings(input_ids)

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids: [T]; cos/sin: [T, 1, head_dim] for each token's position. Returns [T, D]."""
        h, residual = self.embed(input_ids), None
        if (self.decode_stack is not None and not meta.prefills
                and len(input_ids) <= self.decode_stack.max_rows):
            residual = torch.empty_like(h)
            (group,) = meta.decodes
            self.decode_stack(h, residual, cos, sin, meta.slot_mapping, group.block_tables,
                              group.context_lens)
            return self.norm(h, residual)[0]
        for layer, kv_cache in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, cos, sin, kv_cache, meta)
        return self.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_kernel is not None:
            return self.head_kernel(hidden, self.head_blocks).float()
        if self.output is not None:
            return self.output(hidden).float()
        if self.packed_head is not None:
            return torch.ops.mkldnn._linear_pointwise(hidden, self.packed_head, None, "none", [],
                                                      "").float()
        return F.linear(hidden, self.tok_embeddings.weight).float()
