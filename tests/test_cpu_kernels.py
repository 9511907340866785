"""The CPU kernels against the plain PyTorch path they replace: the decode kernel against
gather + SDPA on random paged caches, the fused add + RMSNorm against RMSNorm's own formula, the
GGUF-block linear against ``F.linear`` on the loader's bfloat16 weights."""

from __future__ import annotations

import shutil
from unittest import mock

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conveyor.model.attention import gather_pages, write_kv
from conveyor.model.cpu_kernels import cpu_kernels
from conveyor.model.gguf_file import QuantizedWeight
from conveyor.model.config import ModelConfig
from conveyor.model.model import Linear, RMSNorm, apply_rope, rope_tables

# Where a compiler exists the kernel must build: a broken build fails here instead of skipping.
pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler")


def built_kernels(head_dim: int):
    kernels = cpu_kernels(torch.device("cpu"), torch.bfloat16, head_dim)
    assert kernels is not None, "the CPU kernels did not build (see the warning above)"
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


@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [
    (9, 3, 64, 16),    # SmolLM2-135M
    (32, 8, 128, 16),  # Llama-3 / Mistral shapes
    (4, 4, 64, 8),     # no GQA, small pages
    (14, 2, 64, 32),   # Qwen2.5-0.5B's group of 7
])
def test_kernel_matches_sdpa(block_kernel, heads, kv_heads, dim, block_size):
    """With AMX on, pages of 16 and 32 take the scores' tile path (up to 16 query heads an
    item); pages of 8 and AMX off, the vector path."""
    kernel = built_kernels(dim).decode_attention
    if kernel is None:
        pytest.skip("this CPU lacks AVX-512 BF16: decodes gather pages and run SDPA")
    gen = torch.Generator().manual_seed(dim + heads)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).bfloat16()
    # Contexts of one token, a page exactly, a page and one, and longer ones in shuffled pages.
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 5, 5 * block_size + 7,
                         2], dtype=torch.int32)
    width = int((lens.max() + block_size - 1) // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * width].view(len(lens), width)
    tables = tables.to(torch.int32)
    # q as the model hands it over: the query heads of a wider q/k row (a strided view).
    qk = torch.randn(len(lens), heads + kv_heads, dim, generator=gen).bfloat16()
    q = qk[:, :heads]
    out = torch.full((len(lens), heads, dim), float("nan"), dtype=torch.bfloat16)

    kernel(q, k_cache, v_cache, tables, lens, out)

    expected = reference(q, k_cache, v_cache, tables, lens)
    # Both accumulate in float32; they differ by summation order and the final bf16 rounding.
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=1e-2)
    # One token attends only to itself: the output is that token's V row, exactly.
    page, head_of = int(tables[0, 0]), torch.arange(heads) // (heads // kv_heads)
    assert torch.equal(out[0], v_cache[page, 0, head_of])


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_rmsnorm(rows, with_residual):
    kernels = built_kernels(64)
    gen = torch.Generator().manual_seed(rows)
    plain = RMSNorm(576, 1e-5).bfloat16()
    with torch.no_grad():
        plain.weight.copy_(torch.rand(576, generator=gen) * 2)
    wide = (torch.randn(rows, 2 * 576, generator=gen) * 3).bfloat16()
    x = wide[:, 576:]  # a strided view, as a slice of a wider activation would be
    residual = (torch.randn(rows, 576, generator=gen) * 3).bfloat16() if with_residual else None

    if with_residual:
        want, want_residual = plain(x, residual.clone())
    else:
        want = plain(x)
    fused = RMSNorm(576, 1e-5).bfloat16()
    fused.load_state_dict(plain.state_dict())
    fused.fused = kernels.add_rms_norm
    if with_residual:
        got, got_residual = fused(x, residual)
        assert got_residual is residual and torch.equal(residual, want_residual)
    else:
        got = fused(x)
    # Only the float32 sum of squares is ordered differently: at most one bfloat16 step apart,
    # and on few elements.
    differ = got != want
    assert differ.float().mean() < 0.02
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_silu_mul_matches_pytorch(rows):
    kernels = built_kernels(64)
    gen = torch.Generator().manual_seed(rows)
    inter = 1536
    wide = (torch.randn(rows, 3 * inter, generator=gen) * 4).bfloat16()
    gate_up = wide[:, inter:]  # strided rows, as a slice of a wider activation would be
    gate, up = gate_up.split(inter, dim=-1)
    want = F.silu(gate) * up

    got = kernels.silu_mul(gate_up)

    assert got.data_ptr() == gate_up.data_ptr()  # written over the gate
    # Only float32 exp/division can round apart from PyTorch's, rarely: one bfloat16 step in
    # SiLU, which the product's own rounding can take to two.
    assert (got != want).float().mean() < 0.01
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=1e-30)


def test_kernel_only_where_it_applies(monkeypatch):
    cpu = torch.device("cpu")
    assert cpu_kernels(cpu, torch.float32, 64) is None
    assert cpu_kernels(cpu, torch.bfloat16, 96) is None
    monkeypatch.setenv("CONVEYOR_CPU_KERNELS", "off")
    assert cpu_kernels(cpu, torch.bfloat16, 64) is None


@pytest.mark.parametrize("heads,kv_heads,dim,tokens", [(9, 3, 64, 1), (9, 3, 64, 37),
                                                      (32, 8, 128, 5)])
def test_rope_kv_write_matches_apply_rope_and_write_kv(heads, kv_heads, dim, tokens):
    kernels = built_kernels(dim)
    config = ModelConfig(architecture="llama", vocab_size=8, hidden_size=heads * dim,
                         intermediate_size=8, num_layers=1, num_heads=heads,
                         num_kv_heads=kv_heads, head_dim=dim, rms_norm_eps=1e-5,
                         rope_theta=10000.0, rope_scaling=None, max_position_embeddings=512,
                         tie_word_embeddings=True, attention_bias=False, qk_norm=False,
                         torch_dtype=None)
    cos, sin = rope_tables(config, 512, torch.bfloat16, torch.device("cpu"))
    gen = torch.Generator().manual_seed(tokens)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    # q, k, v as the model has them: views of one fused projection's output
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen) * 4).bfloat16()
    slots = torch.randperm(8 * 16, generator=gen)[:tokens]
    caches = [torch.zeros(8, 16, kv_heads, dim, dtype=torch.bfloat16) for _ in range(4)]

    qk_ref = apply_rope(qkv[:, :heads + kv_heads], cos, sin)
    write_kv(qk_ref[:, heads:], qkv[:, heads + kv_heads:], caches[0], caches[1], slots)
    qk = qkv[:, :heads + kv_heads]
    kernels.rope_kv_write(qk, qkv[:, heads + kv_heads:], cos, sin, slots, caches[2], caches[3])

    assert torch.equal(qk, qk_ref)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


def quant_kernel():
    kernels = built_kernels(64)
    if kernels.quant_linear is None:
        pytest.skip("this CPU lacks AVX-512 BF16: the model keeps its bfloat16 linears")
    return kernels.quant_linear


@pytest.fixture(params=["AMX", "FMA"])
def block_kernel(request):
    """The block linear with AMX (where the machine has it) and with AVX-512 FMAs. The switch is
    the process's: the decode attention's scores follow it too."""
    kernel = quant_kernel()
    if request.param == "AMX":
        kernel.set_amx(True)
        if not kernel.amx:
            pytest.skip("no AMX here (CPU, compiler or kernel)")
    else:
        kernel.set_amx(False)
    yield kernel
    kernel.set_amx(True)


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
                                   gguf.GGMLQuantizationType.Q8_0])
@pytest.mark.parametrize("n, k", [(96, 160), (40, 64)])  # AMX: strips of 32 rows, the last partial
def test_quant_linear_reads_the_loaders_bf16_weights(block_kernel, qtype, n, k):
    kernel = block_kernel
    gen = np.random.default_rng(int(qtype))
    # Scales spanning several binades, so the float32 d * q + m often needs rounding.
    w = (gen.standard_normal((n, k)) * np.exp(gen.uniform(-4, 2, (n, 1)))).astype(np.float32)
    blocks = gguf.quants.quantize(w, qtype)
    weight = QuantizedWeight.from_gguf(int(qtype), blocks)
    # What the loader makes of these blocks (numpy dequantization, then bfloat16).
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(n, k)).bfloat16()

    # One-hot rows read single weights out: equal bit for bit (the FMA kernel takes 8 rows a
    # call; AMX takes up to 32 a column of blocks at a time, and more a strip at a time).
    for chunk in (32, k) if kernel.amx else (8,):
        for start in range(0, k, chunk):
            rows = min(chunk, k - start)
            x = torch.zeros(rows, k, dtype=torch.bfloat16)
            x[torch.arange(rows), start + torch.arange(rows)] = 1
            assert torch.equal(kernel(x, weight), expected[:, start:start + rows].T)

    # Random rows (strided, as a slice of a wider activation) and a bias: F.linear's result up
    # to the order of the float32 sum. With AMX: partial tiles of 16 rows and pairs of them.
    row_counts = (1, 2, 5, 16, 17, 33, 70) if kernel.amx else (1, 2, 5)
    wide = torch.randn(max(row_counts), k + 32, dtype=torch.bfloat16)
    x = wide[:, 16:16 + k]
    bias = torch.randn(n, dtype=torch.bfloat16)
    for rows in row_counts:
        got = kernel(x[:rows], weight, bias).float()
        want = F.linear(x[:rows].float(), expected.float(), bias.float())
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-2)
    if not kernel.amx:
        with pytest.raises(ValueError):
            kernel(torch.randn(9, k, dtype=torch.bfloat16), weight)


def test_linear_reads_blocks_only_up_to_max_rows(block_kernel):
    kernel = block_kernel
    qtype = gguf.GGMLQuantizationType.Q4_1
    w = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    blocks = gguf.quants.quantize(w, qtype)
    linear = Linear(128, 64, bias=False).bfloat16()
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))
    linear.prepack()
    linear.quantized = QuantizedWeight.from_gguf(int(qtype), blocks)
    spy = mock.Mock(wraps=kernel)
    spy.max_rows = kernel.max_rows
    linear.quant_linear = spy
    x = torch.randn(kernel.max_rows + 1, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        for rows in (1, kernel.max_rows, kernel.max_rows + 1):
            torch.testing.assert_close(linear(x[:rows]).float(),
                                       F.linear(x[:rows], linear.weight).float(),
                                       rtol=2 ** -7, atol=1e-2)
    assert spy.call_count == 2  # 1 and max_rows rows; one more goes to the prepacked matmul


def test_decode_stack_matches_the_layers(monkeypatch, default_gguf_path):
    """Each step, the prompts' (their tokens as queries of their own, causal by context length)
    and then a few decodes', runs through both the one-call stack and the layers one by one, on
    the same inputs: the same hidden states up to rare one-step bfloat16 differences (SiLU's
    float32 exp and division, as C and PyTorch compute them, can round apart)."""
    quant_kernel()
    from conveyor import LLM, SamplingParams
    from conveyor.model.model import Transformer

    llm = LLM(model=default_gguf_path, dtype="bfloat16", max_num_seqs=8)
    assert llm.engine.runner.model.decode_stack is not None
    forward, compared = Transformer.forward, []

    def both(self, input_ids, cos, sin, kv_caches, meta):
        stack = self.decode_stack
        ours = forward(self, input_ids, cos, sin, kv_caches, meta)
        self.decode_stack = None  # the layers rewrite this token's K/V before reading them
        layers = forward(self, input_ids, cos, sin, kv_caches, meta)
        self.decode_stack = stack
        if not meta.prefills:
            compared.append((ours.float(), layers.float()))
        return layers

    monkeypatch.setattr(Transformer, "forward", both)
    # Six decodes a step: past the FMA kernel's first rows, so AMX runs the stack's linears
    # where the machine has it.
    llm.generate(["The capital of France is", "Once upon a time", "def f(x):", "1, 2, 3,",
                  "Water boils at", "import numpy as"],
                 SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert len(compared) == 10 and len(compared[0][0]) > 6  # the prompts' step, then decodes
    differing = []
    for ours, layers in compared:
        diff = (ours - layers).abs()
        assert diff.max() <= layers.abs().max() * 2 ** -6
        differing.append((diff > 0).float().mean().item())
    assert sum(differing) / len(differing) < 0.2
    assert differing.count(0.0) >= len(differing) // 2


def test_prompt_tokens_as_queries_match_sdpa(monkeypatch, default_gguf_path):
    """Short prompts' tokens through the decode kernel, each a query of its own (one call of
    the decode stack), and through SDPA (the layers one by one): the same next tokens, and
    log-probabilities within bfloat16's reach."""
    quant_kernel()
    from conveyor import LLM, SamplingParams
    from conveyor.model import runner
    from conveyor.model.model import Transformer

    llm = LLM(model=default_gguf_path, dtype="bfloat16", enable_prefix_caching=False)
    forward, with_prefills = Transformer.forward, []

    def spy(self, input_ids, cos, sin, kv_caches, meta):
        with_prefills.append(bool(meta.prefills))
        return forward(self, input_ids, cos, sin, kv_caches, meta)

    monkeypatch.setattr(Transformer, "forward", spy)
    prompts = ["The capital of France is", "Once upon a time, in a land far away,",
               "def fibonacci(n):", "Water boils at a temperature of"]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=3)
    outputs = {}
    for mode, work in (("queries", runner.UNIFIED_CHUNK_WORK), ("sdpa", 0)):
        monkeypatch.setattr(runner, "UNIFIED_CHUNK_WORK", work)
        with_prefills.clear()
        outputs[mode] = llm.generate(prompts, params, use_tqdm=False)
        assert with_prefills == [mode == "sdpa"]
    for ours, theirs in zip(outputs["queries"], outputs["sdpa"]):
        a, b = ours.outputs[0], theirs.outputs[0]
        assert a.token_ids == b.token_ids
        for tid, lp in a.logprobs[0].items():
            if tid in b.logprobs[0]:
                assert abs(lp.logprob - b.logprobs[0][tid].logprob) < 0.1


def test_argmax_rows_finds_the_first_maximum():
    argmax = built_kernels(64).argmax_rows
    gen = torch.Generator().manual_seed(0)
    for cols in (1, 15, 16, 17, 49152 + 5):
        # Few distinct values, so most rows have their maximum more than once.
        x = torch.randint(-3, 4, (9, cols + 8), generator=gen).float()[:, 3:3 + cols]
        x[0] = float("-inf")  # every logit masked: index 0, as torch
        x[1, -1] = 100.0      # the maximum in the last, partial vector
        assert torch.equal(argmax(x), x.argmax(dim=-1))


def test_head_reads_its_blocks_up_to_a_few_rows(block_kernel, default_gguf_path):
    """The tied head (SmolLM2's Q8_0 embedding) through the block kernel at a few rows and the
    prepacked bfloat16 matmul past them: both the bfloat16 head's logits up to the order of the
    float32 sums."""
    from conveyor import LLM

    model = LLM(model=default_gguf_path, dtype="bfloat16", max_num_seqs=4).engine.runner.model
    assert model.output is None and model.head_blocks is not None
    kernel = model.head_kernel = mock.Mock(wraps=block_kernel)
    kernel.max_rows = block_kernel.max_rows
    few = min(model.HEAD_BLOCK_ROWS, block_kernel.max_rows)
    hidden = torch.randn(few + 1, model.config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        for rows in (1, few, few + 1):
            want = F.linear(hidden[:rows].float(), model.tok_embeddings.weight.float())
            torch.testing.assert_close(model.compute_logits(hidden[:rows]), want,
                                       rtol=2 ** -7, atol=2e-2)
    assert kernel.call_count == 2  # 1 and `few` rows; one more goes to the prepacked head
