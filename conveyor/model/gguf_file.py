"""Reading llama.cpp GGUF files: config, dequantized weights, eos ids and a cached tokenizer."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch
import transformers

from conveyor.model.config import ModelConfig

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "attention_norm",
    "attn_q": "attention.wq",
    "attn_k": "attention.wk",
    "attn_v": "attention.wv",
    "attn_output": "attention.wo",
    "attn_q_norm": "attention.q_norm",
    "attn_k_norm": "attention.k_norm",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
}
# The types the CPU's block linears read: bytes per block of 32 weights in the file, and how
# many fp16 scalars (scale, min) open each block.
_GGUF_BLOCKS = {
    int(gguf.GGMLQuantizationType.Q4_0): (18, 1),
    int(gguf.GGMLQuantizationType.Q4_1): (20, 2),
    int(gguf.GGMLQuantizationType.Q8_0): (34, 1),
}


@dataclass
class QuantizedWeight:
    """A weight in the GGUF's own blocks, one row of blocks per output feature: as the file
    stores them, or (``wide``) with each block's fp16 scale (and min) widened to float32 in
    place: exact, 2 bytes more a scalar, which the bfloat16 kernels broadcast instead of
    converting (~1.4x their speed). The float32 kernels, bound at a decode's few rows by reading
    the blocks, take them as stored (Q4_1: 20 bytes a block, not 24) and convert the scales."""

    ggml_type: int
    blocks: torch.Tensor  # uint8 [out_features, in_features // 32 * block_bytes]
    wide: bool = False

    @property
    def block_bytes(self) -> int:
        size, scalars = _GGUF_BLOCKS[self.ggml_type]
        return size + 2 * scalars if self.wide else size

    @classmethod
    def from_gguf(cls, ggml_type: int, blocks: np.ndarray) -> QuantizedWeight:
        """blocks: [rows, row bytes] as the file stores them (copied: the file is mapped
        read-only)."""
        return cls(ggml_type, torch.from_numpy(np.array(blocks, copy=True).reshape(
            blocks.shape[0], -1)))

    def widened(self) -> QuantizedWeight:
        """These blocks with their scalars widened to float32 (a copy; self if already)."""
        if self.wide:
            return self
        size, scalars = _GGUF_BLOCKS[self.ggml_type]
        rows = self.blocks.shape[0]
        b = self.blocks.numpy().reshape(rows, -1, size)
        head = np.ascontiguousarray(b[..., :2 * scalars]).view(np.float16).astype(np.float32)
        widened = np.concatenate([head.view(np.uint8), b[..., 2 * scalars:]], axis=-1)
        return QuantizedWeight(self.ggml_type, torch.from_numpy(widened.reshape(rows, -1)), True)


_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# Text that exercises merges, spaces, digits, unicode and special tokens.
_TOKENIZER_PROBE = "Hello world!  12345 naïve 🤗\n\n<|im_start|>user\tdef f(x): return x**2<|im_end|>"

_REQUIRED = object()


def _field(reader: gguf.GGUFReader, key: str, default: Any = _REQUIRED) -> Any:
    field = reader.fields.get(key)
    if field is not None:
        return field.contents()
    if default is _REQUIRED:
        raise ValueError(f"GGUF file has no {key!r} metadata")
    return default


def gguf_architecture(reader: gguf.GGUFReader) -> str:
    """The llama.cpp architecture name, checked against what the engine can run."""
    arch = _field(reader, "general.architecture", None)
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})"
        )
    return arch


def gguf_config(reader: gguf.GGUFReader) -> ModelConfig:
    """ModelConfig from `{arch}.*` metadata; llama.cpp has no dtype, so torch_dtype is None."""
    arch = gguf_architecture(reader)
    scaling = _field(reader, f"{arch}.rope.scaling.type", None)
    if scaling not in (None, "none"):
        raise ValueError(f"rope scaling {scaling!r} is not supported for GGUF files")
    tensors = {t.name: t for t in reader.tensors}
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    vocab = _field(reader, f"{arch}.vocab_size", None) or int(tensors["token_embd.weight"].shape[-1])
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=None,
        max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        qk_norm=arch == "qwen3",
        torch_dtype=None,
    )


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the row interleave llama.cpp's converter applies to llama q/k (same as transformers' GGUF loader)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _unpermute_rows(rows: np.ndarray, name: str, config: ModelConfig) -> np.ndarray:
    """A tensor's rows (weights or their quantized blocks) in HF order: llama q/k un-interleaved."""
    if config.architecture == "llama" and ".attention.wq." in name:
        return reverse_permute(rows, config.num_heads)
    if config.architecture == "llama" and ".attention.wk." in name:
        return reverse_permute(rows, config.num_kv_heads)
    return rows


def gguf_weights(reader: gguf.GGUFReader, config: ModelConfig) -> dict[str, torch.Tensor]:
    """All tensors dequantized to float32 in HF [out, in] layout, under our names."""
    names = {t.name: _rename(t.name) for t in reader.tensors}
    unknown = [gguf_name for gguf_name, name in names.items() if name is None]
    if "rope_freqs.weight" in unknown:
        raise ValueError("GGUF file has rope_freqs.weight: llama3 rope scaling is not supported for GGUF")
    if unknown:
        raise ValueError(f"unsupported GGUF tensors: {', '.join(unknown[:5])}")
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = names[t.name]
        # t.shape is innermost-first; dequantize already yields rows-first (HF layout).
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        w = _unpermute_rows(w, name, config)
        # Copy: F32 tensors come back as read-only views of the memory-mapped file.
        weights[name] = torch.from_numpy(np.array(w, dtype=np.float32))
    return weights


def gguf_quantized_weights(reader: gguf.GGUFReader,
                           config: ModelConfig) -> dict[str, QuantizedWeight]:
    """The Q4_0/Q4_1/Q8_0 matrices as stored (rows un-permuted as in ``gguf_weights``), under
    our names: the layers' and the output head's (the embedding's, when tied)."""
    out: dict[str, QuantizedWeight] = {}
    for t in reader.tensors:
        name = _rename(t.name)
        if (int(t.tensor_type) not in _GGUF_BLOCKS or len(t.shape) != 2 or name is None
                or name == "tok_embeddings.weight" and not config.tie_word_embeddings):
            continue
        blocks = _unpermute_rows(np.asarray(t.data), name, config)
        out[name] = QuantizedWeight.from_gguf(int(t.tensor_type), blocks)
    return out


def _rename(gguf_name: str) -> str | None:
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return None
    return f"layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def gguf_eos_token_ids(reader: gguf.GGUFReader) -> list[int]:
    """eos plus end-of-turn ids: llama.cpp stops on both (e.g. llama3's <|eot_id|>)."""
    ids = (_field(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom"))
    return [int(i) for i in ids if i is not None]


def load_gguf_tokenizer(path: str) -> transformers.PreTrainedTokenizerBase:
    """transformers' GGUF vocab conversion takes seconds, so keep its result on disk keyed by file identity."""
    path = os.path.abspath(path)
    st = os.stat(path)
    key = hashlib.sha256(
        f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{transformers.__version__}".encode()
    ).hexdigest()[:32]
    root = os.path.join(
        os.environ.get("CONVEYOR_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "conveyor"),
        "tokenizers",
    )
    cached = os.path.join(root, key)
    if os.path.isdir(cached):
        return transformers.AutoTokenizer.from_pretrained(cached, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True
    )
    _store(tokenizer, root, cached)
    return tokenizer


def _store(tokenizer: transformers.PreTrainedTokenizerBase, root: str, cached: str) -> None:
    """Save into a temp dir and rename it into place, so readers never see half a cache.

    Only a round trip that behaves identically is kept; a cache that cannot be written is skipped.
    """
    try:
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
    except OSError:
        return
    try:
        tokenizer.save_pretrained(tmp)
        reloaded = transformers.AutoTokenizer.from_pretrained(tmp, local_files_only=True)
        same = (
            reloaded(_TOKENIZER_PROBE).input_ids == tokenizer(_TOKENIZER_PROBE).input_ids
            and reloaded.chat_template == tokenizer.chat_template
            and reloaded.eos_token_id == tokenizer.eos_token_id
            and reloaded.bos_token_id == tokenizer.bos_token_id
        )
        if same:
            os.rename(tmp, cached)  # fails if another process got there first: keep theirs
    except OSError:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
