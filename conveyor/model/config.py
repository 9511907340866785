"""Model hyper-parameters, independent of the checkpoint format they came from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# phi3: the Llama network with q/k/v and gate/up stored fused (Phi-3, Phi-3.5, Phi-4-mini)
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3")

# config.json keys that say nothing about the network's output: names, token ids (the
# tokenizer's and generation's), training and runtime switches, transformers' bookkeeping.
# Accepted and not read. Every other key is read below or refused (``_refuse_unread``).
METADATA_KEYS = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "auto_map",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "tokenizer_class", "prefix", "id2label", "label2id", "problem_type", "task_specific_params",
    "finetuning_task", "initializer_range", "attention_dropout", "hidden_dropout",
    "resid_pdrop", "embd_pdrop",
    "dropout", "use_cache", "return_dict", "output_attentions", "output_hidden_states",
    "torchscript", "use_bfloat16", "tf_legacy_loss", "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "cross_attention_hidden_size", "pruned_heads", "_attn_implementation_autoset",
    "pretraining_tp",  # (transformers splits the matmuls in as many parts: the same sums)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate",
    "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
})
# Keys Conveyor runs at one value only (the network's without them): refused at any other.
_NEUTRAL = {"hidden_act": ("silu", "swish"), "mlp_bias": (False,),
            "partial_rotary_factor": (1.0,), "attn_logit_softcapping": (None,),
            "final_logit_softcapping": (None,), "use_mrope": (False,),
            "quantization_config": (None,)}
# Keys ``from_hf_config`` reads.
_READ_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "max_position_embeddings", "tie_word_embeddings",
    "attention_bias", "torch_dtype", "dtype", "sliding_window", "use_sliding_window",
    "max_window_layers", "layer_types", "original_max_position_embeddings"})

# Fields each supported rope scaling type needs, spelled as in Hugging Face configs.
_ROPE_SCALING_FIELDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    # (beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor, truncate: optional)
    "yarn": ("factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None, or {"rope_type": "llama3" | "linear" | "yarn", ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections have a bias (qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before rope (qwen3)
    torch_dtype: str | None  # checkpoint dtype name from config.json; None for GGUF
    # tokens a sliding-window layer attends to (itself and the window - 1 before it), where
    # some layer has one: sequences no longer than it are exact, longer ones are refused
    sliding_window: int | None = None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config.json dict (transformers 4 or 5 style)."""
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        _refuse_unread(cfg, arch)
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim")
        rope_theta, rope_scaling = _parse_rope(cfg)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim if head_dim is not None else cfg["hidden_size"] // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            sliding_window=_sliding_window(cfg, arch),
        )


def _refuse_unread(cfg: dict[str, Any], arch: str) -> None:
    """A key that is not metadata, not read, or not at the value Conveyor runs is refused with
    its name and value: a network Conveyor does not compute is never served as if it were."""
    for key, value in cfg.items():
        if key in METADATA_KEYS or key in _READ_KEYS:
            continue
        if key in _NEUTRAL:
            if value in _NEUTRAL[key]:
                continue
            raise ValueError(f"config.json {key} = {value!r:.80} is not implemented for {arch} "
                             f"(only {' or '.join(map(repr, _NEUTRAL[key]))})")
        raise ValueError(f"config.json key {key!r} (= {value!r:.80}) is not implemented for "
                         f"{arch}: it may change the network's output")


def _sliding_window(cfg: dict[str, Any], arch: str) -> int | None:
    """The window of the layers that have one, as transformers decides which do: the
    ``layer_types`` it writes, else Qwen2/3's ``use_sliding_window`` from ``max_window_layers``
    on, else Mistral's window on every layer."""
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"config.json layer_types {sorted(unknown)} are not implemented")
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if layer_types is not None:
        windowed = "sliding_attention" in layer_types
    elif arch in ("qwen2", "qwen3"):
        windowed = bool(cfg.get("use_sliding_window")) and (
            cfg.get("max_window_layers", 0) < cfg["num_hidden_layers"])
    else:
        windowed = True
    return int(window) if windowed else None


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from old-style `rope_theta`/`rope_scaling` or transformers-5 `rope_parameters`."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    partial = params.pop("partial_rotary_factor", 1.0)
    if partial not in (1.0, None):  # (transformers 5 moves it here from the config's top)
        raise ValueError(f"config.json partial_rotary_factor = {partial!r} is not implemented "
                         f"(only 1.0)")
    scaling = dict(cfg.get("rope_scaling") or params)
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    scaling.pop("rope_theta", None)
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn") and cfg.get("original_max_position_embeddings"):
        # (Phi-3 keeps the pretrained length at the top, and transformers prefers it there)
        scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    if rope_type == "yarn":  # the pretrained length, as transformers defaults it
        scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    if rope_type not in _ROPE_SCALING_FIELDS:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r} (supported: default, {', '.join(_ROPE_SCALING_FIELDS)})"
        )
    missing = [f for f in _ROPE_SCALING_FIELDS[rope_type] if scaling.get(f) is None]
    if missing:
        raise ValueError(f"rope scaling {rope_type!r} is missing {', '.join(missing)}")
    return theta, scaling
