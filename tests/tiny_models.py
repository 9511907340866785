"""Tiny random Hugging Face checkpoints for tests, plus an independent HF -> conveyor weight renaming."""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

import torch
import transformers

from conveyor.model.gguf_file import load_gguf_tokenizer
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
}
_CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
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


def make_tiny_checkpoint(folder: str | os.PathLike[str], arch: str, **overrides: Any) -> str:
    """Write a tiny HF checkpoint (safetensors, config, SmolLM2 tokenizer) into folder and return its path.

    arch is llama, mistral, qwen2 or qwen3; overrides are transformers config kwargs
    (e.g. tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE_SCALING).
    """
    folder = os.fspath(folder)
    make_tiny_model(arch, **overrides).save_pretrained(folder)
    smollm2_tokenizer().save_pretrained(folder)
    return folder
