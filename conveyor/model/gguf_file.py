"""Reading llama.cpp GGUF files: weights (matrices as the file stores them, views of its memory
map); the config is ``gguf_config``'s, the tokenizer and stop ids ``gguf_tokenizer``'s."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import partial

import gguf
import numpy as np
import torch

from conveyor.kernels.blocks import BLOCK_TYPES, QuantizedWeight
from conveyor.model.config import ModelConfig
from conveyor.model.gguf_config import BLOCK_RE, ROPE_FACTORS, ROPE_FREQS
from conveyor.model.gguf_reader import GGUFFile, TensorInfo

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
    # a mixture of experts' router, and Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp": "feed_forward.router",
    "ffn_gate_shexp": "feed_forward.shared_expert.w1",
    "ffn_up_shexp": "feed_forward.shared_expert.w3",
    "ffn_down_shexp": "feed_forward.shared_expert.w2",
    "ffn_gate_inp_shexp": "feed_forward.shared_gate",
}
# The experts' matrices, one 3-D tensor a kind: [experts, rows, row's values]
_EXPERT_NAMES = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}


@dataclass(frozen=True)
class _Stacked:
    """A 3-D tensor of the experts' matrices: each expert's name, in order."""

    names: tuple[str, ...]

    def parts(self, t: TensorInfo) -> list[TensorInfo]:
        """Each expert's matrix as a 2-D tensor of the file (a run of its bytes)."""
        if len(t.shape) != 3 or t.shape[0] != len(self.names):
            raise ValueError(f"{t.name} has shape {t.shape}, not {len(self.names)} experts' "
                             f"matrices")
        size = t.nbytes // len(self.names)
        return [replace(t, name=name, shape=t.shape[1:], offset=t.offset + e * size, nbytes=size)
                for e, name in enumerate(self.names)]
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
    names = {t.name: _rename(t.name, config) for t in reader.tensors if t.name not in settings}
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
        if isinstance(name, _Stacked):  # the experts' matrices
            shapes |= {part.name: part.shape for part in name.parts(t)}
        elif isinstance(name, tuple):  # a fused matrix: its parts' shapes, if its rows add up
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

    def matrix(t: TensorInfo, name: str) -> None:
        """A 2-D tensor of a type the kernels read, as stored (or as ``_kernel_blocks`` has it)."""
        blocks = reader.tensor_bytes(t).reshape(t.shape[0], -1)
        moved = _unpermute_rows(blocks, name, config)
        kind, moved = _kernel_blocks(int(t.ggml_type), moved)
        if moved is not blocks:
            quantized[name] = QuantizedWeight(kind, torch.from_numpy(np.ascontiguousarray(moved)))
            reader.release(t)
        else:
            quantized[name] = QuantizedWeight(kind, torch.from_numpy(blocks),
                                              release=partial(reader.release, t))

    def tensor(t: TensorInfo, name: str) -> None:
        """Any other tensor, dequantized to float32 (a matrix of it runs dense)."""
        if len(t.shape) == 2:
            dense.append((name, int(t.ggml_type)))
        w = gguf.quants.dequantize(reader.tensor_bytes(t), t.ggml_type).reshape(t.shape)
        weights[name] = torch.from_numpy(np.array(_unpermute_rows(w, name, config),
                                                  dtype=np.float32))

    for t in reader.tensors:
        if t.name in _settings(config.architecture):
            continue  # (the config's)
        name, kind = _rename(t.name, config), int(t.ggml_type)
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
        for part, part_name in (zip(name.parts(t), name.names) if isinstance(name, _Stacked)
                                else [(t, name)]):
            if len(part.shape) == 2 and kind in BLOCK_TYPES | {int(_Q.Q5_0)}:
                matrix(part, part_name)
            else:
                tensor(part, part_name)
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


def _rename(gguf_name: str, config: ModelConfig) -> str | tuple[str, ...] | _Stacked | None:
    """Our name of a GGUF tensor; a fused matrix's parts' names; the experts' names of a 3-D
    tensor of their matrices; None if unknown."""
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    m = BLOCK_RE.fullmatch(gguf_name)
    if m is None:
        return None
    layer, kind = f"layers.{m.group(1)}", m.group(2)
    fused = _FUSED_BLOCK_NAMES.get(config.architecture, {}).get(kind)
    if fused is not None and m.group(3) == "weight":
        return tuple(f"{layer}.{part}.weight" for part in fused)
    if kind in _EXPERT_NAMES and m.group(3) == "weight" and config.moe is not None:
        return _Stacked(tuple(f"{layer}.feed_forward.experts.{e}.{_EXPERT_NAMES[kind]}.weight"
                              for e in range(config.moe.experts)))
    if kind not in _BLOCK_NAMES:
        return None
    return f"{layer}.{_BLOCK_NAMES[kind]}.{m.group(3)}"
