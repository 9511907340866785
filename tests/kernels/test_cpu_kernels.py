"""The CPU kernels against the plain PyTorch path they replace, at every tier this machine can
run (on an AVX-512 machine the avx2 and generic tiers too) and in each dtype the tier computes:
the decode kernel against gather + SDPA on random paged caches, the fused add + RMSNorm against
RMSNorm's own formula, the GGUF-block linear against ``F.linear`` on the loader's weights."""

from __future__ import annotations

import copy
import shutil

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conveyor.kernels import isa
from conveyor.kernels.activations import fake_quantize, kernel_mode
from conveyor.kernels.bindings import GLU_KERNELS, IntQuantLinear, QuantLinear
from conveyor.kernels.blocks import QuantizedWeight
from conveyor.kernels.library import (AUTO_INT8_TIERS, BF16_HEAD_DIMS, cpu_kernels, kernels_at,
                                      reads_half_caches)
from conveyor.model.attention import gather_pages, write_kv
from conveyor.model.config import ModelConfig
from conveyor.model.kv_cache import dequantize, readable, stored
from conveyor.model.model import Linear, RMSNorm
from conveyor.model.rope import apply_rope, rope_tables

from tiny_models import K_QUANT_RANGE, Q, random_k_quant_blocks

# Where a compiler exists the kernels must build: a broken build fails here instead of skipping.
pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler")

RUNNABLE = isa.TIERS[:isa.TIERS.index(isa.current().detected) + 1]
KERNEL_THREADS = 2


@pytest.fixture(autouse=True)
def two_threads_at_least():
    """The kernels split their work over threads: they run on two at least here, whatever the
    test worker's own count (docs/testing.md), so that a split that loses or repeats rows
    fails."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, KERNEL_THREADS))
    yield
    torch.set_num_threads(before)


F32, BF16 = torch.float32, torch.bfloat16
CASES = [pytest.param(t, F32, id=f"{t}-f32") for t in RUNNABLE] + [
    pytest.param(t, BF16, id=f"{t}-bf16") for t in RUNNABLE if t in isa.BF16_TIERS]


def built(tier: str, dtype: torch.dtype, head_dim: int = 64):
    kernels = kernels_at(tier, dtype, head_dim)
    assert kernels is not None, f"the {tier} kernels did not build (see the warning above)"
    return kernels


def reference(q, k_cache, v_cache, tables, lens):
    n, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    width = tables.shape[1] * block_size
    mask = (torch.arange(width)[None, :] < lens[:, None]).view(n, 1, 1, width)
    k = gather_pages(k_cache, tables.long()).transpose(1, 2)
    v = gather_pages(v_cache, tables.long()).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.view(n, kv_heads, heads // kv_heads, dim).float(),
                                       k.float(), v.float(), attn_mask=mask)
    return o.reshape(n, heads, dim)


def close(dtype: torch.dtype, bf16: dict, f32: dict | None = None) -> dict:
    """assert_close tolerances: bfloat16's as given, float32's a few float32 steps."""
    return bf16 if dtype == BF16 else (f32 or dict(rtol=1e-5, atol=1e-5))


@pytest.mark.parametrize("tier,dtype", CASES)
@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [
    (9, 3, 64, 16),    # SmolLM2-135M
    (32, 8, 128, 16),  # Llama-3 / Mistral shapes
    (4, 4, 64, 8),     # no GQA, small pages
    (14, 2, 64, 32),   # Qwen2.5-0.5B's group of 7
    (4, 2, 16, 16),    # the tiny test checkpoints (float32 only: bf16 takes 64, 128, 256)
    (4, 1, 256, 16),   # Gemma-3-1B
])
def test_decode_attention_matches_sdpa(tier, dtype, heads, kv_heads, dim, block_size):
    """With AMX, pages of 16 and 32 take the scores' tile path (up to 16 query heads an item);
    pages of 8, and the avx512 tier, the vector path."""
    if dtype == BF16 and dim not in BF16_HEAD_DIMS:
        pytest.skip(f"the bfloat16 kernel is specialised for head_dim {BF16_HEAD_DIMS}")
    kernel = built(tier, dtype, dim).decode_attention
    gen = torch.Generator().manual_seed(dim + heads)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    # Contexts of one token, a page exactly, a page and one, and longer ones in shuffled pages.
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 5, 5 * block_size + 7,
                         2], dtype=torch.int32)
    width = int((lens.max() + block_size - 1) // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * width].view(len(lens), width)
    tables = tables.to(torch.int32)
    # q as the model hands it over: the query heads of a wider q/k row (a strided view).
    qk = torch.randn(len(lens), heads + kv_heads, dim, generator=gen).to(dtype)
    q = qk[:, :heads]
    out = torch.full((len(lens), heads, dim), float("nan"), dtype=dtype)

    expected = reference(q, k_cache, v_cache, tables, lens)
    # The whole batch, and its longest request alone (few requests split their work finer).
    for rows in (slice(None), slice(4, 5)):
        kernel(q[rows], k_cache, v_cache, tables[rows], lens[rows], out[rows])
        # Both accumulate in float32; they differ by summation order (and bf16's roundings).
        torch.testing.assert_close(out[rows].float(), expected[rows],
                                   **close(dtype, dict(atol=2e-2, rtol=1e-2)))
    # One token attends only to itself: the output is that token's V row, exactly.
    page, head_of = int(tables[0, 0]), torch.arange(heads) // (heads // kv_heads)
    assert torch.equal(out[0], v_cache[page, 0, head_of])


@pytest.mark.parametrize("tier,dtype", CASES)
@pytest.mark.parametrize("window", [5, 16, 37])
def test_decode_attention_window_scale_and_softcap(tier, dtype, window):
    """A sliding window (its first key mid-page, at a page's start, or before the context),
    a scale other than head_dim ** -0.5 and Gemma 2's soft cap, against the same sums written
    out: only the window's keys count, the capped scores' softmax weighs them."""
    heads, kv_heads, dim, block_size, scale, cap = 8, 2, 64, 16, 0.3, 2.0
    kernel = built(tier, dtype, dim).decode_attention
    gen = torch.Generator().manual_seed(window)
    num_blocks = 32
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    lens = torch.tensor([1, 20, 21, 32, 53, 80], dtype=torch.int32)
    width = int((lens.max() + block_size - 1) // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * width].view(len(lens), width)
    tables = tables.to(torch.int32)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    out = torch.empty_like(q)
    kernel(q, k_cache, v_cache, tables, lens, out, scale=scale, window=window, softcap=cap)

    k = gather_pages(k_cache, tables.long()).float()  # [n, keys, kv_heads, dim]
    v = gather_pages(v_cache, tables.long()).float()
    head_of = torch.arange(heads) // (heads // kv_heads)
    for i, n in enumerate(lens.tolist()):
        keys = slice(max(0, n - window), n)
        s = torch.einsum("hd,thd->ht", q[i].float(), k[i, keys][:, head_of]) * scale
        p = torch.softmax(torch.tanh(s / cap) * cap, dim=-1)
        want = torch.einsum("ht,thd->hd", p, v[i, keys][:, head_of])
        torch.testing.assert_close(out[i].float(), want, **close(dtype, dict(atol=2e-2, rtol=1e-2)))


@pytest.mark.parametrize("tier,dtype", CASES)
@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [
    (9, 3, 64, 16), (32, 8, 128, 16), (4, 4, 64, 8), (4, 1, 256, 16), (4, 2, 16, 16)])
@pytest.mark.parametrize("storage", [torch.int8, torch.float16])
def test_decode_attention_reads_narrow_caches(tier, dtype, heads, kv_heads, dim, block_size,
                                              storage):
    """An int8 cache (--kv-cache-dtype int8) or a float32 model's float16 one read in place: the
    same attention as over its values widened (an int8 head row's scale applied), alone and in
    a batch, windowed and capped; heads of very different sizes, so that a scale dropped or
    taken from the wrong head or token, or a half read at the wrong width, fails."""
    if dtype == BF16 and dim not in BF16_HEAD_DIMS:
        pytest.skip(f"the bfloat16 kernel is specialised for head_dim {BF16_HEAD_DIMS}")
    if dtype == BF16 and storage == torch.float16:
        pytest.skip("a float16 cache is a float32 model's")
    kernel = built(tier, dtype, dim).decode_attention
    gen = torch.Generator().manual_seed(dim + heads + block_size)
    num_blocks = 48
    sizes = torch.exp(torch.randn(num_blocks, block_size, kv_heads, 1, generator=gen))
    k8, v8 = (stored(torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen) * sizes,
                     storage) for _ in range(2))
    k, v = readable(k8, F32), readable(v8, F32)
    lens = torch.tensor([1, block_size + 1, 3 * block_size - 5, 5 * block_size + 7, 2],
                        dtype=torch.int32)
    width = int((lens.max() + block_size - 1) // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * width].view(len(lens), width)
    tables = tables.to(torch.int32)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    tolerance = close(dtype, dict(atol=3e-2, rtol=2e-2), dict(atol=1e-4, rtol=1e-4))
    for rows in (slice(None), slice(3, 4)):
        kernel(q[rows], k8, v8, tables[rows], lens[rows], out[rows])
        torch.testing.assert_close(out[rows].float(), reference(q[rows], k, v, tables[rows],
                                                                lens[rows]), **tolerance)
    window, scale, cap = 21, 0.2, 3.0
    kernel(q, k8, v8, tables, lens, out, scale=scale, window=window, softcap=cap)
    keys_of, values_of = gather_pages(k, tables.long()), gather_pages(v, tables.long())
    head_of = torch.arange(heads) // (heads // kv_heads)
    for i, n in enumerate(lens.tolist()):
        keys = slice(max(0, n - window), n)
        s = torch.einsum("hd,thd->ht", q[i].float(), keys_of[i, keys][:, head_of]) * scale
        p = torch.softmax(torch.tanh(s / cap) * cap, dim=-1)
        want = torch.einsum("ht,thd->hd", p, values_of[i, keys][:, head_of])
        torch.testing.assert_close(out[i].float(), want, **tolerance)


@pytest.mark.parametrize("tier,dtype", CASES)
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_rmsnorm(tier, dtype, rows, with_residual):
    kernels = built(tier, dtype)
    gen = torch.Generator().manual_seed(rows)
    plain = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        plain.weight.copy_(torch.rand(576, generator=gen) * 2)
    wide = (torch.randn(rows, 2 * 576, generator=gen) * 3).to(dtype)
    x = wide[:, 576:]  # a strided view, as a slice of a wider activation would be
    residual = (torch.randn(rows, 576, generator=gen) * 3).to(dtype) if with_residual else None

    if with_residual:
        want, want_residual = plain(x, residual.clone())
    else:
        want = plain(x)
    fused = RMSNorm(576, 1e-5).to(dtype)
    fused.load_state_dict(plain.state_dict())
    fused.fused = kernels.add_rms_norm
    if with_residual:
        got, got_residual = fused(x, residual)
        assert got_residual is residual and torch.equal(residual, want_residual)
    else:
        got = fused(x)
    # Only the float32 sum of squares is ordered differently: in bfloat16 at most one step
    # apart, and on few elements.
    if dtype == BF16:
        assert (got != want).float().mean() < 0.02
    torch.testing.assert_close(got.float(), want.float(),
                               **close(dtype, dict(rtol=2 ** -7, atol=0), dict(rtol=1e-5, atol=0)))


@pytest.mark.parametrize("tier,dtype", CASES)
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_mul_matches_pytorch(tier, dtype, rows, act):
    kernels = built(tier, dtype)
    gen = torch.Generator().manual_seed(rows)
    inter = 1536
    wide = (torch.randn(rows, 3 * inter, generator=gen) * 4).to(dtype)
    gate_up = wide[:, inter:]  # strided rows, as a slice of a wider activation would be
    gate, up = gate_up.split(inter, dim=-1)
    want = (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up

    got = kernels.gated_mul[act](gate_up)

    assert got.data_ptr() == gate_up.data_ptr()  # written over the gate
    # Only float32 exp/tanh/division can round apart from PyTorch's, rarely: one bfloat16 step
    # in the activation, which the product's own rounding can take to two.
    # GELU's 1 + tanh(...) cancels where the gate is well below 0: there the two tanh can
    # differ by a float32 step of 1, which is an absolute difference of ~1e-7 * |up * gate|,
    # and a relative one that rounds a bfloat16 step apart more often than SiLU's.
    if dtype == BF16:
        assert (got != want).float().mean() < (0.01 if act == "silu" else 0.04)
    atol = 1e-30 if act == "silu" else 1e-5
    torch.testing.assert_close(got.float(), want.float(),
                               **close(dtype, dict(rtol=2 ** -6, atol=atol),
                                       dict(rtol=1e-5, atol=atol)))


def test_kernels_only_where_they_apply(monkeypatch):
    cpu, tier = torch.device("cpu"), isa.current().tier
    assert cpu_kernels(torch.device("meta"), F32, 64) is None
    assert cpu_kernels(cpu, F32, 96) is not None  # float32 takes any head_dim
    assert cpu_kernels(cpu, torch.float16, 64) is None
    assert (cpu_kernels(cpu, BF16, 64) is not None) == (tier in isa.BF16_TIERS)
    assert cpu_kernels(cpu, BF16, 96) is None
    monkeypatch.setenv("CONVEYOR_CPU_KERNELS", "off")
    assert cpu_kernels(cpu, F32, 64) is None and cpu_kernels(cpu, BF16, 64) is None


@pytest.mark.parametrize("tier", RUNNABLE)
def test_a_float32_models_cache_is_float16_where_the_kernels_read_it(monkeypatch, tier):
    """--kv-cache-dtype auto's choice: halves where the tier has F16C (above generic) and the
    kernels run, for a float32 model on the CPU only."""
    cpu = torch.device("cpu")
    monkeypatch.setenv(isa.ENV, tier)
    isa.current.cache_clear()
    try:
        assert reads_half_caches(cpu, F32, 64) == (tier != "generic")
        assert not reads_half_caches(cpu, BF16, 64)
        assert not reads_half_caches(torch.device("meta"), F32, 64)
        assert not reads_half_caches(cpu, F32, 12)  # (no kernel takes that head size)
        monkeypatch.setenv("CONVEYOR_CPU_KERNELS", "off")
        assert not reads_half_caches(cpu, F32, 64)
    finally:
        monkeypatch.undo()
        isa.current.cache_clear()


@pytest.mark.parametrize("tier,dtype", CASES)
@pytest.mark.parametrize("heads,kv_heads,dim,tokens", [(9, 3, 64, 1), (9, 3, 64, 37),
                                                      (32, 8, 128, 5)])
@pytest.mark.parametrize("half", [False, True], ids=["model-dtype", "float16-cache"])
def test_rope_kv_write_matches_apply_rope_and_write_kv(tier, dtype, heads, kv_heads, dim, tokens,
                                                       half):
    """The kernel's rotation and cache rows equal apply_rope's and write_kv's bit for bit, into
    caches of the model dtype or (a float32 model's) float16 ones: rounded to nearest even, a
    value past float16's range to infinity, tiny ones to its subnormals."""
    if half and dtype == BF16:
        pytest.skip("a float16 cache is a float32 model's")
    kernels = built(tier, dtype, dim)
    config = ModelConfig(architecture="llama", vocab_size=8, hidden_size=heads * dim,
                         intermediate_size=8, num_layers=1, num_heads=heads,
                         num_kv_heads=kv_heads, head_dim=dim, rms_norm_eps=1e-5,
                         rope_theta=10000.0, rope_scaling=None, max_position_embeddings=512,
                         tie_word_embeddings=True, attention_bias=False, qk_norm=False,
                         torch_dtype=None)
    cos, sin = rope_tables(config, 512, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(tokens)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    # q, k, v as the model has them: views of one fused projection's output
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen) * 4).to(dtype)
    if half:  # (v's: rope leaves them as they are)
        qkv[0, heads + kv_heads, :4] = torch.tensor([1e5, -3e-6, 7e-8, 1.00048828125])
    slots = torch.randperm(8 * 16, generator=gen)[:tokens]
    caches = [torch.zeros(8, 16, kv_heads, dim, dtype=torch.float16 if half else dtype)
              for _ in range(4)]

    qk_ref = apply_rope(qkv[:, :heads + kv_heads], cos, sin)
    write_kv(qk_ref[:, heads:], qkv[:, heads + kv_heads:], caches[0], caches[1], slots)
    qk = qkv[:, :heads + kv_heads]
    kernels.rope_kv_write(qk, qkv[:, heads + kv_heads:], cos, sin, slots, caches[2], caches[3])

    # Bit for bit, in both dtypes: the same two roundings of the products, then the sum's.
    assert torch.equal(qk, qk_ref)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


@pytest.mark.parametrize("tier,dtype", CASES)
def test_rope_kv_write_quantizes_int8_caches_as_write_kv(tier, dtype):
    """Into int8 caches the kernel writes each head row as kv_cache.quantize does: the same
    scales, and values at most one step apart (a quotient at a half step may round either
    way); rows it was not given stay zero."""
    heads, kv_heads, dim, tokens = 9, 3, 64, 37
    kernels = built(tier, dtype, dim)
    gen = torch.Generator().manual_seed(7)
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen)
           * torch.exp(torch.randn(tokens, heads + 2 * kv_heads, 1, generator=gen))).to(dtype)
    qkv[3, heads] = 0  # a head of zeros: scale 0
    cos = torch.ones(tokens, 1, dim, dtype=dtype)  # no rotation: k as it is
    sin = torch.zeros(tokens, 1, dim, dtype=dtype)
    slots = torch.randperm(8 * 16, generator=gen)[:tokens]
    caches = [torch.zeros(8, 16, kv_heads, dim + 4, dtype=torch.int8) for _ in range(4)]
    write_kv(qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:], caches[0], caches[1],
             slots)
    kernels.rope_kv_write(qkv[:, :heads + kv_heads], qkv[:, heads + kv_heads:], cos, sin, slots,
                          caches[2], caches[3])
    for want, got in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got[..., dim:], want[..., dim:])  # the scales' bytes
        assert (got[..., :dim].int() - want[..., :dim].int()).abs().max() <= 1
        torch.testing.assert_close(dequantize(got, F32), dequantize(want, F32), rtol=0,
                                   atol=float(dequantize(want, F32).abs().max()) / 127 + 1e-6)
    assert dequantize(caches[2], F32).view(-1, kv_heads, dim)[slots[3], 0].abs().max() == 0
    unwritten = torch.ones(8 * 16, dtype=torch.bool)
    unwritten[slots] = False
    assert not caches[2].view(8 * 16, -1)[unwritten].any()


def random_blocks(qtype, n: int, k: int):
    """A QuantizedWeight of ``qtype`` and what the loader makes of it (gguf-py's numpy
    dequantization, float32), row scales spanning several binades, so the float32 d * q + m
    often needs rounding. Types gguf-py quantizes: random weights, quantized; the K-quants:
    random blocks."""
    gen = np.random.default_rng(int(qtype) + n)
    scale = np.exp(gen.uniform(-4, 2, (n, 1)))
    if qtype in DENSE:  # rows as a safetensors folder stores them
        w = torch.from_numpy((gen.standard_normal((n, k)) * scale).astype(np.float32))
        w = w.to(DENSE[qtype])
        return QuantizedWeight.from_dense(w), w.float()
    if qtype in K_QUANT_RANGE:
        blocks = random_k_quant_blocks(qtype, scale[:, 0], k, gen)
    else:
        w = gen.standard_normal((n, k)) * scale
        blocks = gguf.quants.quantize(w.astype(np.float32), qtype)
    dense = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(n, k))
    assert torch.isfinite(dense).all()
    return QuantizedWeight.from_gguf(int(qtype), blocks), dense


DENSE = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
BLOCKS_32 = [Q.Q4_0, Q.Q4_1, Q.Q5_1, Q.Q8_0, *DENSE]
K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("tier,dtype", CASES)
@pytest.mark.parametrize("qtype, n, k", [
    # strips of 32, the last partial; K-quants' rows are super-blocks of 256
    *[(t, n, k) for t in BLOCKS_32 for n, k in [(96, 160), (40, 64), (7, 1536)]],
    *[(t, n, k) for t in K_QUANTS for n, k in [(96, 256), (40, 512), (7, 1536)]]])
def test_quant_linear_reads_the_loaders_weights(tier, dtype, qtype, n, k):
    kernels = built(tier, dtype)
    kernel = kernels.quant_linear
    if int(qtype) not in kernel.types:
        assert dtype == BF16 and qtype in DENSE
        pytest.skip(f"the bfloat16 kernels read no {qtype.name} (dense weights run dense)")
    weight, dense = random_blocks(qtype, n, k)
    weight = kernel.in_format(weight)  # float32: the file's blocks; bfloat16: Q4/Q8_0 widened
    expected = dense.to(dtype)
    # The embedding's lookup reads the same blocks: the same weights, bit for bit.
    ids = torch.tensor([n - 1, 0, n // 2, 0])
    assert torch.equal(kernels.dequant_rows(weight, ids), expected[ids])

    # One-hot rows read single weights out: equal bit for bit, through every path the kernel
    # takes by row count (bfloat16 FMAs take 8 rows a call, more as dequantized rows; AMX up to
    # 32 a column of blocks at a time, more a strip at a time; float32 any number, in register
    # tiles and their edges).
    chunks = (1, 5, 8, 9, 40) if dtype == BF16 and not kernel.amx else (1, 5, 7, 32, 200, k)
    for chunk in chunks:
        for start in range(0, k, chunk):
            rows = min(chunk, k - start)
            x = torch.zeros(rows, k, dtype=dtype)
            x[torch.arange(rows), start + torch.arange(rows)] = 1
            assert torch.equal(kernel(x, weight), expected[:, start:start + rows].T)

    # Random rows (strided, as a slice of a wider activation) and a bias: F.linear's result up
    # to the order of the float32 sum, at row counts on and off every tile's edge.
    row_counts = (1, 2, 5, 7, 8, 9, 16, 17, 32, 33, 70, 200)
    gen = torch.Generator().manual_seed(n + k)
    wide = torch.randn(max(row_counts), k + 32, generator=gen).to(dtype)
    x = wide[:, 16:16 + k]
    bias = torch.randn(n, generator=gen).to(dtype)
    for rows in row_counts:
        got = kernel(x[:rows], weight, bias).float()
        # against the loader's float32 weights: bfloat16 rounds the result (and, on AMX, each
        # weight), within a bfloat16 step of the sum of |terms|; float32 sums in another order,
        # within a few float32 steps of it
        want = F.linear(x[:rows].float(), dense, bias.float())
        bound = F.linear(x[:rows].abs().float(), dense.abs(), bias.abs().float())
        step = 2 ** -8 if dtype == BF16 else 1e-6
        assert ((got - want).abs() <= step * bound + 1e-30).all()


@pytest.mark.parametrize("tier,dtype", CASES)
def test_a_rows_bits_do_not_depend_on_the_other_rows(tier, dtype):
    """Batch invariance of the kernels that take a row at a time: norm, act(gate) * up, rope
    and the KV write, decode attention give a row the same bits alone, at another place in a
    call, and among many rows shared out over threads."""
    kernels = built(tier, dtype)
    gen = torch.Generator().manual_seed(3)
    rows, hidden, inter, heads, kv_heads, dim, bs = 40, 576, 1536, 9, 3, 64, 16

    def each_row(fn, *tensors):
        """fn(*each tensor's rows [a:b]) for the whole batch, then for a few rows alone and a
        few slices, each on fresh copies (the kernels write in place)."""
        full = fn(*[t.clone() for t in tensors])
        for a, b in [(0, 1), (1, 2), (7, 8), (39, 40), (5, 9), (13, 40)]:
            got = fn(*[t[a:b].clone() for t in tensors])
            assert torch.equal(got, full[a:b]), (a, b)

    x = (torch.randn(rows, 2 * hidden, generator=gen) * 3).to(dtype)
    residual = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    weight = torch.rand(hidden, generator=gen).to(dtype)
    # (x strided, as a slice of a wider activation)
    each_row(lambda x, r: torch.cat((kernels.add_rms_norm(x[:, hidden:], r, weight, 1e-5), r),
                                    1), x, residual)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)
    for act in GLU_KERNELS:
        each_row(lambda gu: kernels.gated_mul[act](gu).clone(), gate_up)

    qkv = (torch.randn(rows, heads + 2 * kv_heads, dim, generator=gen) * 4).to(dtype)
    cos = torch.rand(rows, 1, dim, generator=gen).to(dtype)
    sin = torch.rand(rows, 1, dim, generator=gen).to(dtype)

    def rope(qkv, cos, sin):
        caches = [torch.zeros(rows, 1, kv_heads, dim, dtype=dtype) for _ in range(2)]
        slots = torch.arange(len(qkv))
        kernels.rope_kv_write(qkv[:, :heads + kv_heads], qkv[:, heads + kv_heads:], cos, sin,
                              slots, *caches)
        return torch.cat((qkv, caches[0][:len(qkv), 0], caches[1][:len(qkv), 0]), 1)
    each_row(rope, qkv, cos, sin)

    k_cache = torch.randn(64, bs, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(64, bs, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randint(0, 64, (rows, 6), generator=gen, dtype=torch.int32)
    lens = torch.randint(1, 6 * bs, (rows,), generator=gen, dtype=torch.int32)

    def attend(q, tables, lens):
        out = torch.empty_like(q)
        kernels.decode_attention(q, k_cache, v_cache, tables, lens, out)
        return out
    each_row(attend, qkv[:, :heads], tables, lens)


@pytest.mark.parametrize("tier,dtype", CASES)
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K])
def test_invariant_linear_gives_a_row_the_same_bits_at_every_row_count(tier, dtype, qtype):
    """Batch invariance: a row's result does not depend on how many rows share its call, nor
    on which (every path the kernel takes by row count, in bits); and it is still the linear."""
    kernel = kernels_at(tier, dtype, 64, batch_invariant=True).quant_linear
    # (enough outputs that a sum in another order changes some bfloat16 roundings)
    weight, dense = random_blocks(qtype, 1024, 512)
    weight = kernel.in_format(weight)
    gen = torch.Generator().manual_seed(int(qtype))
    x = torch.randn(70, 512, generator=gen).to(dtype)
    full = kernel(x, weight)
    for start, rows in [(0, 1), (0, 2), (3, 1), (5, 3), (0, 6), (1, 7), (0, 8), (2, 9), (0, 33),
                        (37, 33)]:
        assert torch.equal(kernel(x[start:start + rows], weight), full[start:start + rows])
    bound = F.linear(x.abs().float(), dense.abs())
    step = 2 ** -8 if dtype == BF16 else 1e-6
    assert ((full.float() - F.linear(x.float(), dense)).abs() <= step * bound).all()


@pytest.mark.parametrize("tier,dtype", CASES)
def test_linear_reads_its_blocks_at_every_row_count(tier, dtype):
    """A Linear in GGUF blocks has no dense weight: every row count reads its blocks, at most
    max_rows a kernel call (bfloat16 FMAs, without AMX: more as dequantized rows)."""
    kernel = copy.copy(built(tier, dtype).quant_linear)
    kernel.max_rows = 3
    weight, dense = random_blocks(gguf.GGMLQuantizationType.Q4_1, 64, 128)
    linear = Linear(128, 64, bias=False)
    linear.weight = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
    linear.quantized, linear.quant_linear = (kernel.in_format(weight),), kernel
    calls = []
    call = kernel._call
    kernel._call = lambda x, *args: calls.append(len(x)) or call(x, *args)
    x = torch.randn(7, 128, dtype=dtype)
    with torch.no_grad():
        for rows in (1, 3, 7):  # (as test_quant_linear_reads_the_loaders_weights bounds them)
            want = F.linear(x[:rows].float(), dense)
            bound = F.linear(x[:rows].abs().float(), dense.abs())
            step = 2 ** -8 if dtype == BF16 else 1e-6
            assert ((linear(x[:rows]).float() - want).abs() <= step * bound).all()
    dequantized = dtype == BF16 and not kernel.amx
    assert calls == ([1, 3] if dequantized else [1, 3, 3, 3, 1])


@pytest.fixture(params=[pytest.param(d, id=str(d).removeprefix("torch.")) for d in (F32, BF16)])
def native_dtype(request):
    """The dtypes this process's tier runs its kernels in (the engine reads the tier itself)."""
    if request.param == BF16 and not isa.current().native_bf16:
        pytest.skip("this CPU has no bfloat16 arithmetic")
    return request.param


def block_linear_rows(model) -> int:
    """The most rows a step's layers send through the GGUF-block linears."""
    return max(m.quant_linear.max_rows for m in model.modules()
               if isinstance(m, Linear) and m.quant_linear is not None)


@pytest.fixture(scope="module")
def moe_gguf_path(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE GGUF (8 experts, 2 a token), its experts in llama.cpp's K-quant mix."""
    from tiny_models import EXPERT_MIX, TINY_VOCAB, make_tiny_model, write_gguf

    model = make_tiny_model("qwen3_moe", vocab_size=len(TINY_VOCAB), hidden_size=256,
                            head_dim=64, intermediate_size=512, moe_intermediate_size=256)
    path = tmp_path_factory.mktemp("moe") / "qwen3_moe.gguf"
    return write_gguf(str(path), model, tokenizer=True, sync=True,
                      types={**EXPERT_MIX, "attn_q": Q.Q8_0, "attn_k": Q.Q8_0,
                             "attn_v": Q.Q8_0, "attn_output": Q.Q8_0, "token_embd": Q.Q8_0,
                             "output": Q.Q8_0})


@pytest.mark.parametrize("network,mode,kv", [
    ("dense", "none", "auto"), ("dense", "int8", "auto"), ("dense", "none", "int8"),
    ("moe", "none", "auto"), ("moe", "int8", "auto")])
def test_decode_stack_matches_the_layers(monkeypatch, request, native_dtype, network, mode, kv):
    """Each step, the prompts' (their tokens as queries of their own, causal by context length)
    and then a few decodes', runs through both the one-call stack and the layers one by one, on
    the same inputs: the same hidden states up to rare one-step bfloat16 differences (SiLU's
    float32 exp and division, as C and PyTorch compute them, can round apart), or float32's.
    With int8 activations, as many decodes as its integer linears take; with an int8 KV cache,
    both read the same quantized rows. The default model, and a mixture of experts (whose
    layers one by one call the same experts' kernel as the stack)."""
    from conveyor import LLM, SamplingParams
    from conveyor.model.model import Transformer

    path = request.getfixturevalue("default_gguf_path" if network == "dense" else "moe_gguf_path")
    llm = LLM(model=path, dtype=str(native_dtype).removeprefix("torch."),
              max_num_seqs=8, activation_quant=mode, kv_cache_dtype=kv)
    assert llm.engine.runner.model.decode_stack is not None
    forward, compared = Transformer.forward, []

    def both(self, input_ids, ropes, kv_caches, meta):
        stack = self.decode_stack
        ours = forward(self, input_ids, ropes, kv_caches, meta)
        self.decode_stack = None  # the layers rewrite this token's K/V before reading them
        layers = forward(self, input_ids, ropes, kv_caches, meta)
        self.decode_stack = stack
        if not meta.prefills:
            compared.append((ours.float(), layers.float()))
        return layers

    monkeypatch.setattr(Transformer, "forward", both)
    # Six decodes a step: past the bfloat16 FMA kernel's first rows, so AMX runs the stack's
    # linears where the machine has it. Without AMX, bfloat16 layers one by one take only 4
    # rows through the block kernel (more go to the prepacked matmul, which rounds apart from
    # the stack's), so 4 decodes there.
    model = llm.engine.runner.model
    linear = next(m.quant_linear for m in model.modules() if isinstance(m, Linear))
    decodes = min(6, block_linear_rows(model), getattr(linear, "int_rows", 6))
    prompts = ["The capital of France is", "Once upon a time", "def f(x):", "1, 2, 3,",
               "Water boils at", "import numpy as"][:decodes]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                 use_tqdm=False)
    # The prompts' step joins as queries where its tokens fit the stack's rows (AMX's and
    # float32's do; bfloat16 without AMX takes 8), then nine steps of decodes.
    prompt_rows = sum(len(llm.engine.inputs.tokenize(p)[1]) for p in prompts)
    stacked_prompts = prompt_rows <= model.decode_stack.max_rows
    assert [len(ours) for ours, _ in compared] == [prompt_rows] * stacked_prompts + [decodes] * 9
    differing, rounded_apart = [], []
    for ours, layers in compared:
        diff = (ours - layers).abs()
        scale = layers.abs().max()
        if mode == "int8" and native_dtype == F32 and diff.max() > scale * 1e-5:
            # an activation at a rounding boundary of its int8 quantization can round to the
            # neighbouring integer in one and not the other (float32's differences upstream):
            # a step's worth of one quantization step, rarely
            rounded_apart.append((diff.max() / scale).item())
            continue
        # (float32: the dense network's two paths agree bit for bit; the mixture's part by a
        # few float32 steps of the scale, more on a prompt step's many rows, and more again where
        # a float16 cache rounds such a difference in a key or value to a half's step)
        assert diff.max() <= scale * (2 ** -6 if native_dtype == BF16 else
                                      1e-5 if network == "dense" else
                                      2e-4 if half_kv_cache(llm) else 4e-5)
        differing.append((diff > 0).float().mean().item())
    assert len(rounded_apart) <= 2 and all(r <= 2 ** -4 for r in rounded_apart), rounded_apart
    if native_dtype == BF16:
        assert sum(differing) / len(differing) < 0.2
        assert differing.count(0.0) >= len(differing) // 2


def test_prompt_tokens_as_queries_match_sdpa(monkeypatch, default_gguf_path, native_dtype):
    """Short prompts' tokens through the decode kernel, each a query of its own (one call of
    the decode stack), and through SDPA (the layers one by one): the same next tokens, and
    log-probabilities within the dtype's reach."""
    from conveyor import LLM, SamplingParams
    from conveyor.model.model import Transformer
    from conveyor.worker import step_plan

    llm = LLM(model=default_gguf_path, dtype=str(native_dtype).removeprefix("torch."),
              enable_prefix_caching=False)
    forward, with_prefills = Transformer.forward, []

    def spy(self, input_ids, ropes, kv_caches, meta):
        with_prefills.append(bool(meta.prefills))
        return forward(self, input_ids, ropes, kv_caches, meta)

    monkeypatch.setattr(Transformer, "forward", spy)
    # The prompts that one call of the stack takes and whose layers one by one read the same
    # block linears: AMX's and float32's take all; bfloat16 without AMX 4 rows (its layers
    # send more to the prepacked matmul, which rounds apart), the last prompt.
    model = llm.engine.runner.model
    prompts, rows = [], min(model.decode_stack.max_rows, block_linear_rows(model))
    for prompt in ["The capital of France is", "Once upon a time, in a land far away,",
                   "def fibonacci(n):", "Water boils at a temperature of", "Water boils at"]:
        n = len(llm.engine.inputs.tokenize(prompt)[1])
        if n <= rows:
            prompts.append(prompt)
            rows -= n
    assert prompts
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=3)
    outputs = {}
    for mode, work in (("queries", step_plan.UNIFIED_CHUNK_WORK[native_dtype]), ("sdpa", 0)):
        monkeypatch.setattr(step_plan, "UNIFIED_CHUNK_WORK", {native_dtype: work})
        with_prefills.clear()
        outputs[mode] = llm.generate(prompts, params, use_tqdm=False)
        assert with_prefills == [mode == "sdpa"]
    for ours, theirs in zip(outputs["queries"], outputs["sdpa"]):
        a, b = ours.outputs[0], theirs.outputs[0]
        assert a.token_ids == b.token_ids
        for tid, lp in a.logprobs[0].items():
            if tid in b.logprobs[0]:
                # a float16 cache rounds the paths' float32 differences in a key or value to a
                # half's step now and then, from the second layer on
                assert abs(lp.logprob - b.logprobs[0][tid].logprob) < (
                    0.1 if native_dtype == BF16 else 5e-3 if half_kv_cache(llm) else 1e-3)


def half_kv_cache(llm) -> bool:
    """Whether the engine's KV cache holds halves of its float32 model (``--kv-cache-dtype``
    auto where the CPU kernels read them)."""
    return llm.engine.runner.kv_caches[0][0].dtype == torch.float16


@pytest.mark.parametrize("tier", RUNNABLE)
def test_argmax_rows_finds_the_first_maximum(tier):
    argmax = built(tier, F32).argmax_rows
    gen = torch.Generator().manual_seed(0)
    for cols in (1, 15, 16, 17, 49152 + 5):
        # Few distinct values, so most rows have their maximum more than once.
        x = torch.randint(-3, 4, (9, cols + 8), generator=gen).float()[:, 3:3 + cols]
        x[0] = float("-inf")  # every logit masked: index 0, as torch
        x[1, -1] = 100.0      # the maximum in the last, partial vector
        assert torch.equal(argmax(x), x.argmax(dim=-1))


def test_tied_head_and_embedding_read_the_tables_blocks(default_gguf_path, native_dtype):
    """The tied table (SmolLM2's Q8_0 embedding) is kept only in its blocks: the head reads them
    through the block kernel at every row count, the embedding looks its rows up in them; both
    the loader's weights in the model dtype, up to the order of the float32 sums."""
    from conveyor import LLM
    from conveyor.model.loader import load_model

    model = LLM(model=default_gguf_path, dtype=str(native_dtype).removeprefix("torch."),
                max_num_seqs=4).engine.runner.model
    assert model.output is None and model.head_blocks is model.embedding_blocks is not None
    assert model.tok_embeddings.weight.numel() == 0  # no dense table
    table = load_model(default_gguf_path).dense("tok_embeddings.weight")
    ids = torch.tensor([0, 19556, 49151, 19556])
    assert torch.equal(model.embed(ids), table[ids].to(native_dtype))
    hidden = torch.randn(300, model.config.hidden_size, dtype=native_dtype)
    with torch.no_grad():
        for rows in (1, 32, 300):  # (as test_quant_linear_reads_the_loaders_weights bounds them)
            want = F.linear(hidden[:rows].float(), table)
            bound = F.linear(hidden[:rows].abs().float(), table.abs())
            step = 2 ** -8 if native_dtype == BF16 else 1e-6
            assert ((model.compute_logits(hidden[:rows]) - want).abs() <= step * bound).all()


@pytest.mark.parametrize("tier,dtype", CASES)
@pytest.mark.parametrize("mode", ["int16", "int8"])
@pytest.mark.parametrize("qtype, n, k", [*[(t, 40, 96) for t in BLOCKS_32 if t not in DENSE],
                                         *[(t, n, 512) for t in K_QUANTS for n in (24, 21)]])
def test_integer_activation_linear_matches_its_reference(tier, dtype, mode, qtype, n, k):
    """--activation-quant: the block linear on integer activations against F.linear of the
    quantized activations (activations.fake_quantize, the reference's rounding) and the
    loader's weights, in float64: float32 sums of exact integer products. The kernel takes
    any number of rows; here it is made to take every call, on the blocks as stored and as
    the kernel reads them (the avx2 tier's int8 repacks the K-quants in groups of 8 rows: 21
    leaves a group part padding)."""
    kernel = kernels_at(tier, dtype, 64, mode).quant_linear
    kernel.int_rows = kernel.max_rows = 1 << 30
    stored, dense = random_blocks(qtype, n, k)
    assert int(qtype) in kernel.types
    # (bfloat16: Q4_0, Q4_1 and Q8_0 scalars widened)
    formats = {id(w): w for w in (kernel.lookup_format(stored), kernel.in_format(stored))}
    gen = torch.Generator().manual_seed(n + k)
    wide = torch.randn(200, k + 32, generator=gen).to(dtype) * torch.exp(
        torch.randn(200, 1, generator=gen)).to(dtype)
    x = wide[:, 16:16 + k]  # strided rows
    bias = torch.randn(n, generator=gen).to(dtype)
    for weight in formats.values():
        for rows in (1, 2, 4, 7, 32, 200):
            got = kernel(x[:rows], weight, bias).double()
            quantized = fake_quantize(x[:rows].float(), kernel_mode(mode, qtype)).double()
            want = F.linear(quantized, dense.double(), bias.double())
            bound = F.linear(quantized.abs(), dense.double().abs(), bias.double().abs())
            step = 2 ** -8 if dtype == BF16 else 2e-6  # the result's rounding, or float32 sums'
            assert ((got - want).abs() <= step * bound + 1e-30).all(), (rows, weight.repacked)
        # the quantization is the kernel's own: float activations are not what it multiplies
        if mode == "int8":
            plain = F.linear(x[:32].double(), dense.double(), bias.double())
            assert not torch.allclose(kernel(x[:32], weight, bias).double(), plain, rtol=1e-4)


@pytest.mark.parametrize("tier,dtype", CASES)
@pytest.mark.parametrize("mode", ["int16", "int8"])
def test_integer_activations_take_a_decodes_few_rows_and_float_kernels_the_rest(tier, dtype,
                                                                                  mode):
    """A call of at most int_rows rows runs on integer activations (int8 on the K-quants up to
    superblock_rows: at avx512 16; at the avx2 tier they are repacked for int8 and read so at
    every row count); more rows, and dense weights, are the float kernel's own result, bit for
    bit. (int16's few rows can round to the float kernel's bfloat16 outputs: there only the
    float rows are asserted.)"""
    kernels = kernels_at(tier, dtype, 64, mode)
    integer, plain = kernels.quant_linear, QuantLinear(kernels.lib, dtype)
    superblock_rows = {("avx512", "int8"): 16}.get((tier, mode), 0)
    assert integer.superblock_rows == superblock_rows
    repacks = (tier, mode) == ("avx2", "int8")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 256, generator=gen).to(dtype)
    for qtype in (Q.Q4_K, Q.Q8_0, *(DENSE if dtype == F32 else ())):
        raw = random_blocks(qtype, 24, 256)[0]
        weight, as_stored = integer.in_format(raw), plain.in_format(raw)
        assert bool(weight.repacked) == (repacks and qtype == Q.Q4_K)
        for rows in (integer.int_rows, integer.int_rows + 3, 16, 17, 40):
            same = torch.equal(integer(x[:rows], weight), plain(x[:rows], as_stored))
            floats = qtype in DENSE or not weight.repacked and rows > (
                max(integer.int_rows, superblock_rows) if qtype == Q.Q4_K else integer.int_rows)
            if floats or mode == "int8" or dtype == F32:
                assert same == floats, (qtype, rows)


@pytest.mark.parametrize("tier,dtype", CASES)
def test_auto_activations_are_int8_on_the_k_quants_where_that_is_faster(tier, dtype):
    """--activation-quant auto (the default): at the avx2 and avx512 tiers int8 on the K-quants
    (avx2: repacked, every row count; avx512: up to superblock_rows), and the float kernels'
    own result, bit for bit, on the other block types and elsewhere (amx, generic; batch
    invariance)."""
    kernels = kernels_at(tier, dtype, 64, "auto")
    linear, plain = kernels.quant_linear, QuantLinear(kernels.lib, dtype)
    assert isinstance(linear, IntQuantLinear) == (tier in AUTO_INT8_TIERS)
    assert not isinstance(kernels_at(tier, dtype, 64, "auto", batch_invariant=True).quant_linear,
                          IntQuantLinear)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(20, 256, generator=gen).to(dtype)
    for qtype in (Q.Q4_K, Q.Q6_K, Q.Q4_1, Q.Q8_0):
        raw = random_blocks(qtype, 24, 256)[0]
        weight, as_stored = linear.in_format(raw), plain.in_format(raw)
        assert bool(weight.repacked) == (tier == "avx2" and qtype in K_QUANTS)
        for rows in (1, 4, 20):
            integer = isinstance(linear, IntQuantLinear) and qtype in K_QUANTS and (
                weight.repacked or rows <= linear.superblock_rows)
            same = torch.equal(linear(x[:rows], weight), plain(x[:rows], as_stored))
            assert same != integer, (qtype, rows)


@pytest.mark.parametrize("tied", [True, False])
def test_a_repacked_head_leaves_the_lookup_its_blocks(tmp_path, monkeypatch, tied):
    """Where int8 repacks the K-quants (the avx2 tier), a tied head is repacked and its lookups
    read the file's blocks as stored; an untied table is only looked up, so it is not repacked.
    Either way the embedding is the loader's rows and the head the repacked kernel's result."""
    if "avx2" not in RUNNABLE:
        pytest.skip("the repacked layout is the avx2 tier's")
    from tiny_models import TINY_VOCAB, make_tiny_model, write_gguf

    from conveyor import LLM
    from conveyor.model.loader import load_model

    model = make_tiny_model("llama", vocab_size=len(TINY_VOCAB), hidden_size=256,
                            intermediate_size=512, tie_word_embeddings=tied)
    path = write_gguf(str(tmp_path / "m.gguf"), model, tokenizer=True, types={
        "token_embd": Q.Q6_K, "output": Q.Q4_K, "attn_q": Q.Q4_K, "attn_k": Q.Q4_K,
        "attn_v": Q.Q4_K, "attn_output": Q.Q4_K, "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K,
        "ffn_down": Q.Q4_K})
    monkeypatch.setattr(isa, "current", lambda: isa.choose(requested="avx2"))
    net = LLM(model=path, dtype="float32", activation_quant="int8",
              num_kv_blocks=8).engine.runner.model
    head = net.head_blocks if tied else net.output.quantized[0]
    assert head.repacked and not net.embedding_blocks.repacked
    assert (net.output is None) == tied
    loaded = load_model(path)
    table = loaded.dense("tok_embeddings.weight")
    ids = torch.tensor([0, 5, len(TINY_VOCAB) - 1])
    assert torch.equal(net.embed(ids), table[ids])
    weight = (table if tied else loaded.dense("output.weight")).double()
    quantized = fake_quantize(torch.randn(3, 256), "int8-superblock").double()
    got = net.compute_logits(quantized.float()).double()
    want, bound = F.linear(quantized, weight), F.linear(quantized.abs(), weight.abs())
    assert ((got - want).abs() <= 2e-6 * bound).all()
