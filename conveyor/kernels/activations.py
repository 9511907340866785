"""How an integer linear quantizes its input (issue 36's activation modes), as a PyTorch
reference: the kernels' numerics for the tests, and the fake quantization that measures what a
mode does to a model's output (``benchmarks/activation_agreement.py``).

Each row of activations is cut into runs of 32 values (a GGUF block's width); a run is scaled
symmetrically to its largest magnitude and rounded to the nearest integer, halves to even (as
SIMD conversions round): int8 is llama.cpp's Q8_0 (scale max|x| / 127, here kept in float32),
int16 the same to 16383 (15 bits, so that a VNNI kernel takes each value as two signed bytes:
128 * (p >> 7) + (p & 127)). ``int8-token`` scales a whole row at once (one scale per token),
the coarser scheme llama.cpp does not use.
"""

from __future__ import annotations

import torch

ACTIVATION_MODES = ("none", "int16", "int8", "int8-token")
BLOCK = 32
_LEVELS = {"int16": 16383, "int8": 127, "int8-token": 127}


def quantize(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): ``x`` [..., k] as integers (int32, [..., k]) and the float32 scale of each
    run ([..., k / 32], or [..., 1] per token): x ~ q * scale. k must be a multiple of 32."""
    levels = _LEVELS[mode]
    runs = x.float().reshape(*x.shape[:-1], -1, x.shape[-1] if mode == "int8-token" else BLOCK)
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
