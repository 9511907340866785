"""The decode graphs' ladder and padding (the capture itself needs CUDA; here the padded
buffers run eagerly, as the e2e FlexAttention tests run them through whole models)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conveyor.worker.decode_graphs import DecodeGraphs, graph_sizes, padded_size
from conveyor.worker.step_plan import StepPlan
from tiny_models import make_tiny_checkpoint


def test_the_ladder_is_vllms():
    assert graph_sizes(1) == [1]
    assert graph_sizes(12) == [1, 2, 4, 8, 12]
    assert graph_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


@given(st.integers(1, 600), st.data())
def test_a_step_takes_the_smallest_size_that_holds_it(max_rows, data):
    sizes = graph_sizes(max_rows)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_rows
    rows = data.draw(st.integers(1, max_rows))
    size = padded_size(rows, sizes)
    assert size in sizes and size >= rows
    assert all(s < rows for s in sizes[:sizes.index(size)])
    assert padded_size(max_rows + 1, sizes) is None


def test_padding_rows_read_and_write_only_the_scratch_page():
    seen = {}

    def step(ids, rope_rows, slots, positions, tables):
        seen.update(ids=ids.tolist(), rope_rows=rope_rows.tolist(), slots=slots.tolist(),
                    positions=positions.tolist(), tables=tables.tolist())
        return torch.arange(len(ids), dtype=torch.float32).unsqueeze(1)

    graphs = DecodeGraphs(step, max_rows=12, max_pages=4, scratch_page=9, block_size=4,
                          device=torch.device("cpu"), capture=False)
    # three decodes: contexts of 5, 2 and 9 tokens (tables padded with page 0, as planned)
    plan = StepPlan(ids=[11, 12, 13], rope_rows=[4, 1, 8], slots=[4 * 3 + 0, 4 * 5 + 1, 4 * 8],
                    decode_groups=[([[2, 3, 0], [5, 0, 0], [1, 7, 8]], [5, 2, 9])])
    hidden = graphs.run(plan)
    assert hidden.flatten().tolist() == [0, 1, 2]   # the real rows' outputs only
    assert seen["ids"] == [11, 12, 13, 0]            # padded to 4
    assert seen["rope_rows"] == [4, 1, 8, 0]
    assert seen["slots"] == [12, 21, 32, 9 * 4]
    assert seen["positions"] == [4, 1, 8, 0]
    assert seen["tables"] == [[2, 3, -1, -1], [5, -1, -1, -1], [1, 7, 8, -1], [9, -1, -1, -1]]
    # a step with a prompt chunk, or past the largest size, runs eagerly
    assert graphs.run(StepPlan(ids=[1, 2], prefills=[(2, 0, None)])) is None
    assert graphs.run(StepPlan(ids=list(range(13)))) is None


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}), ("gemma2", {"sliding_window": 24}), ("phi3", {"partial_rotary_factor": 0.5}),
    ("qwen3", {})])
def test_a_captured_step_reads_nothing_back_to_the_host(tmp_path, monkeypatch, arch, overrides):
    """What a CUDA graph captures (``ModelRunner._decode_step``: metadata, network) on fake
    tensors (FakeTensorMode: shapes, no data), where any op that needs a value on the host (a
    sync, which a capture cannot hold) raises. The network as on CUDA: plain PyTorch."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from conveyor import LLM
    from conveyor.config import EngineConfig

    monkeypatch.setenv("CONVEYOR_CPU_KERNELS", "off")
    monkeypatch.setattr(EngineConfig, "decode_graphs", lambda self, device: True)
    llm = LLM(model=make_tiny_checkpoint(tmp_path, arch, **overrides), dtype="float32",
              num_kv_blocks=16, max_num_seqs=8, max_model_len=160,
              attention_backend="FLEX_ATTENTION")
    try:
        runner = llm.engine.runner
        with torch.inference_mode(), FakeTensorMode(allow_non_fake_inputs=True):
            hidden = runner._decode_step(*runner.graphs._inputs(8))
        assert hidden.shape == (8, runner.config.hidden_size)
    finally:
        llm.engine.shutdown()


def test_a_mixture_of_experts_decodes_eagerly(tmp_path, monkeypatch):
    """Its routing counts each expert's rows on the host, each layer: no graph can hold that."""
    from conveyor import LLM
    from conveyor.config import EngineConfig

    monkeypatch.setattr(EngineConfig, "decode_graphs", lambda self, device: True)
    llm = LLM(model=make_tiny_checkpoint(tmp_path, "qwen3_moe"), dtype="float32",
              num_kv_blocks=16, attention_backend="FLEX_ATTENTION")
    try:
        assert llm.engine.runner.graphs is None
        assert "decode steps eager" in llm.engine.runner.kernel_path
    finally:
        llm.engine.shutdown()
