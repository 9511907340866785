"""Model hyper-parameters, independent of the checkpoint format they came from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

# Fields each supported rope scaling type needs, spelled as in Hugging Face configs.
_ROPE_SCALING_FIELDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
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
    rope_scaling: dict[str, Any] | None  # None, or {"rope_type": "llama3" | "linear", <its fields>}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections have a bias (qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before rope (qwen3)
    torch_dtype: str | None  # checkpoint dtype name from config.json; None for GGUF

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config.json dict (transformers 4 or 5 style)."""
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
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
        )


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from old-style `rope_theta`/`rope_scaling` or transformers-5 `rope_parameters`."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    scaling = dict(cfg.get("rope_scaling") or params)
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    scaling.pop("rope_theta", None)
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return theta, None
    if rope_type not in _ROPE_SCALING_FIELDS:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r} (supported: default, {', '.join(_ROPE_SCALING_FIELDS)})"
        )
    missing = [f for f in _ROPE_SCALING_FIELDS[rope_type] if scaling.get(f) is None]
    if missing:
        raise ValueError(f"rope scaling {rope_type!r} is missing {', '.join(missing)}")
    return theta, scaling
