"""Tiny random Hugging Face checkpoints and GGUF files for tests, plus an independent HF -> conveyor
weight renaming."""

from __future__ import annotations

import copy
import functools
import math
import os
import re
import zlib
from typing import Any

import gguf
import numpy as np
import torch
import transformers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from conveyor.model.gguf_tokenizer import load_gguf_tokenizer
from conveyor.model.loader import default_model_path

# Sizes small enough to build in well under a second; vocab matches SmolLM2 so its tokenizer fits.
_BASE_CONFIG: dict[str, Any] = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    initializer_range=0.2,  # large enough that greedy decoding is not a flat distribution
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {"head_dim": 32},  # deliberately != hidden_size / num_heads
    "phi3": {"pad_token_id": 0},  # (q/k/v and gate/up stored fused)
    # a head of 16 (Gemma's default is 256) scored at 24 ** -0.5; soft caps low enough to bite
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0,
               "final_logit_softcapping": 10.0, "sliding_window": 4096},
    "gemma3": {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 4096,
               "layer_types": ["sliding_attention", "full_attention"]},
    "smollm3": {"num_hidden_layers": 4, "pad_token_id": None},  # (its fourth without rope)
    # 8 experts, 2 a token; Qwen's of their own width, Qwen2-MoE's shared expert wider
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 96},
    "qwen2_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 96},
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "norm_topk_prob": True, "head_dim": 32},
    "olmoe": {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 96},
}
_CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "phi3": transformers.Phi3Config,
    "gemma2": transformers.Gemma2Config,
    "gemma3": transformers.Gemma3TextConfig,
    "smollm3": transformers.SmolLM3Config,
    "mixtral": transformers.MixtralConfig,
    "qwen2_moe": transformers.Qwen2MoeConfig,
    "qwen3_moe": transformers.Qwen3MoeConfig,
    "olmoe": transformers.OlmoeConfig,
}

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}

_RENAMES = [
    ("model.embed_tokens.", "tok_embeddings."),
    ("model.norm.", "norm."),
    ("lm_head.", "output."),
    ("model.layers.", "layers."),
    ("input_layernorm.", "attention_norm."),
    ("post_attention_layernorm.", "ffn_norm."),
    ("self_attn.q_proj.", "attention.wq."),
    ("self_attn.k_proj.", "attention.wk."),
    ("self_attn.v_proj.", "attention.wv."),
    ("self_attn.o_proj.", "attention.wo."),
    ("self_attn.q_norm.", "attention.q_norm."),
    ("self_attn.k_norm.", "attention.k_norm."),
    ("mlp.gate_proj.", "feed_forward.w1."),
    ("mlp.up_proj.", "feed_forward.w3."),
    ("mlp.down_proj.", "feed_forward.w2."),
]


def hf_to_conveyor_name(hf_name: str) -> str:
    for old, new in _RENAMES:
        hf_name = hf_name.replace(old, new)
    return hf_name


def conveyor_state_dict(model: torch.nn.Module, tied: bool) -> dict[str, torch.Tensor]:
    """A transformers model's weights under conveyor names (output.weight dropped when tied)."""
    sd = {hf_to_conveyor_name(k): v for k, v in model.state_dict().items()}
    if tied:
        sd.pop("output.weight", None)
    return sd


@functools.cache
def smollm2_tokenizer() -> transformers.PreTrainedTokenizerBase:
    return load_gguf_tokenizer(default_model_path())


def make_tiny_model(arch: str, **overrides: Any) -> transformers.PreTrainedModel:
    """A seeded random float32 transformers model; 1-D params are perturbed so norms/biases are not trivial."""
    # Deep copy: transformers config classes write into the rope dicts they are given.
    kwargs = copy.deepcopy({**_BASE_CONFIG, **_ARCH_DEFAULTS[arch], **overrides})
    config = _CONFIG_CLASSES[arch](**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # RMSNorm weights start at 1 and biases at 0, which would hide naming mix-ups
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def make_tiny_checkpoint(folder: str | os.PathLike[str], arch: str, *,
                         dtype: torch.dtype = torch.float32,
                         tokenizer: transformers.PreTrainedTokenizerBase | None = None,
                         **overrides: Any) -> str:
    """Write a tiny HF checkpoint (safetensors, config, SmolLM2 tokenizer) into folder and return its path.

    arch is one of _CONFIG_CLASSES' keys; dtype the tensors' (float32, or rounded to
    bfloat16 or float16); tokenizer, where given, replaces SmolLM2's read from the default
    model's GGUF (a machine without that file); overrides are transformers config kwargs (e.g.
    tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE_SCALING).
    """
    folder = os.fspath(folder)
    make_tiny_model(arch, **overrides).to(dtype).save_pretrained(folder)
    (tokenizer or smollm2_tokenizer()).save_pretrained(folder)
    return folder


_HF_TO_GGUF = [
    ("model.embed_tokens.", "token_embd."),
    ("model.norm.", "output_norm."),
    ("lm_head.", "output."),
    ("model.layers.", "blk."),
    ("input_layernorm.", "attn_norm."),
    ("post_attention_layernorm.", "ffn_norm."),
    ("self_attn.q_proj.", "attn_q."),
    ("self_attn.k_proj.", "attn_k."),
    ("self_attn.v_proj.", "attn_v."),
    ("self_attn.o_proj.", "attn_output."),
    ("self_attn.q_norm.", "attn_q_norm."),
    ("self_attn.k_norm.", "attn_k_norm."),
    ("mlp.gate_proj.", "ffn_gate."),
    ("mlp.up_proj.", "ffn_up."),
    ("mlp.down_proj.", "ffn_down."),
]

# A byte-level BPE small enough that transformers converts it from GGUF metadata in well under a
# second (SmolLM2's 49152 tokens take seconds): the 256 bytes, a few merges, one end token.
_TINY_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "r e", "Ġ c", "a t", "Ġ i",
                "i s", "Ġ o", "o f"]
_TINY_EOS = "<|endoftext|>"
TINY_VOCAB = [*bytes_to_unicode().values(), *(m.replace(" ", "") for m in _TINY_MERGES), _TINY_EOS]


def _llama_cpp_permute(w: np.ndarray, n_head: int, back: bool = False) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama q/k rows (back: undone)."""
    half = w.shape[0] // n_head // 2
    rows = w.reshape(n_head, half, 2, *w.shape[1:]) if back else w.reshape(
        n_head, 2, half, *w.shape[1:])
    return rows.swapaxes(1, 2).reshape(w.shape)


Q = gguf.GGMLQuantizationType
# Experts as a llama.cpp K-quant mix stores them: gate in Q4_K, up in Q8_0, down in Q6_K
EXPERT_MIX = {"ffn_gate_exps": Q.Q4_K, "ffn_up_exps": Q.Q8_0, "ffn_down_exps": Q.Q6_K}
# The largest |sc * q| a K-quant block multiplies d by: what sizes d for a weight range.
K_QUANT_RANGE = {Q.Q4_K: 63 * 15, Q.Q5_K: 63 * 31, Q.Q6_K: 128 * 32}


def random_k_quant_blocks(qtype: gguf.GGMLQuantizationType, scale: np.ndarray, k: int,
                          rng: np.random.Generator) -> np.ndarray:
    """[rows, row bytes] of random K-quant blocks (gguf-py quantizes to no K-quant): random
    bytes, valid blocks once their fp16 scales are finite, with row i's weights within about
    +-scale[i]: d so that d * sc * q reaches it, dmin (Q4_K, Q5_K) half as far."""
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = len(scale)
    blocks = rng.integers(0, 256, (rows, k // values, size), dtype=np.uint8)
    at, count = (208, 1) if qtype == Q.Q6_K else (0, 2)
    d = scale.reshape(rows, 1, 1) * rng.uniform(0.25, 1.0, (rows, k // values, count))
    d[..., 0] /= K_QUANT_RANGE[qtype]
    if count == 2:
        d[..., 1] /= 2 * 63
    blocks[..., at:at + 2 * count] = d.astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


# What llama.cpp's converter names differently for some families.
_HF_TO_GGUF_BY_ARCH = {
    "gemma2": [("post_attention_layernorm.", "post_attention_norm."),
               ("pre_feedforward_layernorm.", "ffn_norm."),
               ("post_feedforward_layernorm.", "post_ffw_norm.")],
    "phi3": [("self_attn.qkv_proj.", "attn_qkv."), ("mlp.gate_up_proj.", "ffn_up.")],
}
_HF_TO_GGUF_BY_ARCH["gemma3"] = _HF_TO_GGUF_BY_ARCH["gemma2"]
# The mixtures of experts' router and shared expert; their experts' matrices (transformers holds
# them as 3-D gate_up_proj and down_proj) go into one 3-D tensor a kind (_HF_EXPERTS)
_HF_TO_GGUF_MOE = [("mlp.gate.", "ffn_gate_inp."),
                   ("mlp.shared_expert.gate_proj.", "ffn_gate_shexp."),
                   ("mlp.shared_expert.up_proj.", "ffn_up_shexp."),
                   ("mlp.shared_expert.down_proj.", "ffn_down_shexp."),
                   ("mlp.shared_expert_gate.", "ffn_gate_inp_shexp.")]
_HF_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_GGUF_EXPERTS = {"gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"),
                 "down_proj": ("ffn_down_exps",)}
_GGUF_ARCH = {"gemma3_text": "gemma3", "mixtral": "llama", "qwen2_moe": "qwen2moe",
              "qwen3_moe": "qwen3moe"}


def write_gguf(path: str, model: transformers.PreTrainedModel, *,
               types: dict[str, gguf.GGMLQuantizationType] | None = None,
               tokenizer: bool = False, metadata: dict[str, int | float] | None = None,
               sync: bool = False) -> str:
    """A GGUF of a tiny transformers model, laid out as llama.cpp's converter would; returns path.

    types: ggml type by GGUF tensor kind (``"attn_q"``, ``"token_embd"``...) for 2-D weights,
    F32 otherwise. A K-quant tensor is random blocks (``random_k_quant_blocks``) of the
    weight's range: the file's weights, not the model's. sync: the model's weights set to
    what the file holds (its blocks dequantized), so that the model is the file's reference.
    tokenizer: add TINY_VOCAB as a byte-level BPE (the model's vocab_size must be
    len(TINY_VOCAB)), so that ``load_model`` can load the file. metadata: more ``{arch}.*``
    keys (without the prefix), as uint32 or float32. Gemma's norms are stored as 1 + w, as the
    converter stores them.
    """
    c = model.config
    arch = _GGUF_ARCH.get(c.model_type, c.model_type)
    writer = gguf.GGUFWriter(path, arch)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:  # as llama.cpp's converter writes them
        writer.add_expert_count(experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        if getattr(c, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        if getattr(c, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    # Qwen2Config has no head_dim: the loader falls back to hidden / heads
    if getattr(c, "head_dim", None) is not None:
        writer.add_key_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)  # (Gemma 3's: per type)
    writer.add_rope_freq_base(rope["rope_theta"])
    if getattr(c, "sliding_window", None) is not None and arch in ("gemma2", "gemma3", "phi3"):
        writer.add_sliding_window(c.sliding_window)
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(c, cap, None) is not None:
            writer.add_float32(f"{arch}.{cap}", getattr(c, cap))
    rotary = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    rotary = int(rotary * rope.get("partial_rotary_factor", 1.0))
    if arch == "phi3" and rotary != c.hidden_size // c.num_attention_heads:
        writer.add_rope_dimension_count(rotary)
    if rope.get("rope_type") == "longrope":  # as the converter writes Phi-3's LongRoPE
        original = c.original_max_position_embeddings
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = c.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight",
                              np.array(rope[f"{kind}_factor"], dtype=np.float32))
    for key, value in (metadata or {}).items():
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(
            f"{arch}.{key}", value)
    if tokenizer:
        assert c.vocab_size == len(TINY_VOCAB), "make the model with vocab_size=len(TINY_VOCAB)"
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")  # (as the converter names it, for GPT-2's splits)
        writer.add_token_list(TINY_VOCAB)
        writer.add_token_types([1] * (len(TINY_VOCAB) - 1) + [3])  # 3: control
        writer.add_token_merges(_TINY_MERGES)
        writer.add_eos_token_id(len(TINY_VOCAB) - 1)

    def stored(name: str, w: np.ndarray, kind: str | None = None
               ) -> tuple[np.ndarray, np.ndarray, Any]:
        """A tensor as the file stores it, the weights that holds and its block type (None:
        F32): a matrix in its kind's type (types'; the kind read from the name unless given),
        the rest F32."""
        kind = kind or name.split(".")[-2]
        qtype = (types or {}).get(kind, gguf.GGMLQuantizationType.F32)
        if w.ndim != 2 or qtype == gguf.GGMLQuantizationType.F32:
            return np.ascontiguousarray(w), w, None
        if qtype in K_QUANT_RANGE:
            rng = np.random.default_rng(zlib.crc32(name.encode()))
            blocks = random_k_quant_blocks(qtype, np.abs(w).max(axis=1), w.shape[1], rng)
        else:
            blocks = gguf.quants.quantize(w, qtype)
        return blocks, gguf.quants.dequantize(blocks, qtype).reshape(w.shape), qtype

    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w = tensor.numpy()
        if (m := _HF_EXPERTS.fullmatch(hf_name)) is not None:  # [experts, rows, values]
            kinds = _GGUF_EXPERTS[m.group(2)]
            for kind, part in zip(kinds, tensor.chunk(len(kinds), dim=1)):  # (gate, up)
                name = f"blk.{m.group(1)}.{kind}.weight"
                each = [stored(f"{name}.{e}", rows.numpy(), kind)
                        for e, rows in enumerate(part)]
                writer.add_tensor(name, np.stack([data for data, _, _ in each]),
                                  raw_dtype=each[0][2])
                if sync:
                    part.copy_(torch.from_numpy(np.stack([held for _, held, _ in each])))
            continue
        permuted = arch == "llama" and ("q_proj" in hf_name or "k_proj" in hf_name)
        heads = c.num_attention_heads if "q_proj" in hf_name else c.num_key_value_heads
        if permuted:
            w = _llama_cpp_permute(w, heads)
        name = hf_name
        for old, new in _HF_TO_GGUF_BY_ARCH.get(arch, []) + _HF_TO_GGUF_MOE + _HF_TO_GGUF:
            name = name.replace(old, new)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1
        data, held, qtype = stored(name, w)
        writer.add_tensor(name, data, raw_dtype=qtype)
        if sync and qtype is not None:  # the model takes the file's weights
            if permuted:
                held = _llama_cpp_permute(held, heads, back=True)
            tensor.copy_(torch.from_numpy(np.ascontiguousarray(held)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
