"""Tensor parallelism over torch.distributed (gloo, local processes): the shard plan, greedy
tokens with 2 ranks equal to 1 rank's (float32; dense and mixtures of experts), the
all-reduces a step makes and torchrun's launch (the server on 2 ranks:
tests/server/test_server_two_ranks.py)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cli_output import error_lines
from conveyor import LLM, SamplingParams
from conveyor.kernels.blocks import QuantizedWeight
from conveyor.model.config import ModelConfig, MoE
from conveyor.model.gguf_tokenizer import load_gguf_tokenizer
from conveyor.process import free_port
from conveyor.worker.sharding import _slice_blocks, kv_heads_per_rank, plan_shards

from equivalence import random_prompts, run_conveyor, text_prompts
from tiny_models import EXPERT_MIX, TINY_VOCAB, Q, make_tiny_model, write_gguf

SMOLLM2 = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 1e4, None, 2048, True,
                      False, False, None)


def config(heads: int, kv_heads: int, intermediate: int) -> ModelConfig:
    return ModelConfig("llama", 100, 64, intermediate, 2, heads, kv_heads, 16, 1e-5, 1e4, None,
                       64, False, False, False, None)


# -- the plan ----------------------------------------------------------------------------------
def moe_config(intermediate: int, shared: int = 0, **overrides) -> ModelConfig:
    return dataclasses.replace(config(4, 2, 64), **{"architecture": "qwen2_moe", **overrides},
                               moe=MoE(experts=8, used=2, intermediate=intermediate,
                                       norm_topk=False, shared_intermediate=shared))


def test_olmoes_whole_projection_norms_are_refused_on_two_ranks():
    """(a norm over all heads' q or k would need every rank's heads)"""
    with pytest.raises(ValueError, match="not implemented for olmoe's q/k norms"):
        plan_shards(moe_config(64, architecture="olmoe", qk_norm_whole=True), 2)


def test_experts_too_narrow_for_the_ranks_are_refused():
    """One block of 256 features cannot be cut between 2 ranks: refused, not left empty."""
    with pytest.raises(ValueError, match="cannot be divided among 2"):
        plan_shards(moe_config(256), 2, 256)
    with pytest.raises(ValueError, match="cannot be divided among 2"):
        plan_shards(moe_config(512, shared=32), 2, 256, 32)


@given(units=st.integers(2, 16), shared_units=st.sampled_from([0, 2, 3, 16]),
       ranks=st.integers(1, 2),
       granule=st.sampled_from([1, 32, 256]), shared_granule=st.sampled_from([1, 32, 256]))
def test_every_expert_feature_has_its_rank(units, shared_units, ranks, granule, shared_granule):
    """Each expert's features (the same cut for every expert) and the shared expert's, each on
    one rank, cut at their granules, the ranks' shares even to one unit where heads are."""
    c = moe_config(units * granule, shared_units * shared_granule)
    shards = plan_shards(c, ranks, granule, shared_granule)
    for part, size, g in (("ffn", c.moe.intermediate, granule),
                          ("shared", c.moe.shared_intermediate, shared_granule)):
        ranges = [getattr(s, part) for s in shards]
        assert [f for r in ranges for f in r] == list(range(size))
        assert all(r.start % g == 0 for r in ranges)
    sizes = [len(s.ffn) for s in shards]
    assert max(sizes) - min(sizes) <= granule


@given(kv_heads=st.integers(1, 8), group=st.integers(1, 4), ranks=st.integers(1, 8),
       units=st.integers(1, 64), granule=st.sampled_from([1, 32, 256]))
def test_every_head_and_feature_has_its_ranks(kv_heads, group, ranks, units, granule):
    c = config(kv_heads * group, kv_heads, units * granule)
    share = max(1, ranks // kv_heads)
    if kv_heads < ranks and (ranks % kv_heads or group % share):
        with pytest.raises(ValueError, match="cannot be divided"):
            plan_shards(c, ranks, granule)
        return
    shards = plan_shards(c, ranks, granule)
    q = sorted(h for s in shards for h in s.q_heads)
    assert q == list(range(c.num_heads))  # each query head on exactly one rank
    for s in shards:  # a rank's query heads are those of its KV heads
        assert {h // group for h in s.q_heads} <= set(s.kv_heads)
    kv = sorted(h for s in shards for h in s.kv_heads)
    assert kv == sorted(list(range(kv_heads)) * share)  # replicated only when too few
    assert [r.start for r in (s.ffn for s in shards)][0] == 0
    assert all(a.ffn.stop == b.ffn.start for a, b in zip(shards, shards[1:]))
    assert shards[-1].ffn.stop == c.intermediate_size
    assert all(s.ffn.start % granule == 0 for s in shards)
    assert kv_heads_per_rank(c, ranks) == [len(s.kv_heads) for s in shards]
    vocab = [v for s in shards for v in s.vocab]  # the head's rows, in order, once each
    assert vocab == list(range(c.vocab_size))


def test_uneven_heads_are_evened_by_the_feed_forward():
    """SmolLM2-135M: 3 KV heads over 2 ranks hold 1 and 2; the feed-forward evens them."""
    first, second = plan_shards(SMOLLM2, 2, 32)
    assert (len(first.kv_heads), len(second.kv_heads)) == (1, 2)
    assert (len(first.q_heads), len(second.q_heads)) == (3, 6)
    assert (len(first.ffn), len(second.ffn)) == (864, 672)

    def elements(s):
        return 2 * 576 * 64 * (len(s.q_heads) + len(s.kv_heads)) + 3 * 576 * len(s.ffn)

    assert abs(elements(first) - elements(second)) <= 3 * 576 * 32  # within one unit


def test_block_matrices_are_cut_along_whole_blocks():
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((8, 128)).astype(np.float32)
    q = QuantizedWeight.from_gguf(gguf.GGMLQuantizationType.Q8_0,
                                  gguf.quants.quantize(dense, gguf.GGMLQuantizationType.Q8_0))
    whole = gguf.quants.dequantize(q.blocks.numpy(), q.ggml_type)
    cols = _slice_blocks(q, 1, range(32, 96))
    np.testing.assert_array_equal(gguf.quants.dequantize(cols.blocks.numpy(), q.ggml_type),
                                  whole[:, 32:96])
    rows = _slice_blocks(q, 0, range(2, 5))
    np.testing.assert_array_equal(gguf.quants.dequantize(rows.blocks.numpy(), q.ggml_type),
                                  whole[2:5])
    assert _slice_blocks(q, 1, range(16, 64)) is None  # through a block: the matrix runs dense


# -- tokens: 2 ranks == 1 rank -----------------------------------------------------------------
def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def check_all_reduces(llm) -> None:
    """2 all-reduces a layer in every step that ran the model, of its tokens' float32 hidden
    states."""
    engine, tp = llm.engine, llm.engine.tensor_parallel
    layers, hidden = engine.model_config.num_layers, engine.model_config.hidden_size
    ran = [s for s in engine.steps if s.num_prefill_tokens + s.num_decode_tokens]
    assert tp.num_all_reduces == 2 * layers * len(ran)
    assert tp.all_reduce_bytes == 2 * layers * hidden * 4 * sum(
        s.num_prefill_tokens + s.num_decode_tokens for s in ran)


@pytest.fixture(scope="module")
def default_prompts(default_gguf_path) -> list[list[int]]:
    return text_prompts(load_gguf_tokenizer(default_gguf_path))[::2]  # 6 of 12: still preempts


@pytest.fixture(scope="module")
def one_rank(default_prompts):
    """1 rank's greedy tokens: the same under either policy (test_equivalence shows both equal
    transformers'), so computed once."""
    return tokens(run_conveyor(None, default_prompts, "continuous"))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_default_gguf_two_ranks_equal_one(default_prompts, one_rank, policy):
    two = run_conveyor(None, default_prompts, policy, tensor_parallel_size=2,
                       check=check_all_reduces)
    assert sum(o.metrics.num_preemptions for o in two) > 0, "the pool was meant to preempt"
    assert tokens(two) == one_rank


# (each policy on one of them: a 2-rank engine takes ~5 s to start here; the default GGUF
# above runs both)
@pytest.mark.parametrize("arch,policy", [("qwen2", "continuous"), ("qwen3", "static")])
def test_tiny_checkpoints_two_ranks_equal_one(tiny_checkpoint, arch, policy):
    path = tiny_checkpoint(arch)
    prompts = random_prompts(256)
    one = run_conveyor(path, prompts, policy)
    two = run_conveyor(path, prompts, policy, tensor_parallel_size=2)
    assert sum(o.metrics.num_preemptions for o in two) > 0
    assert tokens(two) == tokens(one)


@pytest.fixture(scope="module")
def qwen2_moe_gguf_path(tmp_path_factory) -> str:
    """A tiny Qwen2-MoE GGUF whose experts and shared expert (in llama.cpp's K-quant mix, the
    down projections' blocks of 256) are wide enough to cut between 2 ranks."""
    model = make_tiny_model("qwen2_moe", vocab_size=len(TINY_VOCAB), hidden_size=256,
                            head_dim=64, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512)
    path = tmp_path_factory.mktemp("moe") / "qwen2_moe.gguf"
    return write_gguf(str(path), model, tokenizer=True, sync=True,
                      types={**EXPERT_MIX, "ffn_gate_shexp": Q.Q4_K, "ffn_up_shexp": Q.Q8_0,
                             "ffn_down_shexp": Q.Q6_K, "attn_q": Q.Q8_0, "attn_k": Q.Q8_0,
                             "attn_v": Q.Q8_0, "attn_output": Q.Q8_0})


@pytest.mark.parametrize("source,policy", [("mixtral", "continuous"), ("gguf", "static")])
def test_mixtures_of_experts_two_ranks_equal_one(request, tiny_checkpoint, source, policy):
    """Every expert's features split between the ranks, the experts on their one-call kernel on
    each rank: a tiny HF Mixtral (96 features: 64 and 32) and a Qwen2-MoE GGUF (its experts
    and shared expert cut along their blocks)."""
    if source == "gguf":
        path, vocab, features = request.getfixturevalue("qwen2_moe_gguf_path"), len(TINY_VOCAB), 256
    else:
        path, vocab, features = tiny_checkpoint(source), 256, 64
    prompts = random_prompts(vocab)

    def check(llm):
        check_all_reduces(llm)
        for layer in llm.engine.runner.model.layers:  # (rank 0's shard)
            assert layer.feed_forward.kernel is not None
            assert all(e.intermediate == features for e in layer.feed_forward.experts)

    one = run_conveyor(path, prompts, policy)
    two = run_conveyor(path, prompts, policy, tensor_parallel_size=2, check=check)
    assert sum(o.metrics.num_preemptions for o in two) > 0
    assert tokens(two) == tokens(one)


# -- torchrun ----------------------------------------------------------------------------------
def test_torchrun_launches_the_same_command_on_every_rank(tiny_checkpoint):
    """``torchrun --nproc-per-node 2 -m conveyor.cli generate -tp 2``: rank 0 prints the text,
    rank 1 serves its steps; the text is one engine's."""
    path, prompt = tiny_checkpoint("llama"), "The capital of France is"
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64, max_model_len=256)
    text = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16),
                        use_tqdm=False)[0].outputs[0].text
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), "-m", "conveyor.cli", "generate",
                          "--model", path, "--dtype", "float32", "--max-tokens", "16",
                          "--num-kv-blocks", "64", "--max-model-len", "256", "-tp", "2",
                          prompt], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert two.returncode == 0, two.stderr[-3000:]
    assert f"--- {prompt!r}\n{text}\n[16 tokens" in two.stdout


def test_close_ends_the_groups_threads_whatever_is_imported_after_the_start():
    """A module that binds the world group at its import (torch.distributed.nn.functional, which
    transformers' loader imports) must not keep the group alive past close: its gloo threads,
    still freeing their last collective as the interpreter shut down, aborted ranks at exit."""
    script = f"""
import os, torch
from conveyor.worker.tensor_parallel import TensorParallel
group = TensorParallel(0, 1, "tcp://127.0.0.1:{free_port()}", torch.device("cpu"))
group.all_reduce(torch.ones(4))
import transformers.modeling_utils
group.close()
print(sorted(open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task")))
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "gloo" not in run.stdout, run.stdout


def test_a_model_the_shards_cannot_take_is_one_line_on_the_cli(tiny_checkpoint):
    """Every rank plans the same shards; rank 0 says why, the other ranks exit without a
    traceback of their own."""
    run = subprocess.run([sys.executable, "-m", "conveyor.cli", "generate", "--model",
                          tiny_checkpoint("olmoe"), "-tp", "2", "--max-tokens", "4", "Hello"],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert run.returncode == 2
    assert error_lines(run.stderr) == [
        "conveyor: error: tensor parallelism is not implemented for olmoe's q/k norms over all "
        "heads at once; run it with --tensor-parallel-size 1"], run.stderr[-3000:]
