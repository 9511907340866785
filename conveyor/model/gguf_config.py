"""A model's hyper-parameters from a GGUF's metadata: each ``{arch}.*`` key read, fixed as
llama.cpp fixes it per architecture, or refused with its name and value."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

import gguf
import numpy as np

from conveyor.model.config import GEMMA, ModelConfig, MoE
from conveyor.model.gguf_reader import GGUFFile

_Q = gguf.GGMLQuantizationType

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "smollm3",
                               "qwen2moe", "qwen3moe", "olmoe")
# Whether llama.cpp renormalises the chosen experts' weights (a constant per architecture
# there; ``expert_weights_norm`` where a file says): Mixtral's (llama) and Qwen3-MoE's do
_NORM_TOPK = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False}
# llama.cpp's SmolLM3: no rope in every fourth layer (a constant there, not metadata)
_NO_ROPE_EVERY = {"smollm3": 4}

BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_REQUIRED = object()


def metadata_field(reader: GGUFFile, key: str, default: Any = _REQUIRED) -> Any:
    value = reader.value(key, _REQUIRED)
    if value is not _REQUIRED:
        return value
    if default is _REQUIRED:
        raise ValueError(f"GGUF file has no {key!r} metadata")
    return default


def metadata_number(reader: GGUFFile, key: str, default: Any = _REQUIRED, *,
            kind: type = int, zero: bool = False) -> Any:
    """A positive (or, with zero, non-negative) number from the metadata, or default when the
    key is absent. A corrupted file can hold a string, a list, 0 or a NaN there, which would
    fail far from the cause (a ZeroDivisionError, a TypeError)."""
    value = metadata_field(reader, key, default)
    if value is None and default is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not (value >= 0 if zero else value > 0) or kind is int and value != int(value)):
        raise ValueError(f"GGUF metadata {key!r} is {value!r:.40}, expected a "
                         f"{'non-negative' if zero else 'positive'} {kind.__name__}")
    return kind(value)


def gguf_architecture(reader: GGUFFile) -> str:
    """The llama.cpp architecture name, checked against what the engine can run."""
    arch = metadata_field(reader, "general.architecture", None)
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} "
            f"(supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})"
        )
    return arch


def gguf_config(reader: GGUFFile) -> ModelConfig:
    """ModelConfig from `{arch}.*` metadata; llama.cpp has no dtype, so torch_dtype is None.
    What llama.cpp fixes per architecture rather than storing (Gemma's window pattern, local
    rope base and scores' scale) is fixed here the same way."""
    arch = gguf_architecture(reader)
    rope_scaling = _rope_scaling(reader, arch)
    tensors = {t.name: t for t in reader.tensors}
    hidden = metadata_number(reader, f"{arch}.embedding_length")
    num_heads = metadata_number(reader, f"{arch}.attention.head_count")
    num_layers = metadata_number(reader, f"{arch}.block_count")
    head_dim = metadata_number(reader, f"{arch}.attention.key_length", hidden // num_heads)
    gemma = arch in GEMMA
    window = (metadata_number(reader, f"{arch}.attention.sliding_window", None)
              if arch in _WINDOWED else None)
    layer_types = None
    if window is not None and gemma:  # llama.cpp's patterns: every 2nd, every 6th layer full
        pattern = 2 if arch == "gemma2" else 6
        layer_types = tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                            for i in range(num_layers))
    # llama.cpp's scores' scale: head_dim ** -0.5, but hidden / heads for the 27B models
    big = num_layers == {"gemma2": 46, "gemma3": 62}.get(arch)
    rotary = head_dim
    if arch == "phi3":  # partial rotary (Phi-4-mini), LongRoPE's factors as tensors
        rotary = metadata_number(reader, f"{arch}.rope.dimension_count", head_dim)
        if "rope_factors_long.weight" in tensors:
            rope_scaling = _longrope(reader, arch, tensors, rotary)
    if ROPE_FREQS in tensors:  # llama3's scaling, as the converter writes it
        if rope_scaling is not None:
            raise ValueError(f"GGUF file has {ROPE_FREQS} and rope scaling "
                             f"{rope_scaling['rope_type']!r}: the two together are not "
                             f"implemented")
        rope_scaling = {"rope_type": "freq_factors",
                        "factors": _f32_vector(reader, tensors[ROPE_FREQS], rotary // 2)}
    vocab = metadata_number(reader, f"{arch}.vocab_size", None)
    if vocab is None:  # llama.cpp's converter often leaves it out: the embedding's rows
        embd = tensors.get("token_embd.weight")
        if embd is None or len(embd.shape) != 2:
            raise ValueError("GGUF file has no vocab_size metadata and no 2-D token_embd.weight")
        vocab = int(embd.shape[0])
    config = ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=metadata_number(reader, f"{arch}.feed_forward_length"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=metadata_number(reader, f"{arch}.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=metadata_number(reader, f"{arch}.attention.layer_norm_rms_epsilon",
                                     kind=float),
        rope_theta=metadata_number(reader, f"{arch}.rope.freq_base", 10000.0, kind=float),
        rope_scaling=rope_scaling,
        max_position_embeddings=metadata_number(reader, f"{arch}.context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        qk_norm=arch in ("qwen3", "gemma3", "qwen3moe", "olmoe"),
        qk_norm_whole=arch == "olmoe",
        torch_dtype=None,
        sliding_window=window,
        layer_types=layer_types,
        hidden_act="gelu_pytorch_tanh" if gemma else "silu",
        attention_scale=(hidden / num_heads if big else head_dim) ** -0.5 if gemma else None,
        attn_softcap=metadata_number(reader, f"{arch}.attn_logit_softcapping", None, kind=float),
        final_softcap=metadata_number(reader, f"{arch}.final_logit_softcapping", None, kind=float),
        # (the sliding layers' base: older converters leave it to llama.cpp's 10000)
        local_rope_theta=(metadata_number(reader, f"{arch}.rope.freq_base_swa", 10000.0,
                                          kind=float) if arch == "gemma3" else None),
        output_bias="blk.0.attn_output.bias" in tensors,
        rotary_dim=None if rotary == head_dim else rotary,
        pooling_type=_gguf_pooling(reader, arch),
        no_rope_layers=tuple(i for i in range(num_layers)
                             if arch in _NO_ROPE_EVERY and (i + 1) % _NO_ROPE_EVERY[arch] == 0),
        moe=_moe(reader, arch),
    )
    if not gemma and (config.attn_softcap or config.final_softcap):
        raise ValueError(f"GGUF soft-capping is not implemented for {arch}")
    _check_counts(config, tensors)
    _refuse_unread(reader, config)
    return config


def _moe(reader: GGUFFile, arch: str) -> MoE | None:
    """The experts, from ``expert_count`` on: the experts' width is ``feed_forward_length``
    where the file has no ``expert_feed_forward_length`` (Mixtral's, as llama.cpp reads it)."""
    experts = metadata_number(reader, f"{arch}.expert_count", 0, zero=True)
    if not experts:
        if arch in ("qwen2moe", "qwen3moe", "olmoe"):
            raise ValueError(f"GGUF file has no {arch}.expert_count")
        return None
    if arch not in _NORM_TOPK:
        raise ValueError(f"GGUF experts ({arch}.expert_count = {experts}) are not implemented "
                         f"for {arch}")
    norm = metadata_field(reader, f"{arch}.expert_weights_norm", _NORM_TOPK[arch])
    used = metadata_number(reader, f"{arch}.expert_used_count", None)
    if used is None or used > experts:
        raise ValueError(f"GGUF metadata {arch}.expert_count = {experts} needs "
                         f"{arch}.expert_used_count, at most that many (found {used})")
    return MoE(experts=experts, used=used,
               intermediate=metadata_number(
                   reader, f"{arch}.expert_feed_forward_length",
                   metadata_number(reader, f"{arch}.feed_forward_length")),
               norm_topk=bool(norm),
               shared_intermediate=metadata_number(
                   reader, f"{arch}.expert_shared_feed_forward_length", 0, zero=True))


# LongRoPE's factors, which llama.cpp's converter stores as tensors (F32, one per rotated pair)
ROPE_FACTORS = {"rope_factors_short.weight": "short_factor",
                 "rope_factors_long.weight": "long_factor"}
# llama3's scaling as the converter stores it: each rotated pair's divisor of its frequency
ROPE_FREQS = "rope_freqs.weight"
# The YaRN keys the converter writes and what transformers calls them
_YARN = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow",
         "yarn_attn_factor": "attention_factor"}


def _rope_scaling(reader: GGUFFile, arch: str) -> dict[str, Any] | None:
    """``{arch}.rope.scaling.*``: linear, or YaRN (its factor, pretrained length, betas and
    attention factor, as transformers reads them from the checkpoint the file came from)."""
    scaling = metadata_field(reader, f"{arch}.rope.scaling.type", None)
    if scaling in (None, "none"):
        return None
    if scaling not in ("linear", "yarn"):
        raise ValueError(f"rope scaling {scaling!r} is not supported for GGUF files")
    out = {"rope_type": scaling,
           "factor": metadata_number(reader, f"{arch}.rope.scaling.factor", kind=float)}
    if scaling == "yarn":
        out["original_max_position_embeddings"] = metadata_number(
            reader, f"{arch}.rope.scaling.original_context_length")
        for key, name in _YARN.items():
            value = metadata_number(reader, f"{arch}.rope.scaling.{key}", None, kind=float)
            if value is not None:
                out[name] = value
    return out


def _f32_vector(reader: GGUFFile, t: Any, n: int) -> list[float]:
    if t.ggml_type != _Q.F32 or tuple(t.shape) != (n,):
        raise ValueError(f"{t.name}: rope needs {n} F32 factors, one per rotated pair")
    return reader.tensor_bytes(t).view(np.float32).tolist()


def _longrope(reader: GGUFFile, arch: str, tensors: dict, rotary: int) -> dict[str, Any]:
    """Phi-3's LongRoPE from the file: the factors' tensors, the pretrained length and the
    attention factor (which llama.cpp's converter computes and stores)."""
    scaling: dict[str, Any] = {"rope_type": "longrope"}
    for name, key in ROPE_FACTORS.items():
        if name not in tensors:
            raise ValueError(f"{name}: LongRoPE needs {rotary // 2} F32 factors")
        scaling[key] = _f32_vector(reader, tensors[name], rotary // 2)
    scaling["original_max_position_embeddings"] = metadata_number(
        reader, f"{arch}.rope.scaling.original_context_length")
    scaling["attention_factor"] = metadata_number(
        reader, f"{arch}.rope.scaling.attn_factor", 1.0, kind=float)
    return scaling


# ``{arch}.*`` keys ``gguf_config`` reads; every other one must hold what the network without
# it would (``_AT``: a function of the config) or is refused. Keys outside ``{arch}.*``
# (general.*, tokenizer.*, quantize.*, split.*) are metadata.
_READ = frozenset({"context_length", "embedding_length", "block_count", "feed_forward_length",
                   "attention.head_count", "attention.head_count_kv", "attention.key_length",
                   "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.type",
                   "vocab_size", "attn_logit_softcapping", "final_logit_softcapping",
                   "pooling_type"})
_READ_BY_ARCH = {"gemma3": {"rope.freq_base_swa"}}
_READ_MOE = frozenset({"expert_count", "expert_used_count", "expert_feed_forward_length",
                       "expert_shared_feed_forward_length", "expert_weights_norm"})
# llama.cpp's enum llama_pooling_type (0: none, a vector per token, is no pooling to follow)
_GGUF_POOLING = {0: None, 1: "mean", 2: "cls", 3: "last"}


def _gguf_pooling(reader: GGUFFile, arch: str) -> str | None:
    value = metadata_number(reader, f"{arch}.pooling_type", None, zero=True)
    if value is not None and value not in _GGUF_POOLING:  # (4: a reranker's)
        raise ValueError(f"GGUF metadata {arch}.pooling_type = {value} is not implemented")
    return _GGUF_POOLING.get(value)
# The architectures whose sliding window llama.cpp applies (Llama's and Qwen's it ignores:
# there the key is refused, not followed in a way llama.cpp does not).
_WINDOWED = ("phi3", "gemma2", "gemma3")
_AT = {"rope.dimension_count": lambda c: c.head_dim, "attention.value_length": lambda c: c.head_dim,
       "expert_count": lambda c: 0, "expert_used_count": lambda c: 0}
_UNUSED_WITHOUT_SCALING = ("rope.scaling.",)  # (factors of a scaling type "none")


def _refuse_unread(reader: GGUFFile, config: ModelConfig) -> None:
    arch = config.architecture
    for key in reader.keys:
        if not key.startswith(arch + "."):
            continue
        name = key[len(arch) + 1:]
        rope_type = (config.rope_scaling or {}).get("rope_type")
        if (name in _READ or name in _READ_BY_ARCH.get(arch, ())
                or name in _READ_MOE and config.moe is not None
                or name.startswith(_UNUSED_WITHOUT_SCALING) and config.rope_scaling is None
                or name == "rope.scaling.factor"
                or name == "attention.sliding_window" and arch in _WINDOWED
                or name == "rope.dimension_count" and arch == "phi3"
                or rope_type == "longrope" and name in ("rope.scaling.original_context_length",
                                                        "rope.scaling.attn_factor")
                or rope_type == "yarn" and name in (
                    "rope.scaling.original_context_length",
                    *(f"rope.scaling.{key}" for key in _YARN))):
            continue
        value = reader.value(key)
        if name in _AT and value == _AT[name](config):
            continue
        raise ValueError(f"GGUF metadata {key} = {value!r:.80} is not implemented for {arch}: "
                         f"it may change the network's output")


def _check_counts(config: ModelConfig, tensor_names: Iterable[str]) -> None:
    """The counts the model divides by or loops over, checked against each other and the
    tensors before anything uses them: a corrupted block_count would otherwise build the
    expected tensors of millions of layers, a bad head count fail in a reshape."""
    c, arch = config, config.architecture
    if c.num_heads % c.num_kv_heads:
        raise ValueError(f"{arch}.attention.head_count {c.num_heads} is not a multiple of "
                         f"head_count_kv {c.num_kv_heads}")
    if c.head_dim % 2:
        raise ValueError(f"head_dim {c.head_dim} is odd: rope rotates pairs")
    blocks = {m.group(1) for name in tensor_names if (m := BLOCK_RE.fullmatch(name))}
    if len(blocks) != c.num_layers:
        raise ValueError(f"{arch}.block_count is {c.num_layers}, but the file has tensors "
                         f"for {len(blocks)} blocks")
