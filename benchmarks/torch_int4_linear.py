"""PyTorch's own int4 CPU matmul (``aten._weight_int4pack_mm_for_cpu``) against Conveyor's
float32 GGUF-block linear, on the same Q4_0 weights (one 3072 x 576 layer, SmolLM2's gate/up),
at a few row counts: GFLOP/s, best of 20 calls each, side by side in one run.

    .venv/bin/python benchmarks/torch_int4_linear.py
"""

from __future__ import annotations

import time

import gguf
import numpy as np
import torch

from conveyor.kernels import isa
from conveyor.kernels.blocks import QuantizedWeight
from conveyor.kernels.library import kernels_at

N, K, GROUP = 3072, 576, 32


def best_rate(fn, flop: float) -> float:
    fn()
    best = min(_timed(fn) for _ in range(20))
    return flop / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    qtype = gguf.GGMLQuantizationType.Q4_0
    w = np.random.default_rng(0).standard_normal((N, K)).astype(np.float32)
    blocks = gguf.quants.quantize(w, qtype)
    ours = kernels_at(isa.current().tier, torch.float32, 64).quant_linear
    weight = ours.in_format(QuantizedWeight.from_gguf(int(qtype), blocks))
    dense = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(N, K))
    # The same weights in torch's layout: 4-bit values 0..15, dequantized as (q - 8) * scale.
    b = blocks.reshape(N, -1, 18)
    scale = torch.from_numpy(np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0]
                             .astype(np.float32))                     # [N, K / GROUP]
    nibbles = np.ascontiguousarray(b[..., 2:])
    values = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(N, K)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.from_numpy(values.astype(np.int32)), 1)
    scales_zeros = torch.stack([scale.t(), torch.zeros_like(scale).t()], dim=-1).contiguous()
    x = torch.randn(4, K)
    for dtype in (torch.float32, torch.bfloat16):
        got = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(dtype), packed, GROUP,
                                                          scales_zeros.to(dtype))
        err = (got.float() - x @ dense.t()).abs().max().item()
        print(f"int4pack, {str(dtype)[6:]} activations: max |error| {err:.3g} against the "
              f"float32 product")
    print(f"{'rows':>6}{'int4pack f32':>14}{'int4pack bf16':>15}{'conveyor f32':>14}  GFLOP/s")
    for rows in (1, 4, 32, 256):
        flop = 2 * rows * N * K
        xf, xb = torch.randn(rows, K), torch.randn(rows, K).bfloat16()
        sz_f, sz_b = scales_zeros, scales_zeros.bfloat16()
        rates = [best_rate(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                     xf, packed, GROUP, sz_f), flop),
                 best_rate(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                     xb, packed, GROUP, sz_b), flop),
                 best_rate(lambda: ours(xf, weight), flop)]
        print(f"{rows:>6}" + "".join(f"{r:>14.1f}" for r in rates))


if __name__ == "__main__":
    main()
