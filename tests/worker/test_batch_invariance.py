"""Batch invariance (``batch_invariant``): a request's tokens and logprobs, greedy and seeded,
are the same alone, in a batch of 31 others that come and go, with its prompt chunked at three
token budgets, and with its prefix from the cache, at the machine's tier in its default dtype
and at the avx2 tier (float32). The kernels' own test is test_cpu_kernels's
``test_invariant_linear_...``; the plain-C tier's linear sums each row in its own order by
construction, and its whole-model runs are too slow for the suite."""

from __future__ import annotations

import random

import pytest
import torch
from engine_checks import assert_no_leak

from tiny_models import make_tiny_checkpoint

from conveyor import LLM, SamplingParams
from conveyor.config import EngineConfig
from conveyor.kernels import isa
from conveyor.model.model import Linear

TIERS = sorted({isa.current().detected, "avx2"} & set(
    isa.TIERS[isa.TIERS.index("avx2"):isa.TIERS.index(isa.current().detected) + 1]))
pytestmark = pytest.mark.skipif(not TIERS, reason="no vectorised tier on this CPU")

TARGET = ("In a quiet harbour town the fishing boats come home at dusk, and the keeper of the "
          "lighthouse writes down the name of every boat that passes under the lamp, because")
PARAMS = [SamplingParams(temperature=0, max_tokens=12, logprobs=2),
          SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=12, logprobs=2)]
WORDS = ("river stone lamp winter market song bread tower garden letter window engine "
         "mountain silver morning paper").split()


def others(count: int = 31) -> tuple[list[str], list[SamplingParams]]:
    """Prompts of 3-60 words that finish after 1-20 tokens, so the batch changes every few
    steps around the target."""
    gen = random.Random(0)
    prompts = [" ".join(gen.choices(WORDS, k=gen.randint(3, 60))) for _ in range(count)]
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=gen.randint(1, 20))
              for i in range(count)]
    return prompts, params


def answer(out) -> tuple:
    """The completion's tokens and, at each, the logprobs (value and rank) of its top tokens."""
    c = out.outputs[0]
    return c.token_ids, [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in c.logprobs]


def alone(llm: LLM) -> list[tuple]:
    return [answer(llm.generate([TARGET], p, use_tqdm=False)[0]) for p in PARAMS]


def in_batch(llm: LLM) -> list[tuple]:
    prompts, params = others()
    outs = llm.generate(prompts[:15] + [TARGET] * 2 + prompts[15:],
                        params[:15] + PARAMS + params[15:], use_tqdm=False)
    return [answer(outs[15]), answer(outs[16])]


@pytest.fixture(params=TIERS)
def tier(request, monkeypatch):
    """The engine's kernels, and its default dtype, at this tier."""
    choice = isa.choose(requested=request.param)
    monkeypatch.setattr(isa, "current", lambda: choice)
    return choice


def check_invariance(**model) -> None:
    """The target alone, again with its prefix cached, in a batch with it cached, then chunked
    at three budgets without the cache (the last also in a batch): the same answers."""
    base = dict(batch_invariant=True, num_kv_blocks=256, max_model_len=512, **model)
    cached = LLM(**base)
    reference = alone(cached)  # computed fresh, then its pages are cached
    assert all(len(tokens) == 12 for tokens, _ in reference)
    assert alone(cached) == reference, "its prefix from the cache"
    assert in_batch(cached) == reference, "in a batch, its prefix from the cache"
    assert_no_leak(cached)
    for budget in (8, 19, 64):
        llm = LLM(**base, enable_prefix_caching=False, max_num_batched_tokens=budget,
                  max_num_seqs=min(budget, 32))
        assert alone(llm) == reference, f"chunks of {budget} tokens"
        if budget == 64:
            assert in_batch(llm) == reference, "in a batch of 31 others"
        assert_no_leak(llm)


def test_a_request_is_the_same_whatever_its_batch_chunks_and_cache(tier):
    """The default model: GGUF blocks, the decode stack for every step."""
    assert LLM(num_kv_blocks=16, max_model_len=64).engine.dtype == (
        torch.bfloat16 if tier.native_bf16 else torch.float32)
    check_invariance()


def test_dense_weights_are_invariant_too(tmp_path):
    """A Hugging Face folder at the machine's tier. With bfloat16 arithmetic: dense weights
    (prepacked for oneDNN in bfloat16) and a tied dense head, a fixed number of rows a matmul;
    no decode stack. Without it (float32) no weight is dense: the F32 block kernel reads them
    all, the decode stack included."""
    # SmolLM2's widths (at 128 wide, oneDNN's bfloat16 rows came out the same without the fixed
    # shapes; at these they do not)
    folder = make_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=True, hidden_size=576,
                                  intermediate_size=1536, num_attention_heads=9,
                                  num_key_value_heads=3)
    dense = isa.current().native_bf16
    dtype = "bfloat16" if dense else "float32"
    llm = LLM(folder, batch_invariant=True, num_kv_blocks=16, max_model_len=64, dtype=dtype)
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if dense:
        assert model.decode_stack is None and model.head_rows_a_call is not None
        assert all(m.rows_a_call for m in linears)
    else:
        assert model.decode_stack is not None and all(m.quantized is not None for m in linears)
    del llm
    check_invariance(model=folder, dtype=dtype)


def test_batch_invariance_is_refused_where_it_cannot_hold(monkeypatch):
    with pytest.raises(ValueError, match="activation-quant"):
        EngineConfig(batch_invariant=True, activation_quant="int8")
    monkeypatch.setenv("CONVEYOR_CPU_KERNELS", "off")
    with pytest.raises(ValueError, match="batch_invariant needs the CPU kernels"):
        LLM(batch_invariant=True, num_kv_blocks=16, max_model_len=64)
