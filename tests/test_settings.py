"""Settings dataclasses are the one source of their flags: every field is a flag with its default
in the help, the flags parse back into the same settings, and a replica's flags reproduce them."""

from __future__ import annotations

import argparse
import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.cli import build_parser
from conveyor.config import QUANTIZATIONS, EngineConfig
from conveyor.core.kv_cache_manager import KV_LAYOUTS
from conveyor.core.scheduler import POLICIES, SCHEDULING_POLICIES
from conveyor.server.config import ServerConfig
from conveyor.settings import add_arguments, from_namespace, setting, to_flags


def serve_flags(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_every_field_is_a_flag_of_generate_and_serve_with_its_default():
    for command, classes in (("generate", [EngineConfig]), ("serve", [EngineConfig, ServerConfig])):
        args = build_parser().parse_args([command])
        for cls in classes:
            assert from_namespace(cls, args) == cls()
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"]
                         .format_help().split())
    assert "--max-num-seqs MAX_NUM_SEQS most requests in one batch (default: 64)" in help_text
    assert "--api-key API_KEY" in help_text


def test_a_new_field_is_a_flag_a_keyword_and_a_replica_flag():
    """What adding a setting takes: the field, nothing else."""

    @dataclasses.dataclass
    class WithKnob(EngineConfig):
        knob_size: int = setting(3, "a new knob")

    parser = argparse.ArgumentParser()
    add_arguments(parser, WithKnob)
    assert from_namespace(WithKnob, parser.parse_args(["--knob-size", "5"])).knob_size == 5
    assert WithKnob(knob_size=7).knob_size == 7
    assert to_flags(WithKnob(knob_size=7)) == ["--knob-size", "7"]
    assert "a new knob (default: 3)" in " ".join(parser.format_help().split())


@settings(max_examples=40, deadline=None)
@given(max_num_seqs=st.integers(1, 512), budget=st.integers(512, 8192),
       policy=st.sampled_from(POLICIES), scheduling=st.sampled_from(SCHEDULING_POLICIES),
       layout=st.sampled_from(KV_LAYOUTS), caching=st.booleans(),
       memory=st.sampled_from([None, "1GiB", "512MB"]), threads=st.none() | st.integers(1, 8),
       quantization=st.sampled_from([None, *QUANTIZATIONS]), tp=st.integers(1, 4),
       names=st.none() | st.lists(st.sampled_from(["a", "b-1", "c.2"]), min_size=1,
                                  max_size=3),
       timeout=st.none() | st.floats(0.5, 100), public=st.booleans())
def test_flags_parse_back_into_the_same_settings(max_num_seqs, budget, policy, scheduling,
                                                 layout, caching, memory, threads, quantization,
                                                 tp, names, timeout, public):
    engine = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          policy=policy, scheduling_policy=scheduling, kv_layout=layout,
                          enable_prefix_caching=caching, kv_cache_memory=memory,
                          threads=threads, quantization=quantization, tensor_parallel_size=tp,
                          device="cpu")
    server = ServerConfig(served_model_name=names, request_timeout=timeout,
                          dashboard_public=public, port=9000)
    args = serve_flags(to_flags(engine) + to_flags(server))
    assert from_namespace(EngineConfig, args) == engine
    assert from_namespace(ServerConfig, args) == server


def test_cuda_takes_flex_attention_and_decode_graphs_unless_told_otherwise():
    import torch

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert EngineConfig().attention(cpu) == "TORCH_SDPA" and not EngineConfig().decode_graphs(cpu)
    assert EngineConfig().attention(cuda) == "FLEX_ATTENTION" and EngineConfig().decode_graphs(cuda)
    assert not EngineConfig(enforce_eager=True).decode_graphs(cuda)
    assert not EngineConfig(tensor_parallel_size=2).decode_graphs(cuda)
    # an int8 cache, which FlexAttention does not read: the other backend, and no graphs
    int8 = EngineConfig(kv_cache_dtype="int8")
    assert int8.attention(cuda) == "TORCH_SDPA" and not int8.decode_graphs(cuda)
    assert not EngineConfig(attention_backend="TORCH_SDPA").decode_graphs(cuda)
    assert EngineConfig(attention_backend="FLEX_ATTENTION").attention(cpu) == "FLEX_ATTENTION"
