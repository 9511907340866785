"""Greedy output must match Hugging Face transformers token for token (float32).

Where a token differs, it only counts as a numerical tie if transformers' own top-2 logits at that
step are within 1e-4; the rest of that sequence is then not compared (it follows another path).
In bfloat16 (the serving dtype, where the CPU decode kernel runs) the first tokens must agree with
transformers in bfloat16, with a tie allowance of bfloat16's resolution at the logits' scale.
Both policies run with a KV pool small enough that preemption happens, and a token budget small
enough that the longest prompts are prefilled in chunks. The continuous policy runs at every CPU
kernel tier this machine can execute and on the plain PyTorch path (``CONVEYOR_CPU_KERNELS=off``);
the static policy at the machine's own tier.
"""

from __future__ import annotations


import gguf
import pytest
import torch

from conveyor import LLM
from conveyor.config import EngineConfig
from conveyor.kernels import bindings, isa
from conveyor.worker.decode_graphs import DecodeGraphs, padded_size

from equivalence import (BF16_TIE, BF16_TOKENS, check_model, compare, reference,
                         run_conveyor)
from tiny_models import EXPERT_MIX


NATIVE = isa.current().detected
RUNNABLE = isa.TIERS[:isa.TIERS.index(NATIVE) + 1]
# (path, policy): the continuous policy on every path, the static one on the machine's own.
PATHS = [pytest.param(p, "continuous", id=f"{p}-continuous") for p in (*RUNNABLE, "pytorch")] + [
    pytest.param(NATIVE, "static", id=f"{NATIVE}-static")]


@pytest.fixture
def on_path(monkeypatch):
    """Run the engine as on a CPU of the given tier, or on the plain PyTorch path."""

    def use(path: str) -> None:
        if path == "pytorch":
            monkeypatch.setenv("CONVEYOR_CPU_KERNELS", "off")
        else:
            monkeypatch.setenv(isa.ENV, path)
        isa.current.cache_clear()

    yield use
    monkeypatch.undo()
    isa.current.cache_clear()


@pytest.mark.slow
@pytest.mark.parametrize("path,policy", PATHS)
def test_default_gguf_matches_transformers(default_gguf_path, on_path, path, policy):
    on_path(path)
    # The plain-C and PyTorch paths take 3-20x the fast tiers' time: a quarter of the prompts.
    check_model("gguf", default_gguf_path, policy, 4 if path in ("generic", "pytorch") else 1)


@pytest.mark.slow
@pytest.mark.skipif(not isa.current().native_bf16, reason="this CPU has no bfloat16 arithmetic")
@pytest.mark.parametrize("max_num_seqs", [12, 1], ids=["batched", "alone"])
def test_default_gguf_bf16_first_tokens_match_transformers(default_gguf_path, max_num_seqs):
    """Alone, the CPU path reads the layers' linears from the GGUF's blocks (QuantLinear)."""
    prompts, refs = reference("gguf", default_gguf_path, "bfloat16", BF16_TOKENS)
    outputs = run_conveyor(None, prompts, "continuous", "bfloat16", BF16_TOKENS, max_num_seqs)
    identical = [compare(o.outputs[0].token_ids, *ref, BF16_TIE) for o, ref in zip(outputs, refs)]
    print(f"bf16, {max_num_seqs} at once: {sum(identical)}/{len(identical)} identical over "
          f"{BF16_TOKENS} tokens")


def phi3_longrope(pairs: int) -> dict:
    """LongRoPE over `pairs` rotated pairs, pretrained at 4096 of 8192 positions."""
    return {"max_position_embeddings": 8192, "original_max_position_embeddings": 4096,
            "rope_scaling": {"rope_type": "longrope",
                             "short_factor": [1.0 + i / pairs for i in range(pairs)],
                             "long_factor": [2.0 + 6 * i / pairs for i in range(pairs)]}}



TINY = {
    "llama": ("llama", {}),
    "llama-bf16": ("llama", {"dtype": torch.bfloat16}),  # the kernels read its bfloat16 rows
    "qwen2-fp16": ("qwen2", {"dtype": torch.float16}),
    "llama3-rope-tied": ("llama", {"rope_scaling": "llama3", "tie_word_embeddings": True}),
    # a short pretrained length, so that the ramp between kept and interpolated dimensions
    # falls inside the tiny head; the attention factor scales every score
    "qwen2-rope-yarn": ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 64}}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {}),
    # Phi-4-mini's rope: half of each head rotated, LongRoPE (its short factors, as the served
    # length is within the pretrained one; the attention factor from 8192 / 4096)
    "phi3-partial-longrope": ("phi3", {"partial_rotary_factor": 0.5, **phi3_longrope(4)}),
    # LongRoPE pretrained at 32 of 256 positions: prompts of 5-90 tokens on both sides of it and
    # answers that cross it, so tokens take the short factors, the long ones, or first the one
    # and then the other (transformers' switch), cached and preempted
    "phi3-longrope-switch": ("phi3", {**phi3_longrope(8), "max_position_embeddings": 256,
                                      "original_max_position_embeddings": 32}),
    # sliding windows shorter than the prompts and answers (5-90 tokens, then 40), across pages
    # of 16: every layer's (Mistral), from the second layer on (Qwen2), every other (Gemma 2),
    # the first of two with its own rope (Gemma 3)
    "mistral-window": ("mistral", {"sliding_window": 24}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 20,
                              "max_window_layers": 1}),
    "gemma2": ("gemma2", {"sliding_window": 24}),
    "gemma3": ("gemma3", {"sliding_window": 24}),
    "gemma3-bf16": ("gemma3", {"sliding_window": 24, "dtype": torch.bfloat16}),  # 1 + w of it
    "smollm3": ("smollm3", {}),  # its fourth layer without rope
    # mixtures of experts (8, 2 a token): Mixtral's renormalised weights, Qwen2-MoE's shared
    # expert and q/k/v biases, Qwen3-MoE's q/k norms, OLMoE's norms over whole projections
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "olmoe": ("olmoe", {}),
    "qwen3_moe-bf16": ("qwen3_moe", {"dtype": torch.bfloat16}),
}


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    from tiny_models import LLAMA3_ROPE_SCALING, make_tiny_checkpoint

    paths = {}
    for name, (arch, overrides) in TINY.items():
        if overrides.get("rope_scaling") == "llama3":
            overrides = dict(overrides, rope_scaling=LLAMA3_ROPE_SCALING)
        paths[name] = make_tiny_checkpoint(tmp_path_factory.mktemp(name), arch, **overrides)
    return paths


# A cross, not a product. Every checkpoint runs on this CPU's tier and on the PyTorch path. The
# tiers below (each kernel of which test_cpu_kernels checks against PyTorch) run the checkpoints
# that reach every kind of kernel call: float32, bfloat16 and float16 rows, q/k norms and a
# head_dim of its own, partial rotary, windows with a local rope, soft caps. The static policy,
# a scheduling matter, runs on the GGUF models (above and below), not on each checkpoint.
LOWER_TIERS_TINY = ("llama", "llama-bf16", "qwen2-fp16", "qwen3", "phi3-partial-longrope",
                    "phi3-longrope-switch", "gemma2", "gemma3", "qwen2_moe", "qwen3_moe")
TINY_RUNS = [pytest.param(name, *path.values, id=f"{name}-{path.id}") for name in TINY
             for path in PATHS if path.values[1] == "continuous"
             and (path.values[0] in (NATIVE, "pytorch") or name in LOWER_TIERS_TINY)]


@pytest.mark.parametrize("name,path,policy", TINY_RUNS)
def test_tiny_checkpoints_match_transformers(tiny_paths, on_path, name, path, policy):
    on_path(path)
    check_model("hf", tiny_paths[name], policy)


# FlexAttention (the GPU path, unfused here) on checkpoints with windows (Gemma 2's every other
# layer, with soft caps), partial rotary, q/k norms and experts
FLEX_TINY = ("llama", "gemma2", "mistral-window", "phi3-partial-longrope", "qwen3_moe")


@pytest.mark.parametrize("name,graphs", [(name, False) for name in FLEX_TINY] + [
    (name, True) for name in FLEX_TINY if "moe" not in name])  # (experts decode eagerly)
def test_flex_attention_matches_transformers(tiny_paths, monkeypatch, name, graphs):
    """With decode graphs as on CUDA (captured there; here the same padded buffers run
    eagerly): a decode step is padded up the ladder, its padding rows on the scratch page."""
    padded = []
    if graphs:
        monkeypatch.setattr(EngineConfig, "decode_graphs", lambda self, device: True)
        run = DecodeGraphs.run

        def counted(self, plan):
            hidden = run(self, plan)
            if hidden is not None:
                padded.append(padded_size(len(plan.ids), self.sizes) - len(plan.ids))
            return hidden

        monkeypatch.setattr(DecodeGraphs, "run", counted)
    check_model("hf", tiny_paths[name], "continuous", attention_backend="FLEX_ATTENTION")
    if graphs:
        assert padded and max(padded) > 0, "no decode step was padded"


@pytest.mark.parametrize("settings", [{"kv_cache_dtype": "int8"}, {"batch_invariant": True}])
def test_flex_attention_refuses_what_it_cannot_read(tiny_paths, settings):
    with pytest.raises(ValueError, match="need TORCH_SDPA"):
        LLM(model=tiny_paths["llama"], dtype="float32", num_kv_blocks=8,
            attention_backend="FLEX_ATTENTION", **settings)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "qwen3", "mistral-window", "qwen2-window",
                                  "smollm3", "mixtral", "qwen3_moe"])
def test_these_families_decode_in_one_call(tiny_paths, name):
    """The decode stack takes their q/k norms, windows, Gemma's after-norms, GeGLU, soft cap
    and experts, so the equivalence above covers it at every kernel tier."""
    llm = LLM(model=tiny_paths[name], dtype="float32", num_kv_blocks=8)
    try:
        assert llm.engine.runner.model.decode_stack is not None
    finally:
        llm.engine.shutdown()


# A llama.cpp K-quant mix: q/k and gate in Q4_K, v and down in Q6_K (so the fused q/k/v and
# gate/up linears are runs of two types each), o in Q5_K, up in Q5_0 (read as Q8_0), the head
# in Q6_K.
Q = gguf.GGMLQuantizationType
K_MIX = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_K,
         "ffn_gate": Q.Q4_K, "ffn_up": Q.Q5_0, "ffn_down": Q.Q6_K, "token_embd": Q.Q8_0,
         "output": Q.Q6_K}


# the default numerics' greedy tokens before the first difference, summed over the 12 prompts
# (of 480): measured 138 on an AMD EPYC (Zen 3, avx2); half of it at least (other summation
# orders, avx512's float prompts), and not all 480 (int8 did run)
AUTO_STEPS = (69, 400)


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory):
    """A tiny llama whose rows are whole K-quant super-blocks (256), in the K_MIX types."""
    from tiny_models import TINY_VOCAB, make_tiny_model, write_gguf

    model = make_tiny_model("llama", vocab_size=len(TINY_VOCAB), hidden_size=256,
                            intermediate_size=512)
    path = str(tmp_path_factory.mktemp("k-quants") / "tiny-k-quants.gguf")
    with pytest.MonkeyPatch.context() as mp:  # its tokenizer's cache stays in the temp dir
        mp.setenv("CONVEYOR_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield write_gguf(path, model, types=K_MIX, tokenizer=True)


@pytest.mark.parametrize("path,policy", PATHS)
def test_k_quant_gguf_matches_transformers(k_quant_gguf, on_path, path, policy):
    """transformers dequantizes the file with gguf-py, as the loader does; the CPU kernels read
    the blocks (every linear, the head, the decode stack)."""
    on_path(path)
    check_model("tiny-gguf", k_quant_gguf, policy)
    if path != "pytorch":  # and the kernels did read them
        model = LLM(model=k_quant_gguf, dtype="float32", num_kv_blocks=8).engine.runner.model
        assert [q.ggml_type for q in model.layers[0].attention.wqkv.quantized] == [
            Q.Q4_K, Q.Q4_K, Q.Q6_K]
        assert [q.ggml_type for q in model.layers[1].feed_forward.w13.quantized] == [
            Q.Q4_K, Q.Q8_0]
        assert model.output.quantized[0].ggml_type == Q.Q6_K and model.decode_stack is not None


def test_k_quant_gguf_default_numerics_part_from_transformers_late(k_quant_gguf):
    """The default numerics (activations auto: int8 on the K-quants, llama.cpp's Q8_K numerics,
    at the avx2 and avx512 tiers, float elsewhere; the KV cache auto: float16 of a float32 model
    where the kernels read it) against transformers' float32 greedy tokens: held to llama.cpp's
    accuracy (docs/results/activation-quant), not to exactness. Per prompt, the
    greedy tokens before the first that differs: printed, and their sum asserted at its
    measured value (AUTO_STEPS) with a margin for summation orders; where auto is float, every
    prompt identical or parted at a tie."""
    from conveyor.kernels.library import AUTO_INT8_TIERS

    prompts, refs = reference("tiny-gguf", k_quant_gguf)
    outputs = run_conveyor(k_quant_gguf, prompts, "continuous", activation_quant="auto",
                           kv_cache_dtype="auto")
    agreed = [next((i for i, (a, b) in enumerate(zip(o.outputs[0].token_ids, ref[0])) if a != b),
                   len(ref[0])) for o, ref in zip(outputs, refs)]
    print("greedy tokens before the first difference:", agreed)
    if isa.current().tier not in AUTO_INT8_TIERS:
        for o, ref in zip(outputs, refs):
            compare(o.outputs[0].token_ids, *ref)
    else:
        assert AUTO_STEPS[0] <= sum(agreed) <= AUTO_STEPS[1], agreed


def test_a_type_the_kernels_do_not_read_runs_dense(k_quant_gguf, monkeypatch, caplog):
    """A matrix of a type the kernels do not read (here Q6_K, taken off their list) runs as a
    dense weight, the rest still read their blocks, and one line names them."""
    monkeypatch.setattr(bindings, "BLOCK_TYPES", bindings.BLOCK_TYPES - {int(Q.Q6_K)})
    with caplog.at_level("INFO", logger="conveyor"):
        model = LLM(model=k_quant_gguf, dtype="float32", num_kv_blocks=8).engine.runner.model
    line = next(r.getMessage() for r in caplog.records if "do not read" in r.getMessage())
    assert line.endswith("Q6_K (layers.*.attention.wv.weight, layers.*.feed_forward.w2.weight, "
                         "output.weight)")
    assert model.layers[0].attention.wqkv.quantized is None and model.output.quantized is None
    assert model.layers[0].attention.wo.quantized is not None and model.decode_stack is None
    check_model("tiny-gguf", k_quant_gguf, "continuous")


# The families llama.cpp writes in their own layouts (Gemma's four norms as 1 + w, Phi-3's fused
# q/k/v and gate/up), in a K-quant mix with Q8_0 where a row is too short for K-quant blocks;
# windows as llama.cpp fixes them (Gemma 2 every other layer, Gemma 3 five in six, Phi-3 all),
# Gemma's scores at head_dim ** -0.5, as llama.cpp scores them; Phi-3 with Phi-4-mini's partial
# rotary and LongRoPE factors as tensors.
FAMILY_MIX = {**K_MIX, "attn_output": Q.Q8_0, "attn_qkv": Q.Q4_K}
# The mixtures of experts: their experts' gate in Q4_K, up in Q8_0, down in Q6_K; Qwen2-MoE's
# shared expert in Q4_K and Q8_0; the routers in F32, as llama.cpp's quantizer keeps them.
MOE_MIX = {**FAMILY_MIX, **EXPERT_MIX, "ffn_gate_shexp": Q.Q4_K, "ffn_up_shexp": Q.Q8_0,
           "ffn_down_shexp": Q.Q8_0}
GGUF_FAMILIES = {
    "gemma2": dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=24),
    "gemma3": dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=24, layer_types=None,
                   num_hidden_layers=6),
    "phi3": dict(sliding_window=24, partial_rotary_factor=0.5, **phi3_longrope(16)),
    "mixtral": dict(intermediate_size=256),
    "qwen2_moe": dict(moe_intermediate_size=256, shared_expert_intermediate_size=256),
    "qwen3_moe": dict(moe_intermediate_size=256),
    "olmoe": dict(intermediate_size=256),
}


@pytest.fixture(scope="module")
def family_ggufs(tmp_path_factory):
    """Each family's GGUF and, as its reference, an HF folder of the weights the file holds."""
    from tiny_models import TINY_VOCAB, make_tiny_model, write_gguf

    files = {}
    with pytest.MonkeyPatch.context() as mp:  # its tokenizer's cache stays in the temp dir
        mp.setenv("CONVEYOR_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        for arch, overrides in GGUF_FAMILIES.items():
            model = make_tiny_model(arch, vocab_size=len(TINY_VOCAB), hidden_size=256,
                                    **{"intermediate_size": 512, **overrides})
            folder = tmp_path_factory.mktemp(f"{arch}-gguf")
            gguf_path = write_gguf(str(folder / f"{arch}.gguf"), model, types=MOE_MIX,
                                   tokenizer=True, sync=True)
            model.save_pretrained(folder / "reference")
            files[arch] = gguf_path, str(folder / "reference")
        yield files


@pytest.mark.parametrize("path,policy", PATHS)
@pytest.mark.parametrize("arch", list(GGUF_FAMILIES))
def test_family_ggufs_match_transformers(family_ggufs, on_path, arch, path, policy):
    on_path(path)
    gguf_path, reference_folder = family_ggufs[arch]
    prompts, refs = reference("hf", reference_folder)
    outputs = run_conveyor(gguf_path, prompts, policy)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0, "the pool was meant to preempt"
    identical = [compare(o.outputs[0].token_ids, *ref) for o, ref in zip(outputs, refs)]
    print(f"{arch} GGUF {policy}: {sum(identical)}/{len(identical)} identical, rest at ties")

