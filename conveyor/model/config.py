"""Model hyper-parameters, independent of the checkpoint format they came from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# phi3: the Llama network with q/k/v and gate/up stored fused (Phi-3, Phi-3.5, Phi-4-mini);
# gemma2, gemma3 (text; transformers' model_type gemma3_text): conveyor.model.gemma
# smollm3: the Llama network without rope in every fourth layer (``no_rope_layers``)
# mixtral, qwen2_moe, qwen3_moe, olmoe: the Llama network with a mixture of experts for its
# feed-forward (``MoE``, conveyor.model.moe)
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3",
                           "smollm3", *MOE_ARCHITECTURES)
GEMMA = ("gemma2", "gemma3")
_MODEL_TYPES = {"gemma3_text": "gemma3"}  # transformers' model_type, where it differs

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
    "cache_implementation",  # (Gemma's "hybrid": how transformers caches the windowed layers)
    "_sliding_window_pattern", "sliding_window_pattern",  # (spelled out by layer_types)
    # the experts' training losses and noise (a router's output at inference is without them)
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
})
# Keys Conveyor runs at one value only (the network's without them): refused at any other.
_NEUTRAL = {"mlp_bias": (False,), "use_mrope": (False,),
            "quantization_config": (None,), "use_bidirectional_attention": (False, None),
            # every layer sparse (the families' published models): no dense layers between
            "decoder_sparse_step": (1,), "mlp_only_layers": ([],), "clip_qkv": (None,)}
# The feed-forward's activations: silu (SwiGLU) and Gemma's tanh-approximated gelu (GeGLU).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Keys ``from_hf_config`` reads.
_READ_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "max_position_embeddings", "tie_word_embeddings",
    "attention_bias", "torch_dtype", "dtype", "sliding_window", "use_sliding_window",
    "max_window_layers", "layer_types", "original_max_position_embeddings", "hidden_act",
    "hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping",
    "final_logit_softcapping", "rope_local_base_freq", "partial_rotary_factor",
    "no_rope_layers", "no_rope_layer_interval",
    "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "norm_topk_prob", "qkv_bias"})

# Fields each supported rope scaling type needs, spelled as in Hugging Face configs.
_ROPE_SCALING_FIELDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    # (beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor, truncate: optional)
    "yarn": ("factor", "original_max_position_embeddings"),
    # (factor, attention_factor: optional)
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}
# Architectures whose transformers network rotates only part of each head when its config
# says so (partial_rotary_factor): refused elsewhere.
_PARTIAL_ROTARY = ("phi3",)
# Architectures whose q/k/v have biases and whose output projection has none
QKV_BIAS = ("qwen2", "qwen2_moe")


@dataclass(frozen=True)
class MoE:
    """A mixture-of-experts feed-forward (every layer's): a float32 router's softmax picks each
    token's ``used`` experts, whose SwiGLU outputs are summed weighted by those probabilities."""

    experts: int
    used: int  # the experts a token runs (top-k)
    intermediate: int  # each expert's features
    norm_topk: bool  # the chosen experts' weights renormalised to sum to 1
    # Qwen2-MoE's shared expert's features (0: none): every token runs it, its output scaled
    # by sigmoid(x . w) (``feed_forward.shared_gate``)
    shared_intermediate: int = 0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None, or {"rope_type": "llama3" | "linear" | "yarn" | "longrope" | "freq_factors", ...}
    # (freq_factors: each rotated pair's divisor of its frequency, as a GGUF's rope_freqs holds
    # llama3's)
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections have a bias (qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before rope (qwen3)
    torch_dtype: str | None  # checkpoint dtype name from config.json; None for GGUF
    # tokens a sliding-window layer attends to (itself and the window - 1 before it), where
    # some layer has one; which layers do: layer_types ("sliding_attention" or
    # "full_attention" each), or every layer where that is None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    hidden_act: str = "silu"  # the feed-forward's gate activation (ACTIVATIONS)
    attention_scale: float | None = None  # the scores' scale where not head_dim ** -0.5
    attn_softcap: float | None = None  # scores become cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # the logits likewise
    local_rope_theta: float | None = None  # the sliding layers' own rope base (Gemma 3)
    output_bias: bool = False  # the attention's output projection has a bias
    rotary_dim: int | None = None  # the head's first dimensions rope rotates, if not all
    # embeddings: how the model pools a prompt's last hidden states (a POOLING_TYPES one:
    # a sentence-transformers folder's, a GGUF's pooling_type), None where it does not say
    pooling_type: str | None = None
    no_rope_layers: tuple[int, ...] = ()  # the layers whose q and k rope leaves as they are
    moe: MoE | None = None  # the feed-forward's experts, where it has them
    # OLMoE's q/k norms: over the whole projection (all heads at once), not each head
    qk_norm_whole: bool = False

    @property
    def rotary(self) -> int:
        """The dimensions of each head rope rotates."""
        return self.rotary_dim or self.head_dim

    def window(self, layer: int) -> int | None:
        """The sliding window of this layer, or None where it attends to everything."""
        if self.sliding_window is None or (self.layer_types is not None and
                                           self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window

    def fused_rows(self, parts: int) -> list[int]:
        """The rows of each part of a fused q/k/v (3 parts) or gate/up (2) matrix."""
        if parts == 3:
            return [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        return [self.intermediate_size] * 2

    def rope_index(self, layer: int) -> int:
        """Which rope table the layer reads (``rope.model_rope_tables``): 0 the model's, then
        the sliding layers' own where they have one, then none where a layer has no rope."""
        local = self.local_rope_theta is not None
        if layer in self.no_rope_layers:
            return 1 + local
        return int(local and self.window(layer) is not None)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config.json dict (transformers 4 or 5 style)."""
        arch = _MODEL_TYPES.get(cfg.get("model_type"), cfg.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        _refuse_unread(cfg, arch)
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim")
        rope_theta, rope_scaling, local_theta, partial = _parse_rope(cfg, arch)
        window, layer_types = _sliding_window(cfg, arch)
        gemma = arch in GEMMA
        head_dim = head_dim if head_dim is not None else cfg["hidden_size"] // num_heads
        rotary = int(head_dim * partial)
        if rope_scaling is not None and rope_scaling["rope_type"] == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(rope_scaling[key]) != rotary // 2:
                    raise ValueError(f"rope scaling longrope {key} has {len(rope_scaling[key])} "
                                     f"factors, not {rotary // 2}")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rotary_dim=None if rotary == head_dim else rotary,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=(arch == "qwen2" or arch == "qwen2_moe" and cfg.get("qkv_bias", True)
                            or bool(cfg.get("attention_bias", False))),
            # (Qwen2's q/k/v have biases, its output none; elsewhere all four have or none)
            output_bias=arch not in QKV_BIAS and bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "gemma3", "qwen3_moe", "olmoe"),
            qk_norm_whole=arch == "olmoe",
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            sliding_window=window,
            layer_types=layer_types,
            hidden_act=_activation(cfg, arch),
            attention_scale=(float(cfg.get("query_pre_attn_scalar") or 256) ** -0.5 if gemma
                             else None),
            attn_softcap=_cap(cfg, "attn_logit_softcapping", arch),
            final_softcap=_cap(cfg, "final_logit_softcapping", arch),
            local_rope_theta=local_theta,
            no_rope_layers=_no_rope_layers(cfg, arch),
            moe=_moe(cfg, arch),
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


def _moe(cfg: dict[str, Any], arch: str) -> MoE | None:
    """The experts as transformers builds them: Mixtral's renormalise the chosen experts'
    weights always, the others where ``norm_topk_prob`` says; Mixtral's and OLMoE's experts
    have ``intermediate_size`` features, Qwen's ``moe_intermediate_size``."""
    if cfg.get("qkv_bias") is not None and arch != "qwen2_moe":  # (Qwen2-MoE's q/k/v biases)
        raise ValueError(f"config.json qkv_bias is not implemented for {arch}")
    if arch not in MOE_ARCHITECTURES:
        keys = sorted(k for k in ("num_local_experts", "num_experts", "num_experts_per_tok",
                                  "moe_intermediate_size", "shared_expert_intermediate_size",
                                  "norm_topk_prob") if cfg.get(k) is not None)
        if keys:
            raise ValueError(f"config.json {', '.join(keys)}: experts are not implemented "
                             f"for {arch}")
        return None
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not experts or not cfg.get("num_experts_per_tok"):
        raise ValueError(f"config.json of {arch} needs num_experts (or num_local_experts) and "
                         f"num_experts_per_tok")
    qwen = arch in ("qwen2_moe", "qwen3_moe")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if shared and arch != "qwen2_moe":
        raise ValueError(f"config.json shared_expert_intermediate_size is not implemented for "
                         f"{arch}")
    return MoE(experts=int(experts), used=int(cfg["num_experts_per_tok"]),
               intermediate=int(cfg["moe_intermediate_size"] if qwen
                                else cfg["intermediate_size"]),
               norm_topk=arch == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
               shared_intermediate=shared)


def _no_rope_layers(cfg: dict[str, Any], arch: str) -> tuple[int, ...]:
    """SmolLM3's layers without rope: ``no_rope_layers`` holds a 0 for each (1: rope), else
    every ``no_rope_layer_interval``-th layer, as transformers reads them."""
    flags = cfg.get("no_rope_layers")
    if flags is None and cfg.get("no_rope_layer_interval") is None:
        return ()
    if arch != "smollm3":
        raise ValueError(f"config.json no_rope_layers is not implemented for {arch}")
    n = cfg["num_hidden_layers"]
    if flags is None:
        interval = cfg["no_rope_layer_interval"]
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if len(flags) != n or set(flags) - {0, 1}:
        raise ValueError(f"config.json no_rope_layers must be {n} 0s and 1s, got {flags!r:.80}")
    return tuple(i for i, rope in enumerate(flags) if not rope)


def _activation(cfg: dict[str, Any], arch: str) -> str:
    """The gate's activation: Gemma's ``hidden_activation`` (its ``hidden_act`` is legacy,
    as transformers reads it), else ``hidden_act``; one of ACTIVATIONS or refused."""
    names = {"swish": "silu"}
    act = names.get(cfg.get("hidden_act"), cfg.get("hidden_act"))
    key = "hidden_act"
    if arch in GEMMA and cfg.get("hidden_activation") is not None:
        key, legacy = "hidden_activation", act
        act = cfg["hidden_activation"]
        if legacy not in (None, act):  # (a config that says two things is not guessed at)
            raise ValueError(f"config.json hidden_act = {legacy!r} and hidden_activation = "
                             f"{act!r} disagree")
    act = act or ("gelu_pytorch_tanh" if arch in GEMMA else "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"config.json {key} = {act!r} is not implemented for {arch} "
                         f"(only {' or '.join(ACTIVATIONS)})")
    return act


def _cap(cfg: dict[str, Any], key: str, arch: str) -> float | None:
    """A soft-capping value, which only Gemma 2's network (and a Gemma 3 that sets one) has."""
    value = cfg.get(key)
    if value is not None and arch not in GEMMA:
        raise ValueError(f"config.json {key} = {value!r} is not implemented for {arch}")
    return None if value is None else float(value)


def _sliding_window(cfg: dict[str, Any], arch: str
                    ) -> tuple[int | None, tuple[str, ...] | None]:
    """The window of the layers that have one and which layers do (None: all), as
    transformers decides: the ``layer_types`` it writes; else Qwen2/3's
    ``use_sliding_window`` from ``max_window_layers`` on; Gemma 2 every other layer from the
    first, Gemma 3 five in six (``sliding_window_pattern``); Mistral's every layer."""
    layer_types = cfg.get("layer_types")
    n = cfg["num_hidden_layers"]
    if layer_types is not None:
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"config.json layer_types {sorted(unknown)} are not implemented")
        if len(layer_types) != n:
            raise ValueError(f"config.json layer_types has {len(layer_types)} entries for {n} "
                             f"layers")
    window = cfg.get("sliding_window")
    if window is None:
        return None, None
    if layer_types is None and arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        first = cfg.get("max_window_layers", 0) if cfg.get("use_sliding_window") else n
        layer_types = ["sliding_attention" if i >= first else "full_attention"
                       for i in range(n)]
    elif layer_types is None and arch in GEMMA:
        pattern = 2 if arch == "gemma2" else int(cfg.get("sliding_window_pattern")
                                                 or cfg.get("_sliding_window_pattern") or 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                       for i in range(n)]
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None, None
    return int(window), None if layer_types is None else tuple(layer_types)


def _parse_rope(cfg: dict[str, Any], arch: str
                ) -> tuple[float, dict[str, Any] | None, float | None, float]:
    """(rope_theta, rope_scaling, the sliding layers' own rope base or None, the share of a
    head rotated) from old-style `rope_theta`/`rope_scaling` or transformers-5
    `rope_parameters` (Gemma 3's: one for each layer type, the sliding layers' unscaled)."""
    params = dict(cfg.get("rope_parameters") or {})
    local = None
    if arch == "gemma3":
        if "full_attention" in params:
            local_params = dict(params.get("sliding_attention") or {})
            params = dict(params["full_attention"])
            local = local_params.pop("rope_theta", None)
            if local_params.get("rope_type", "default") != "default":
                raise ValueError(f"config.json rope_parameters.sliding_attention "
                                 f"{local_params!r:.80} is not implemented (only default)")
        local = float(local or cfg.get("rope_local_base_freq") or 10000.0)
    elif "rope_local_base_freq" in cfg:
        raise ValueError(f"config.json rope_local_base_freq is not implemented for {arch}")
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta")
                  or (1_000_000.0 if arch == "gemma3" else 10000.0))
    # (transformers 5 moves it into rope_parameters from the config's top)
    partial = params.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0
    if not 0 < partial <= 1 or partial != 1 and arch not in _PARTIAL_ROTARY:
        raise ValueError(f"config.json partial_rotary_factor = {partial!r} is not implemented "
                         f"for {arch} (only 1.0)")
    scaling = dict(cfg.get("rope_scaling") or params)
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    scaling.pop("rope_theta", None)
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return theta, None, local, partial
    if rope_type in ("llama3", "yarn", "longrope") and cfg.get("original_max_position_embeddings"):
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
    return theta, scaling, local, partial
