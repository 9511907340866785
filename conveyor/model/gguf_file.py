"""Reading llama.cpp GGUF files: weights (matrices as the file stores them, views of its memory
map); the config is ``gguf_config``'s, the tokenizer and stop ids ``gguf_tokenizer``'s."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from functools import partial

import gguf
import numpy as np
import torch

from conveyor.kernels.blocks import BLOCK_TYPES, QuantizedWeight
from conveyor.model.config import ModelConfig
from conveyor.model.gguf_config import BLOCK_RE, ROPE_FACTORS, ROPE_FREQS
from conveyor.model.gguf_reader import GGUFFile

logger = logging.getLogger("conveyor")

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
# The tensor types gguf-py dequantizes: F32, F16 and the block types in its registry (not the
# integer types, F64, Q8_1 or Q8_K).
_READABLE_TYPES = frozenset({gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                             *gguf.quants._type_traits})

# Text that exercises merges, spaces, digits, unicode and special tokens.

def one_line(e: BaseException) -> str:
    """An exception as one short line (the CLI prints errors as one line)."""
    return " ".join(str(e).split())[:300] or type(e).__name__


def read_gguf(path: str) -> GGUFFile:
    """Parse a GGUF file's header, metadata and tensor table: a truncated or corrupted file is
    one ValueError naming the file."""
    try:
        return GGUFFile(path)
    except ValueError as e:
        raise ValueError(f"{path}: not a valid GGUF file: {one_line(e)}") from e


def check_gguf_tensors(reader: GGUFFile, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor's name, type and bytes, checked before anything reads its data; returns
    their shapes (HF [out, in] layout, our names) for ``loader.check_shapes``.

    The C kernels read as many blocks as a shape says, so a tensor whose bytes do not match it
    must fail here, not as a segfault. As llama.cpp requires, tensors lie back to back in
    table order, each padded to the alignment: a tensor that starts anywhere else means the
    one before it is not the size its shape and type say (a wrong type or block count)."""
    arch = config.architecture
    settings = _settings(arch)
    names = {t.name: _rename(t.name, arch) for t in reader.tensors if t.name not in settings}
    unknown = [gguf_name for gguf_name, name in names.items() if name is None]
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


def _settings(arch: str) -> set[str]:
    """The tensors that hold settings, which ``gguf_config`` reads: rope's factors."""
    return {ROPE_FREQS, *ROPE_FACTORS} if arch == "phi3" else {ROPE_FREQS}


# The architectures whose q/k rows llama.cpp's converter interleaves (its LlamaModel's)
_PERMUTED = ("llama", "smollm3")


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the row interleave llama.cpp's converter applies to llama q/k (same as transformers' GGUF loader)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _unpermute_rows(rows: np.ndarray, name: str, config: ModelConfig) -> np.ndarray:
    """A tensor's rows (weights or their quantized blocks) in HF order: llama q/k un-interleaved."""
    if config.architecture in _PERMUTED and ".attention.wq." in name:
        return reverse_permute(rows, config.num_heads)
    if config.architecture in _PERMUTED and ".attention.wk." in name:
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
        if t.name in _settings(config.architecture):
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
    m = BLOCK_RE.fullmatch(gguf_name)
    if m is None:
        return None
    fused = _FUSED_BLOCK_NAMES.get(arch, {}).get(m.group(2))
    if fused is not None and m.group(3) == "weight":
        return tuple(f"layers.{m.group(1)}.{part}.weight" for part in fused)
    if m.group(2) not in _BLOCK_NAMES:
        return None
    return f"layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
