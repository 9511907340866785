"""The narrow KV caches (``--kv-cache-dtype int8``, and float16 for a float32 model;
model/kv_cache.py): their rows' numerics, the pool they size, and the engine on them: the CPU
kernels and the PyTorch path read them alike, a prompt reads its own keys as the cache holds
them, and a request preempted or served from the prefix cache gives the same tokens (the
kernels' own tests: test_cpu_kernels's ``..._narrow_caches``)."""

from __future__ import annotations

import pytest
import torch
from engine_checks import assert_no_leak
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import LLM, SamplingParams
from conveyor.engine.engine import size_kv_pool
from conveyor.config import EngineConfig
from conveyor.model.kv_cache import (SCALE_BYTES, as_cached, dequantize, head_bytes,
                                     kv_storage, quantize, readable, stored)
from conveyor.model.loader import load_config

PROMPTS = ["The capital of France is", "Once upon a time, in a village by the sea,",
           "def fibonacci(n):", "The three primary colours are"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@settings(max_examples=60, deadline=None)
@given(dim=st.sampled_from([16, 64, 128]), size=st.floats(1e-3, 1e3), zero=st.booleans(),
       seed=st.integers(0, 2**16))
def test_a_row_comes_back_within_half_a_step(dim, size, zero, seed):
    x = torch.randn(3, dim, generator=torch.Generator().manual_seed(seed)) * size
    if zero:
        x[1] = 0
    rows = quantize(x.to(torch.bfloat16))
    assert rows.dtype == torch.int8 and rows.shape == (3, dim + SCALE_BYTES)
    x = x.to(torch.bfloat16).float()
    step = x.abs().amax(-1, keepdim=True) / 127
    back = dequantize(rows, torch.float32)
    assert ((back - x).abs() <= step * 0.5001 + 1e-30).all()
    assert rows[:, :dim].abs().max() <= 127
    if zero:
        assert not rows[1].any()
    assert readable(rows, torch.float32).equal(back) and readable(x, torch.float32) is x


def test_the_storage_follows_the_flag():
    assert kv_storage("auto", torch.bfloat16) == torch.bfloat16
    assert kv_storage("float32", torch.float32) == torch.float32
    assert kv_storage("int8", torch.float32) == torch.int8
    assert kv_storage("float16", torch.float32) == torch.float16
    assert kv_storage("auto", torch.float32, half_default=True) == torch.float16
    assert kv_storage("auto", torch.bfloat16, half_default=True) == torch.bfloat16
    assert kv_storage("float32", torch.float32, half_default=True) == torch.float32
    with pytest.raises(ValueError, match="or a float32 one"):
        kv_storage("float16", torch.bfloat16)
    with pytest.raises(ValueError, match="needs a bfloat16 model"):
        kv_storage("bfloat16", torch.float32)
    with pytest.raises(ValueError, match="not one of"):
        kv_storage("fp8", torch.float32)
    assert head_bytes(64, torch.int8) == 68 and head_bytes(64, torch.bfloat16) == 128
    assert head_bytes(64, torch.float16) == 128 and head_bytes(64, torch.float32) == 256


@settings(max_examples=30, deadline=None)
@given(storage=st.sampled_from([torch.int8, torch.float16, torch.float32]),
       seed=st.integers(0, 2**16))
def test_a_prompt_reads_its_keys_as_the_cache_holds_them(storage, seed):
    x = torch.randn(5, 2, 64, generator=torch.Generator().manual_seed(seed)) * 3
    back = as_cached(x, storage)
    assert back.dtype == x.dtype and back.equal(readable(stored(x, storage), x.dtype))
    assert (back is x) == (storage == torch.float32)
    if storage == torch.float16:  # what the cache holds, it holds exactly (int8 rescales)
        assert back.equal(as_cached(back, storage))


def test_the_pool_holds_the_pages_its_memory_allows(default_gguf_path):
    """The same memory holds 128/68 as many SmolLM2 pages in int8 as in bfloat16."""
    model = load_config(default_gguf_path)
    config = EngineConfig(kv_cache_memory="64MiB")
    wide = size_kv_pool(config, model, torch.bfloat16, torch.device("cpu"))
    narrow = size_kv_pool(config, model, torch.int8, torch.device("cpu"))
    page = 2 * model.num_layers * 16 * model.num_kv_heads
    assert wide.num_blocks == 64 * 2**20 // (page * 128)
    assert narrow.num_blocks == 64 * 2**20 // (page * 68)
    assert narrow.num_blocks / wide.num_blocks > 1.85


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("storage", ["int8", "float16"])
def test_the_kernels_and_the_pytorch_path_read_it_alike(default_gguf_path, monkeypatch, storage):
    """float32, greedy: the C kernels (rope + quantized or rounded write, decode attention on
    the narrow rows) and the PyTorch path (quantize or round, gather and widen, SDPA) give the
    same tokens, with the pool's pages all back after."""
    common = dict(model=default_gguf_path, dtype="float32", kv_cache_dtype=storage,
                  activation_quant="none", num_kv_blocks=64, max_model_len=256)
    kernels = LLM(**common)
    assert kernels.engine.runner.decode_kernel is not None
    assert kernels.engine.runner.kv_caches[0][0].dtype == getattr(torch, storage)
    ours = tokens(kernels.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert_no_leak(kernels)
    del kernels
    monkeypatch.setenv("CONVEYOR_CPU_KERNELS", "off")
    plain = LLM(**common)
    assert plain.engine.runner.decode_kernel is None
    assert tokens(plain.generate(PROMPTS, GREEDY, use_tqdm=False)) == ours


@pytest.mark.parametrize("storage", ["int8", "float16"])
def test_preempted_and_cached_requests_give_the_same_bits(storage):
    """Under --batch-invariant every token reads its keys as the cache holds them, so a request
    whose pages were taken back (preemption: a pool of 7 pages for 4 requests of 3) or whose
    prompt came from the prefix cache answers as it did alone."""
    common = dict(kv_cache_dtype=storage, batch_invariant=True, max_model_len=96,
                  **({"dtype": "float32"} if storage == "float16" else {}))
    roomy = LLM(**common, num_kv_blocks=128)
    alone = [tokens(roomy.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS]
    assert tokens(roomy.generate(PROMPTS, GREEDY, use_tqdm=False)) == alone  # cached prefixes
    assert_no_leak(roomy)
    del roomy
    tight = LLM(**common, num_kv_blocks=7, enable_prefix_caching=False)
    outs = tight.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the pool was meant to preempt"
    assert tokens(outs) == alone
    assert_no_leak(tight)
