"""A weight in a GGUF's own blocks: the format the CPU's block linears read (``csrc/blocks.h``).
Below the model and its loader, which make these, and the kernels, which read them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import gguf
import numpy as np
import torch

# The types the CPU's block linears read (csrc/blocks.h): llama.cpp's 32-weight blocks, its
# K-quants' 256-weight super-blocks, and dense rows (F32, F16, BF16: a GGUF's or a safetensors
# folder's matrices, read as they are stored). The bfloat16 kernels read three of them, with the
# fp16 scalars (scale, min) that open each block widened: how many there are.
_Q = gguf.GGMLQuantizationType
DENSE_TYPES = {torch.float32: int(_Q.F32), torch.float16: int(_Q.F16),
               torch.bfloat16: int(_Q.BF16)}
BLOCK_TYPES = frozenset(int(t) for t in (_Q.Q4_0, _Q.Q4_1, _Q.Q5_1, _Q.Q8_0, _Q.Q4_K, _Q.Q5_K,
                                         _Q.Q6_K, *DENSE_TYPES.values()))
WIDE_SCALARS = {int(_Q.Q4_0): 1, int(_Q.Q4_1): 2, int(_Q.Q8_0): 1}


@dataclass
class QuantizedWeight:
    """A weight in the GGUF's own blocks, one row of blocks per output feature: as the file
    stores them, or (``wide``, Q4_0/Q4_1/Q8_0) with each block's fp16 scale (and min) widened
    to float32 in place: exact, 2 bytes more a scalar, which the bfloat16 kernels broadcast
    instead of converting (docs/results/design-notes#wide-scalars). The float32 kernels, bound
    at a decode's few rows by reading the blocks, take them as stored (Q4_1: 20 bytes a block,
    not 24) and convert the scales."""

    ggml_type: int
    blocks: torch.Tensor  # uint8 [out_features, in_features // block_values * block_bytes]
    wide: bool = False
    # a kernel's own layout of these blocks (csrc/repacked.h): its type code and a row's bytes
    # a block; 0: the file's
    repacked: int = 0
    repacked_bytes: int = 0
    # blocks that are a view of a file's map: gives their pages back, once a copy replaces them
    release: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    @property
    def block_values(self) -> int:
        return gguf.GGML_QUANT_SIZES[_Q(self.ggml_type)][0]

    @property
    def block_bytes(self) -> int:
        if self.repacked:
            return self.repacked_bytes
        size = gguf.GGML_QUANT_SIZES[_Q(self.ggml_type)][1]
        return size + 2 * WIDE_SCALARS[self.ggml_type] if self.wide else size

    @property
    def kernel_type(self) -> int:
        """The type code the kernels read these blocks as."""
        return self.repacked or self.ggml_type

    @property
    def in_features(self) -> int:
        return self.blocks.shape[1] // self.block_bytes * self.block_values

    @classmethod
    def from_gguf(cls, ggml_type: int, blocks: np.ndarray) -> QuantizedWeight:
        """blocks: [rows, row bytes] as a GGUF stores them, or a dense type's [rows, in] (not
        copied)."""
        return cls(ggml_type, torch.from_numpy(np.ascontiguousarray(blocks).view(np.uint8)
                                               .reshape(blocks.shape[0], -1)))

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> QuantizedWeight:
        """A float32, float16 or bfloat16 matrix's rows as the kernels read them (a view)."""
        return cls(DENSE_TYPES[weight.dtype], weight.contiguous().view(torch.uint8))

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weights (of ``rows`` only, when given) in float32, as gguf-py computes them (the
        loader's arithmetic, which the kernels reproduce)."""
        assert not self.wide
        blocks = self.blocks if rows is None else self.blocks[rows]
        if self.ggml_type in DENSE_TYPES.values():
            dtype = next(d for d, t in DENSE_TYPES.items() if t == self.ggml_type)
            return blocks.view(dtype).float()
        w = gguf.quants.dequantize(blocks.numpy(), _Q(self.ggml_type))
        return torch.from_numpy(w.reshape(blocks.shape[0], -1))

    def widened(self) -> QuantizedWeight:
        """These blocks with their scalars widened to float32 (a copy; self if already)."""
        if self.wide:
            return self
        size, scalars = self.block_bytes, WIDE_SCALARS[self.ggml_type]
        rows = self.blocks.shape[0]
        b = self.blocks.numpy().reshape(rows, -1, size)
        head = np.ascontiguousarray(b[..., :2 * scalars]).view(np.float16).astype(np.float32)
        widened = np.concatenate([head.view(np.uint8), b[..., 2 * scalars:]], axis=-1)
        return QuantizedWeight(self.ggml_type, torch.from_numpy(widened.reshape(rows, -1)), True)
