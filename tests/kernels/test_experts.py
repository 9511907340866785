"""The one-call mixture of experts (csrc/moe_ffn.c, kernels/experts.py) against the layer written
out in PyTorch on the loader's weights, at every tier this machine runs and in each dtype the
tier computes: the float32 router, the top experts and their renormalised weights, each
expert's SwiGLU on its GGUF blocks, the weighted sum."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conveyor.kernels import isa
from conveyor.kernels.blocks import QuantizedWeight
from conveyor.kernels.library import kernels_at

from tiny_models import Q, random_k_quant_blocks

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler")

RUNNABLE = isa.TIERS[:isa.TIERS.index(isa.current().detected) + 1]
F32, BF16 = torch.float32, torch.bfloat16
CASES = [pytest.param(t, F32, id=f"{t}-f32") for t in RUNNABLE] + [
    pytest.param(t, BF16, id=f"{t}-bf16") for t in RUNNABLE if t in isa.BF16_TIERS]
EXPERTS, USED, HIDDEN, INTER = 6, 3, 256, 256


def blocks(qtype, n: int, k: int, gen) -> tuple[QuantizedWeight, torch.Tensor]:
    """Random blocks of qtype and the loader's float32 weights for them, every row at one
    scale (test_cpu_kernels.random_blocks spans binades a row, which the written-out layer's
    float32 sums cannot follow to 1e-4 through SiLU and the weighted sum)."""
    scale = np.full(n, 0.2)
    if qtype == Q.Q8_0:
        b = gguf.quants.quantize((gen.standard_normal((n, k)) * 0.1).astype(np.float32), qtype)
    else:
        b = random_k_quant_blocks(qtype, scale, k, gen)
    dense = torch.from_numpy(gguf.quants.dequantize(b, qtype).reshape(n, k))
    return QuantizedWeight.from_gguf(int(qtype), b), dense


@pytest.fixture(scope="module")
def layer():
    """Each expert's gate (Q4_K) and up (Q8_0), fused as runs, and down (Q6_K), as llama.cpp's
    Q4_K_M mixes store them; a float32 router."""
    gen = np.random.default_rng(7)
    w13, w2, dense = [], [], []
    for _ in range(EXPERTS):
        (gate, g), (up, u), (down, d) = (blocks(Q.Q4_K, INTER, HIDDEN, gen),
                                         blocks(Q.Q8_0, INTER, HIDDEN, gen),
                                         blocks(Q.Q6_K, HIDDEN, INTER, gen))
        w13.append((gate, up))
        w2.append((down,))
        dense.append((g, u, d))
    router = torch.from_numpy(gen.standard_normal((EXPERTS, HIDDEN)).astype(np.float32) * 0.1)
    return router, w13, w2, dense


def written_out(x: torch.Tensor, router: torch.Tensor, dense, norm_topk: bool):
    """The layer in PyTorch, a token at a time, and the experts it chose."""
    out, chosen_all = torch.zeros_like(x), set()
    for t in range(len(x)):
        probs = torch.softmax(router @ x[t].float(), dim=0)
        weights, chosen = probs.topk(USED)
        if norm_topk:
            weights = weights / weights.sum()
        for w, e in zip(weights, chosen.tolist()):
            g, u, d = (m.to(x.dtype) for m in dense[e])
            y = F.linear(F.silu(F.linear(x[t:t + 1], g)) * F.linear(x[t:t + 1], u), d)
            out[t] += (w * y[0].float()).to(x.dtype)
            chosen_all.add(e)
    return out, chosen_all


def kernel(tier, dtype, layer, norm_topk: bool, activation_quant: str = "none"):
    router, w13, w2, _ = layer
    kernels = kernels_at(tier, dtype, 64, activation_quant)
    assert kernels is not None, f"the {tier} kernels did not build"
    wide = kernels.quant_linear.in_format
    return kernels.moe(router, [tuple(wide(w) for w in runs) for runs in w13],
                       [tuple(wide(w) for w in runs) for runs in w2], used=USED,
                       norm_topk=norm_topk, act="silu", stats=torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("tier,dtype", CASES)
@pytest.mark.parametrize("rows", [1, 5, 40])  # few experts; each one a thread; pieces of rows
@pytest.mark.parametrize("norm_topk", [True, False])
def test_moe_ffn_matches_the_layer_written_out(tier, dtype, layer, rows, norm_topk):
    torch.manual_seed(rows)
    x = torch.randn(rows, 2 * HIDDEN, dtype=dtype)[:, :HIDDEN]  # (strided rows)
    moe = kernel(tier, dtype, layer, norm_topk)
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, 2))  # the experts split over threads
    try:
        out = moe(x)
    finally:
        torch.set_num_threads(before)
    expected, chosen = written_out(x, layer[0], layer[3], norm_topk)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == F32 else dict(atol=4e-2, rtol=4e-2)
    torch.testing.assert_close(out, expected, **tol)
    time_ns, experts = moe.stats.tolist()
    assert experts == len(chosen) and time_ns > 0


@pytest.mark.parametrize("rows", [1, 6])
def test_moe_ffn_on_integer_activations(layer, rows):
    """--activation-quant int8 reaches the experts' linears (a decode's few rows), close to the
    float result."""
    tier = isa.current().tier
    dtype = BF16 if tier in isa.BF16_TIERS else F32
    x = torch.randn(rows, HIDDEN, dtype=dtype)
    out = kernel(tier, dtype, layer, True, "int8")(x)
    expected, _ = written_out(x, layer[0], layer[3], True)
    error = (out.float() - expected.float()).norm() / expected.float().norm()
    assert error < 0.05

