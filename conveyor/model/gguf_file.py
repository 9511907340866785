"""Reading llama.cpp GGUF files: config, weights (matrices as the file stores them, views of its
memory map), eos ids and a cached tokenizer."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from functools import partial
from typing import Any

import gguf
import numpy as np
import torch
import transformers

from conveyor.kernels.blocks import BLOCK_TYPES, QuantizedWeight
from conveyor.model.config import GEMMA, ModelConfig
from conveyor.model.gguf_reader import GGUFFile

logger = logging.getLogger("conveyor")

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")

_Q = gguf.GGMLQuantizationType

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}
# Matrices llama.cpp stores fused (Phi-3's, as its checkpoints do): their parts, by rows.
_FUSED_BLOCK_NAMES = {
    "phi3": {"attn_qkv": ("attention.wq", "attention.wk", "attention.wv"),
             "ffn_up": ("feed_forward.w1", "feed_forward.w3")},
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
    "post_attention_norm": "post_attention_norm",  # (Gemma's four norms a layer)
    "post_ffw_norm": "post_ffn_norm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# The tensor types gguf-py dequantizes: F32, F16 and the block types in its registry (not the
# integer types, F64, Q8_1 or Q8_K).
_READABLE_TYPES = frozenset({gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                             *gguf.quants._type_traits})

# Text that exercises merges, spaces, digits, unicode and special tokens.
_TOKENIZER_PROBE = "Hello world!  12345 naïve 🤗\n\n<|im_start|>user\tdef f(x): return x**2<|im_end|>"

_REQUIRED = object()


def _one_line(e: BaseException) -> str:
    """An exception as one short line (the CLI prints errors as one line)."""
    return " ".join(str(e).split())[:300] or type(e).__name__


def read_gguf(path: str) -> GGUFFile:
    """Parse a GGUF file's header, metadata and tensor table: a truncated or corrupted file is
    one ValueError naming the file."""
    try:
        return GGUFFile(path)
    except ValueError as e:
        raise ValueError(f"{path}: not a valid GGUF file: {_one_line(e)}") from e


def _field(reader: GGUFFile, key: str, default: Any = _REQUIRED) -> Any:
    value = reader.value(key, _REQUIRED)
    if value is not _REQUIRED:
        return value
    if default is _REQUIRED:
        raise ValueError(f"GGUF file has no {key!r} metadata")
    return default


def _number(reader: GGUFFile, key: str, default: Any = _REQUIRED, *,
            kind: type = int, zero: bool = False) -> Any:
    """A positive (or, with zero, non-negative) number from the metadata, or default when the
    key is absent. A corrupted file can hold a string, a list, 0 or a NaN there, which would
    fail far from the cause (a ZeroDivisionError, a TypeError)."""
    value = _field(reader, key, default)
    if value is None and default is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not (value >= 0 if zero else value > 0) or kind is int and value != int(value)):
        raise ValueError(f"GGUF metadata {key!r} is {value!r:.40}, expected a "
                         f"{'non-negative' if zero else 'positive'} {kind.__name__}")
    return kind(value)


def gguf_architecture(reader: GGUFFile) -> str:
    """The llama.cpp architecture name, checked against what the engine can run."""
    arch = _field(reader, "general.architecture", None)
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})"
        )
    return arch


def gguf_config(reader: GGUFFile) -> ModelConfig:
    """ModelConfig from `{arch}.*` metadata; llama.cpp has no dtype, so torch_dtype is None.
    What llama.cpp fixes per architecture rather than storing (Gemma's window pattern, local
    rope base and scores' scale) is fixed here the same way."""
    arch = gguf_architecture(reader)
    scaling = _field(reader, f"{arch}.rope.scaling.type", None)
    rope_scaling = None
    if scaling == "linear":
        rope_scaling = {"rope_type": "linear",
                        "factor": _number(reader, f"{arch}.rope.scaling.factor", kind=float)}
    elif scaling not in (None, "none"):
        raise ValueError(f"rope scaling {scaling!r} is not supported for GGUF files")
    tensors = {t.name: t for t in reader.tensors}
    hidden = _number(reader, f"{arch}.embedding_length")
    num_heads = _number(reader, f"{arch}.attention.head_count")
    num_layers = _number(reader, f"{arch}.block_count")
    head_dim = _number(reader, f"{arch}.attention.key_length", hidden // num_heads)
    gemma = arch in GEMMA
    window = (_number(reader, f"{arch}.attention.sliding_window", None)
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
        rotary = _number(reader, f"{arch}.rope.dimension_count", head_dim)
        if "rope_factors_long.weight" in tensors:
            rope_scaling = _longrope(reader, arch, tensors, rotary)
    vocab = _number(reader, f"{arch}.vocab_size", None)
    if vocab is None:  # llama.cpp's converter often leaves it out: the embedding's rows
        embd = tensors.get("token_embd.weight")
        if embd is None or len(embd.shape) != 2:
            raise ValueError("GGUF file has no vocab_size metadata and no 2-D token_embd.weight")
        vocab = int(embd.shape[0])
    config = ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_number(reader, f"{arch}.feed_forward_length"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=_number(reader, f"{arch}.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=_number(reader, f"{arch}.attention.layer_norm_rms_epsilon", kind=float),
        rope_theta=_number(reader, f"{arch}.rope.freq_base", 10000.0, kind=float),
        rope_scaling=rope_scaling,
        max_position_embeddings=_number(reader, f"{arch}.context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        qk_norm=arch in ("qwen3", "gemma3"),
        torch_dtype=None,
        sliding_window=window,
        layer_types=layer_types,
        hidden_act="gelu_pytorch_tanh" if gemma else "silu",
        attention_scale=(hidden / num_heads if big else head_dim) ** -0.5 if gemma else None,
        attn_softcap=_number(reader, f"{arch}.attn_logit_softcapping", None, kind=float),
        final_softcap=_number(reader, f"{arch}.final_logit_softcapping", None, kind=float),
        local_rope_theta=10000.0 if arch == "gemma3" else None,
        output_bias="blk.0.attn_output.bias" in tensors,
        rotary_dim=None if rotary == head_dim else rotary,
    )
    if not gemma and (config.attn_softcap or config.final_softcap):
        raise ValueError(f"GGUF soft-capping is not implemented for {arch}")
    _check_counts(config, tensors)
    _refuse_unread(reader, config)
    return config


# LongRoPE's factors, which llama.cpp's converter stores as tensors (F32, one per rotated pair)
_ROPE_FACTORS = {"rope_factors_short.weight": "short_factor",
                 "rope_factors_long.weight": "long_factor"}


def _longrope(reader: GGUFFile, arch: str, tensors: dict, rotary: int) -> dict[str, Any]:
    """Phi-3's LongRoPE from the file: the factors' tensors, the pretrained length and the
    attention factor (which llama.cpp's converter computes and stores)."""
    scaling: dict[str, Any] = {"rope_type": "longrope"}
    for name, key in _ROPE_FACTORS.items():
        t = tensors.get(name)
        if t is None or t.ggml_type != _Q.F32 or tuple(t.shape) != (rotary // 2,):
            raise ValueError(f"{name}: LongRoPE needs {rotary // 2} F32 factors")
        scaling[key] = reader.tensor_bytes(t).view(np.float32).tolist()
    scaling["original_max_position_embeddings"] = _number(
        reader, f"{arch}.rope.scaling.original_context_length")
    scaling["attention_factor"] = _number(reader, f"{arch}.rope.scaling.attn_factor", 1.0,
                                          kind=float)
    return scaling


# ``{arch}.*`` keys ``gguf_config`` reads; every other one must hold what the network without
# it would (``_AT``: a function of the config) or is refused. Keys outside ``{arch}.*``
# (general.*, tokenizer.*, quantize.*, split.*) are metadata.
_READ = frozenset({"context_length", "embedding_length", "block_count", "feed_forward_length",
                   "attention.head_count", "attention.head_count_kv", "attention.key_length",
                   "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.type",
                   "vocab_size", "attn_logit_softcapping", "final_logit_softcapping"})
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
        longrope = config.rope_scaling is not None and config.rope_scaling["rope_type"] == "longrope"
        if (name in _READ or name.startswith(_UNUSED_WITHOUT_SCALING) and
                config.rope_scaling is None or name == "rope.scaling.factor"
                or name == "attention.sliding_window" and arch in _WINDOWED
                or name == "rope.dimension_count" and arch == "phi3"
                or longrope and name in ("rope.scaling.original_context_length",
                                         "rope.scaling.attn_factor")):
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
    blocks = {m.group(1) for name in tensor_names if (m := _BLOCK_RE.fullmatch(name))}
    if len(blocks) != c.num_layers:
        raise ValueError(f"{arch}.block_count is {c.num_layers}, but the file has tensors "
                         f"for {len(blocks)} blocks")


def check_gguf_tensors(reader: GGUFFile, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor's name, type and bytes, checked before anything reads its data; returns
    their shapes (HF [out, in] layout, our names) for ``loader.check_shapes``.

    The C kernels read as many blocks as a shape says, so a tensor whose bytes do not match it
    must fail here, not as a segfault. As llama.cpp requires, tensors lie back to back in
    table order, each padded to the alignment: a tensor that starts anywhere else means the
    one before it is not the size its shape and type say (a wrong type or block count)."""
    arch = config.architecture
    settings = set(_ROPE_FACTORS) if arch == "phi3" else set()  # (read by gguf_config)
    names = {t.name: _rename(t.name, arch) for t in reader.tensors if t.name not in settings}
    unknown = [gguf_name for gguf_name, name in names.items() if name is None]
    if "rope_freqs.weight" in unknown:
        raise ValueError("GGUF file has rope_freqs.weight: llama3 rope scaling is not "
                         "supported for GGUF")
    if unknown:
        raise ValueError(f"unsupported GGUF tensors: {', '.join(unknown[:5])}")
    shapes: dict[str, tuple[int, ...]] = {}
    offset, before = reader.data_offset, "the tensor data starts"  # where the next must start
    for t in reader.tensors:
        shape, kind = t.shape, t.ggml_type.name
        if t.ggml_type not in _READABLE_TYPES:
            raise ValueError(f"{t.name} has ggml type {kind}, which the loader cannot read")
        block, block_bytes = gguf.GGML_QUANT_SIZES[t.ggml_type]
        if shape and shape[-1] % block:
            raise ValueError(f"{t.name}: rows of {shape[-1]} values are not whole {kind} blocks "
                             f"of {block}")
        if t.offset != offset:
            raise ValueError(f"{t.name} starts at byte {t.offset}, but {before} at {offset}: "
                             f"a corrupted offset, or a type or shape that does not fit the data")
        n_bytes = math.prod(shape) // block * block_bytes
        if offset + n_bytes > reader.size:
            raise ValueError(f"{t.name} ({kind} {shape}) needs {n_bytes} bytes at {offset}, past "
                             f"the end of the file")
        offset += -(-n_bytes // reader.alignment) * reader.alignment
        before = f"{t.name} ({kind} {shape}) ends"
        name = names.get(t.name)
        if name is None:  # (a setting's tensor)
            continue
        if isinstance(name, tuple):  # a fused matrix: its parts' shapes, if its rows add up
            rows = config.fused_rows(len(name))
            if len(shape) != 2 or shape[0] != sum(rows):
                raise ValueError(f"{t.name} has shape {shape}, not {sum(rows)} rows of its "
                                 f"{len(name)} parts")
            shapes |= {part: (n, shape[1]) for part, n in zip(name, rows)}
        else:
            shapes[name] = shape
    return shapes


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


def gguf_tensors(reader: GGUFFile, config: ModelConfig
                 ) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """Every tensor under our names (after ``check_gguf_tensors``), read from the file's map:
    the matrices of the block types (``BLOCK_TYPES``) as stored, views of the map (llama's q/k
    rows un-interleaved and Q5_0 rewritten as Q8_0 are copies, whose source pages are then
    given back); the vectors, and matrices of other types, dequantized to float32 (those
    matrices run dense: one line says which)."""
    weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    dense: list[tuple[str, int]] = []
    for t in reader.tensors:
        if t.name in _ROPE_FACTORS and config.architecture == "phi3":
            continue  # (the config's)
        name, kind = _rename(t.name, config.architecture), int(t.ggml_type)
        if isinstance(name, tuple):  # fused: its parts as runs of its rows (no release: the
            # parts share the tensor's pages)
            rows = np.cumsum([0, *config.fused_rows(len(name))])
            if kind in BLOCK_TYPES:
                blocks = torch.from_numpy(reader.tensor_bytes(t).reshape(t.shape[0], -1))
                quantized |= {part: QuantizedWeight(kind, blocks[a:b])
                              for part, a, b in zip(name, rows, rows[1:])}
            else:
                dense.extend((part, kind) for part in name)
                w = torch.from_numpy(np.array(gguf.quants.dequantize(
                    reader.tensor_bytes(t), t.ggml_type).reshape(t.shape), dtype=np.float32))
                weights |= {part: w[a:b] for part, a, b in zip(name, rows, rows[1:])}
            continue
        if len(t.shape) == 2 and kind in BLOCK_TYPES | {int(_Q.Q5_0)}:
            blocks = reader.tensor_bytes(t).reshape(t.shape[0], -1)
            moved = _unpermute_rows(blocks, name, config)
            kind, moved = _kernel_blocks(kind, moved)
            if moved is not blocks:
                quantized[name] = QuantizedWeight(kind, torch.from_numpy(np.ascontiguousarray(moved)))
                reader.release(t)
            else:
                quantized[name] = QuantizedWeight(kind, torch.from_numpy(blocks),
                                                  release=partial(reader.release, t))
            continue
        if len(t.shape) == 2:
            dense.append((name, kind))
        w = gguf.quants.dequantize(reader.tensor_bytes(t), t.ggml_type).reshape(t.shape)
        weights[name] = torch.from_numpy(np.array(_unpermute_rows(w, name, config),
                                                  dtype=np.float32))
    if dense:
        logger.info("GGUF matrices with no block kernel for their type run as dense weights: "
                    "%s", matrices_by_type(dense))
    return weights, quantized


def _kernel_blocks(ggml_type: int, blocks: np.ndarray) -> tuple[int, np.ndarray]:
    """The blocks the kernels take for a matrix: Q5_0's rewritten as Q8_0's, the same fp16
    scale and each q - 16 in a byte (exact: the same weights). 34 bytes a block instead of 22,
    but a decode step's few rows are bound by unpacking, not reading: a Q5_0 kernel was slower
    than these blocks (docs/results/design-notes#q5_0-as-q8_0); and the bfloat16 kernels
    read Q8_0."""
    if ggml_type != int(_Q.Q5_0):
        return ggml_type, blocks
    b = np.ascontiguousarray(blocks).reshape(blocks.shape[0], -1, 22)
    fifth = (b[..., 2:6].copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
    nibbles = np.concatenate([b[..., 6:] & 15, b[..., 6:] >> 4], axis=-1)
    q = (nibbles | (fifth << 4).astype(np.uint8)).astype(np.int8) - np.int8(16)
    q8 = np.concatenate([b[..., :2], q.view(np.uint8)], axis=-1)
    return int(_Q.Q8_0), q8.reshape(blocks.shape[0], -1)


def matrices_by_type(matrices: Iterable[tuple[str, int]]) -> str:
    """(name, ggml type) pairs for a log line: ``TYPE (names, layer numbers folded); ...``."""
    names: dict[str, set[str]] = {}
    for name, ggml_type in matrices:
        names.setdefault(_Q(ggml_type).name, set()).add(re.sub(r"\.\d+\.", ".*.", name))
    return "; ".join(f"{kind} ({', '.join(sorted(group))})"
                     for kind, group in sorted(names.items()))


def _rename(gguf_name: str, arch: str) -> str | tuple[str, ...] | None:
    """Our name of a GGUF tensor; a fused matrix's parts' names; None if unknown."""
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None:
        return None
    fused = _FUSED_BLOCK_NAMES.get(arch, {}).get(m.group(2))
    if fused is not None and m.group(3) == "weight":
        return tuple(f"layers.{m.group(1)}.{part}.weight" for part in fused)
    if m.group(2) not in _BLOCK_NAMES:
        return None
    return f"layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def gguf_eos_token_ids(reader: GGUFFile) -> list[int]:
    """eos plus end-of-turn ids: llama.cpp stops on both (e.g. llama3's <|eot_id|>)."""
    ids = (_number(reader, f"tokenizer.ggml.{k}_token_id", None, zero=True)
           for k in ("eos", "eot", "eom"))
    return [i for i in ids if i is not None]


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
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True
        )
    except Exception as e:  # noqa: BLE001
        # The conversion raises whatever corrupted metadata leads it to: an IndexError for an
        # eos id past the vocabulary, a KeyError, a tokenizers error for a merge of no tokens...
        raise ValueError(f"{path}: no tokenizer can be built from its metadata: "
                         f"{_one_line(e)}") from e
    _store(tokenizer, root, cached)
    return tokenizer


def _store(tokenizer: transformers.PreTrainedTokenizerBase, root: str, cached: str) -> None:
    """Save into a temp dir and rename it into place, so readers never see half a cache.

    Only a round trip that behaves identically is kept; a cache that cannot be written, or a
    tokenizer that cannot encode the probe text, is skipped.
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
    except Exception:  # noqa: BLE001  (an OSError, or a vocabulary that cannot spell the probe)
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
