"""--generation-config (vLLM's): the model's sampling defaults, for the requests that leave them
unset (conveyor/model/generation_config.py)."""

from __future__ import annotations

import json

import gguf
import pytest
from tiny_models import make_tiny_checkpoint

from conveyor.llm import LLM
from conveyor.model.generation_config import sampling_defaults
from conveyor.server.protocol import ChatCompletionRequest, CompletionRequest


def with_generation_config(folder, **values) -> str:
    make_tiny_checkpoint(str(folder), "llama")
    (folder / "generation_config.json").write_text(json.dumps(values))
    return str(folder)


def test_a_folders_values_that_differ_from_transformers_defaults(tmp_path):
    folder = with_generation_config(tmp_path / "m", do_sample=True, temperature=0.6, top_p=0.9,
                                    top_k=50, repetition_penalty=1.0, bos_token_id=1)
    assert sampling_defaults("auto", folder) == {"temperature": 0.6, "top_p": 0.9}
    assert sampling_defaults("vllm", folder) == {}
    other = with_generation_config(tmp_path / "other", top_k=20, min_p=0.05)
    assert sampling_defaults(other, folder) == {"top_k": 20, "min_p": 0.05}
    with pytest.raises(ValueError, match="no generation_config.json in"):
        sampling_defaults(str(tmp_path), folder)
    llm = LLM(model=folder, dtype="float32", num_kv_blocks=16)
    assert llm.engine.sampling_defaults == {"temperature": 0.6, "top_p": 0.9}


def test_a_ggufs_general_sampling_keys(tmp_path):
    path = str(tmp_path / "s.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_float32("general.sampling.temp", 0.7)
    writer.add_int32("general.sampling.top_k", 40)
    writer.add_float32("general.sampling.penalty_repeat", 1.1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    got = sampling_defaults("auto", path)
    assert got == {"temperature": pytest.approx(0.7), "top_k": 40,
                   "repetition_penalty": pytest.approx(1.1)}


def test_a_request_keeps_what_it_sets_and_takes_the_models_for_the_rest():
    model = {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    unset = CompletionRequest(prompt="x").sampling_params(16, None, None, model)
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.6, 0.9, 20)
    own = CompletionRequest(prompt="x", temperature=0.0, top_k=5).sampling_params(
        16, None, None, model)
    assert (own.temperature, own.top_p, own.top_k) == (0.0, 0.9, 5)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_p=1.0)
    assert chat.sampling_params(16, None, None, model).top_p == 1.0
