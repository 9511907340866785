"""Nothing silently wrong: every config.json key is metadata, read, or refused at load with its
name."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conveyor.llm import LLM
from conveyor.model.config import GEMMA, MOE_ARCHITECTURES, ModelConfig
from conveyor.model.gguf_config import gguf_config
from conveyor.model.gguf_file import read_gguf
from conveyor.model.rope import longrope_switch, rope_attention_factor, rope_inv_freq

from tiny_models import _CONFIG_CLASSES, make_tiny_checkpoint, make_tiny_model, write_gguf

# One output-changing key each family's config could carry, at a value Conveyor does not run.
UNIMPLEMENTED = [
    ("hidden_act", "gelu"),
    ("mlp_bias", True),
    ("partial_rotary_factor", 0.5),
    ("attn_logit_softcapping", 50.0),
    ("final_logit_softcapping", 30.0),
    ("quantization_config", {"quant_method": "awq", "bits": 4}),
    ("num_local_experts", 8),  # (experts, in a family without them)
    ("layer_types", ["full_attention", "chunked_attention"]),
    ("decoder_sparse_step", 2),  # (dense layers between the sparse ones)
    ("clip_qkv", 8.0),
    ("shared_expert_intermediate_size", 64),  # (only Qwen2-MoE's experts have one)
]


def hf_config(arch: str, **overrides) -> dict:
    """What transformers writes for this family (every key of its config class)."""
    return {**_CONFIG_CLASSES[arch](num_hidden_layers=2).to_dict(), **overrides}


@pytest.mark.parametrize("arch", sorted(_CONFIG_CLASSES))
def test_what_transformers_writes_is_accepted(arch):
    assert ModelConfig.from_hf_config(hf_config(arch)).architecture == arch


# (Gemma's networks soft-cap: for them these keys are read)
# (and Phi-3's rotates part of a head)
REFUSALS = [pytest.param(arch, key, value, id=f"{arch}-{key}")
            for arch in sorted(_CONFIG_CLASSES) for key, value in UNIMPLEMENTED
            if not (arch in GEMMA and key.endswith("_softcapping")
                    or arch == "phi3" and key == "partial_rotary_factor"
                    or arch in MOE_ARCHITECTURES and key == "num_local_experts"
                    or arch == "qwen2_moe" and key == "shared_expert_intermediate_size")]


@pytest.mark.parametrize("arch,key,value", REFUSALS)
def test_an_unimplemented_key_is_refused_by_name(arch, key, value):
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf_config(hf_config(arch, **{key: value}))


@pytest.mark.parametrize("arch,rotary", [("phi3", 24), ("llama", None)])
def test_a_partial_rotary_factor_in_the_rope_parameters_is_read_where_the_family_has_it(
        arch, rotary):
    """(transformers 5 moves the factor into rope_parameters)"""
    config = hf_config(arch, hidden_size=128, num_attention_heads=4)
    config["rope_parameters"] = dict(config["rope_parameters"], partial_rotary_factor=0.75)
    if rotary is None:
        with pytest.raises(ValueError, match="partial_rotary_factor = 0.75"):
            ModelConfig.from_hf_config(config)
    else:
        assert ModelConfig.from_hf_config(config).rotary == rotary


def test_longrope_switches_where_a_served_sequence_may_pass_the_pretrained_length():
    """Its short and long factors (the switch: rope.longrope_switch), and transformers'
    attention factor."""
    config = ModelConfig.from_hf_config(hf_config(
        "phi3", hidden_size=64, num_attention_heads=4, max_position_embeddings=8192,
        original_max_position_embeddings=4096,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8,
                      "long_factor": [4.0] * 8}))
    base = rope_inv_freq(dataclasses.replace(config, rope_scaling=None))
    assert torch.equal(rope_inv_freq(config), base)
    assert torch.equal(rope_inv_freq(config, long=True), base / 4)
    assert (longrope_switch(config, 4096), longrope_switch(config, 4097)) == (None, 4096)
    assert rope_attention_factor(config) == pytest.approx(math.sqrt(1 + math.log(2) / math.log(4096)))
    with pytest.raises(ValueError, match="short_factor has 3 factors, not 8"):
        ModelConfig.from_hf_config(hf_config(
            "phi3", hidden_size=64, num_attention_heads=4, original_max_position_embeddings=4096,
            rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 3,
                          "long_factor": [4.0] * 8}))


@pytest.mark.parametrize("arch,overrides,window", [
    ("mistral", {"sliding_window": 24}, 24),
    ("mistral", {"sliding_window": None}, None),
    ("qwen2", {"sliding_window": 24, "use_sliding_window": False}, None),
    ("qwen2", {"sliding_window": 24, "use_sliding_window": True, "max_window_layers": 1}, 24),
    ("qwen2", {"sliding_window": 24, "use_sliding_window": True, "max_window_layers": 2}, None),
    ("qwen3", {"sliding_window": 24, "layer_types": ["full_attention", "sliding_attention"]}, 24),
    ("llama", {}, None),
    ("phi3", {"sliding_window": 24}, 24),
])
def test_which_configs_have_a_sliding_window(arch, overrides, window):
    config = {k: v for k, v in hf_config(arch, **overrides).items()
              if k != "layer_types" or "layer_types" in overrides}
    assert ModelConfig.from_hf_config(config).sliding_window == window


def test_a_sliding_window_keeps_the_model_length(tmp_path):
    """The window is attended to as the model does (tests/e2e/test_equivalence.py), so a model
    length past it is the model's own."""
    folder = make_tiny_checkpoint(tmp_path / "swa", "mistral", sliding_window=24)
    llm = LLM(folder, dtype="float32", num_kv_blocks=16, max_num_seqs=2, max_model_len=64)
    assert llm.engine.max_model_len == 64
    assert [layer.attention.scores.window for layer in llm.engine.runner.model.layers] == [24, 24]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"])
def test_gguf_metadata_is_read_or_refused(arch, tmp_path):
    model = make_tiny_model(arch)
    head_dim = getattr(model.config, "head_dim", None) or (
        model.config.hidden_size // model.config.num_attention_heads)
    plain = write_gguf(str(tmp_path / "plain.gguf"), model,
                       metadata={"rope.dimension_count": head_dim})
    config = gguf_config(read_gguf(plain))
    assert config.head_dim == head_dim
    refused = [("expert_count", 8)]
    partial = write_gguf(str(tmp_path / "partial.gguf"), model,
                         metadata={"rope.dimension_count": head_dim // 2})
    if arch == "phi3":  # Phi-4-mini rotates part of each head
        assert gguf_config(read_gguf(partial)).rotary == head_dim // 2
    else:
        refused.append(("rope.dimension_count", head_dim // 2))
    if arch in GEMMA:  # read: the window, Gemma 2's soft caps (tiny_models writes them)
        assert config.sliding_window == model.config.sliding_window
        assert config.attn_softcap == getattr(model.config, "attn_logit_softcapping", None)
    if arch in ("llama", "qwen2", "qwen3"):  # llama.cpp follows no window for these: refused
        # rather than followed
        refused.append(("attention.sliding_window", 24))
    for key, value in refused:
        path = write_gguf(str(tmp_path / f"{key}.gguf"), model, metadata={key: value})
        with pytest.raises(ValueError, match=f"{arch}.{key}"):
            gguf_config(read_gguf(path))
