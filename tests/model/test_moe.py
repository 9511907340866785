"""The mixture-of-experts layer: its grouping of a step's tokens by expert, and its output against
a plain loop over each token's chosen experts."""

from __future__ import annotations

import gguf
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.model.config import ModelConfig
from conveyor.model.moe import Route, SparseMoE

from tiny_models import _CONFIG_CLASSES, make_tiny_checkpoint


def config(arch: str, **overrides) -> ModelConfig:
    """The settings of what transformers writes for this family, with overrides."""
    sizes = {"intermediate_size": 64, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 48}
    hf = _CONFIG_CLASSES[arch](num_hidden_layers=2, hidden_size=64, **overrides).to_dict()
    return ModelConfig.from_hf_config({**hf, **{k: v for k, v in sizes.items() if k in hf}})


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, 30), experts=st.integers(1, 12), data=st.data())
def test_a_route_groups_every_token_slot_once_expert_by_expert(tokens, experts, data):
    used = data.draw(st.integers(1, experts))
    chosen = torch.stack([torch.randperm(experts)[:used] for _ in range(tokens)])
    weights = torch.rand(tokens, used)
    route = Route(weights, chosen, experts)
    seen = []
    for expert, rows, w in route.groups():
        assert rows.tolist() == sorted(rows.tolist())  # (each expert's tokens in order)
        for t, value in zip(rows.tolist(), w.tolist()):
            (slot,) = (chosen[t] == expert).nonzero()[0].tolist()
            assert value == weights[t, slot].item()
            seen.append((t, expert))
    assert [e for _, e in seen] == sorted(e for _, e in seen)  # ascending experts
    assert sorted(seen) == sorted((t, e) for t in range(tokens) for e in chosen[t].tolist())


def _filled(moe: SparseMoE) -> SparseMoE:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return moe.eval()


def _expert(ff, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU from the expert's weights, written out."""
    gate, up = F.linear(x, ff.w13.weight).split(ff.intermediate, dim=-1)
    return F.linear(F.silu(gate) * up, ff.w2.weight)


@pytest.mark.parametrize("arch,norm", [("mixtral", True), ("qwen3_moe", True),
                                       ("qwen3_moe", False), ("qwen2_moe", False), ("olmoe", False)])
def test_the_grouped_experts_equal_a_loop_over_each_tokens_experts(arch, norm):
    overrides = {"norm_topk_prob": norm} if arch != "mixtral" else {}
    c = config(arch, num_experts_per_tok=3, **{"num_local_experts" if arch == "mixtral"
                                               else "num_experts": 6}, **overrides)
    assert c.moe.norm_topk == norm
    moe = _filled(SparseMoE(c))
    x = torch.randn(9, 64)
    with torch.no_grad():
        expected = torch.zeros_like(x)
        for t in range(len(x)):
            probs = torch.softmax(moe.router @ x[t], dim=0)
            weights, chosen = probs.topk(3)
            if norm:
                weights = weights / weights.sum()
            for w, e in zip(weights, chosen.tolist()):
                expected[t] += w * _expert(moe.experts[e], x[t:t + 1])[0]
            if moe.shared_expert is not None:
                gate = torch.sigmoid(moe.shared_gate.weight @ x[t])
                expected[t] += gate * _expert(moe.shared_expert, x[t:t + 1])[0]
        assert torch.allclose(moe(x), expected, atol=1e-5, rtol=1e-4)


def test_the_router_runs_in_float32_at_bfloat16():
    """Its logits and probabilities from float32 inputs and weights, whatever the model dtype."""
    moe = _filled(SparseMoE(config("qwen3_moe", num_experts=6, num_experts_per_tok=2)))
    for ff in moe.experts:
        ff.to(torch.bfloat16)
    x = torch.randn(5, 64).to(torch.bfloat16)
    route = moe.route(x)
    assert route.weights.dtype == torch.float32 and moe.router.dtype == torch.float32
    assert moe(x).dtype == torch.bfloat16


def test_a_folder_of_a_moe_family_loads_its_experts_under_their_names(tmp_path):
    from conveyor.model.loader import load_model

    loaded = load_model(make_tiny_checkpoint(tmp_path, "qwen2_moe"))
    names = loaded.names()
    assert {"layers.1.feed_forward.router.weight", "layers.1.feed_forward.experts.7.w2.weight",
            "layers.0.feed_forward.shared_gate.weight"} <= names
    assert not any(".feed_forward.w1." in n for n in names)


def test_quantizing_a_folder_leaves_the_routers_in_float32(tmp_path):
    """--quantization q8_0 takes the experts' matrices into blocks, not the routers (as
    llama.cpp's quantizer keeps ffn_gate_inp)."""
    from conveyor.model.loader import load_model

    folder = make_tiny_checkpoint(tmp_path, "qwen3_moe")
    plain, quantized = load_model(folder), load_model(folder, quantization="q8_0")
    router = "layers.0.feed_forward.router.weight"
    assert router not in quantized.quantized
    assert torch.equal(quantized.weights[router], plain.weights[router])
    expert = quantized.quantized["layers.0.feed_forward.experts.5.w1.weight"]
    assert expert.ggml_type == gguf.GGMLQuantizationType.Q8_0


@pytest.mark.parametrize("path", ["kernels", "pytorch"])
def test_steps_record_the_moe_layers_time_and_experts(tmp_path, monkeypatch, path):
    """A request decoding alone runs exactly `used` experts a layer each step; the step
    records (/v1/engine/steps) and /metrics carry the MoE layers' time and experts, on the
    one-call kernel and on the PyTorch loop alike."""
    from conveyor import LLM, SamplingParams
    from conveyor.kernels import isa
    from conveyor.server.metrics import ServerMetrics

    if path == "pytorch":
        monkeypatch.setenv("CONVEYOR_CPU_KERNELS", "off")
    isa.current.cache_clear()
    folder = make_tiny_checkpoint(tmp_path, "qwen3_moe")  # 8 experts, 2 a token
    llm = LLM(model=folder, dtype="float32", num_kv_blocks=16)
    try:
        moe = llm.engine.runner.model.layers[0].feed_forward
        assert (moe.kernel is not None) == (path == "kernels")
        llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=6,
                                                     ignore_eos=True), use_tqdm=False)
        steps = list(llm.engine.steps)
        decodes = [s for s in steps if s.num_prefill_tokens == 0]
        assert decodes and all(s.moe_experts == 2 for s in decodes)
        assert all(0 < s.moe_seconds < s.duration for s in steps)
        assert all(2 <= s.moe_experts <= 8 for s in steps)
        metrics = ServerMetrics("m")
        metrics.observe_engine(llm.engine)
        assert metrics.snapshot()["moe_layer_seconds_total"] == pytest.approx(
            sum(s.moe_seconds for s in steps))
        assert f'conveyor:iteration_moe_experts_count{{model_name="m"}} {len(steps)}.0' in \
            metrics.exposition().decode()
    finally:
        llm.engine.shutdown()
        isa.current.cache_clear()


def test_a_dense_models_steps_record_no_moe_layers(default_gguf_path):
    from conveyor import LLM, SamplingParams

    llm = LLM(model=default_gguf_path, num_kv_blocks=16)
    try:
        llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)
        assert all(s.moe_seconds == 0 and s.moe_experts == 0 for s in llm.engine.steps)
    finally:
        llm.engine.shutdown()
