"""How an integer linear quantizes its input (issue 36's activation modes), as a PyTorch
reference: the kernels' numerics for the tests, and the fake quantization that measures what a
mode does to a model's output (``benchmarks/activation_agreement.py``).

Each row of activations is cut into runs; a run is scaled symmetrically to its largest
magnitude and rounded to the nearest integer, halves to even (as SIMD conversions round). int8
is llama.cpp's numerics: runs of 32 (Q8_0, scale max|x| / 127, here kept in float32) on most
block types, runs of 256 (Q8_K) on the K-quants (``kernel_mode``; ``int8-superblock`` applies
that to every linear whose width is a multiple of 256, to measure it). int16 takes runs of 32
to 16383 (15 bits, so that a VNNI kernel takes each value as two signed bytes:
128 * (p >> 7) + (p & 127)). ``int8-token`` scales a whole row at once (one scale per token),
the coarser scheme llama.cpp does not use.
"""

from __future__ import annotations

import gguf
import torch

ACTIVATION_MODES = ("none", "int16", "int8", "int8-superblock", "int8-token")
BLOCK = 32
SUPERBLOCK = 256
K_QUANTS = frozenset({gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K,
                      gguf.GGMLQuantizationType.Q6_K})
_LEVELS = {"int16": 16383, "int8": 127, "int8-superblock": 127, "int8-token": 127}


def kernel_mode(mode: str, ggml_type: int) -> str:
    """The mode the kernels apply to a linear of weights in ``ggml_type`` blocks
    (int_activations.h's activation_run): int8 takes Q8_K's runs of 256 on the K-quants."""
    return "int8-superblock" if mode == "int8" and ggml_type in K_QUANTS else mode


def quantize(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): ``x`` [..., k] as integers (int32, [..., k]) and the float32 scale of each
    run ([..., k / run], or [..., 1] per token): x ~ q * scale. k must be a multiple of the run."""
    levels = _LEVELS[mode]
    # (a row too short for runs of 256 never meets K-quant weights: their rows are 256s)
    superblock = SUPERBLOCK if x.shape[-1] % SUPERBLOCK == 0 else BLOCK
    run = {"int8-token": x.shape[-1], "int8-superblock": superblock}.get(mode, BLOCK)
    runs = x.float().reshape(*x.shape[:-1], -1, run)
    scales = runs.abs().amax(dim=-1) / levels
    inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = torch.round(runs * inverse.unsqueeze(-1)).to(torch.int32)
    return q.reshape(x.shape), scales


def fake_quantize(x: torch.Tensor, mode: str) -> torch.Tensor:
    """``x`` as the integer kernels see it (quantized, then scaled back), in x's dtype."""
    if mode == "none":
        return x
    q, scales = quantize(x, mode)
    runs = q.reshape(*x.shape[:-1], scales.shape[-1], -1).float() * scales.unsqueeze(-1)
    return runs.reshape(x.shape).to(x.dtype)
