"""Loader tests: the default GGUF against transformers, tiny HF checkpoints, config parsing and errors."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers
from gguf.quants import dequantize
from tiny_models import (
    LLAMA3_ROPE_SCALING,
    TINY_VOCAB,
    conveyor_state_dict,
    hf_to_conveyor_name,
    make_tiny_checkpoint,
    make_tiny_model,
    smollm2_tokenizer,
    write_gguf,
)
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, load_gguf_checkpoint

from conveyor.model.config import ModelConfig
from conveyor.model.gguf_config import gguf_config
from conveyor.model.gguf_file import gguf_tensors, read_gguf
from conveyor.model.gguf_tokenizer import load_gguf_tokenizer
from conveyor.model.loader import LoadedModel, check_weights, load_model

# --- the default GGUF -------------------------------------------------------------------------


def test_default_gguf_config(default_model: LoadedModel) -> None:
    c = default_model.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and not c.attention_bias and not c.qk_norm
    assert c.rope_theta == 100000.0 and c.rope_scaling is None and c.torch_dtype is None
    assert default_model.name == "SmolLM2-135M-Instruct.Q4_1"
    assert 2 in default_model.eos_token_ids
    assert "output.weight" not in default_model.names()
    assert all(w.dtype == torch.float32 for w in default_model.weights.values())
    # every matrix in its blocks (no dense weights), read where the file's map has them; llama's
    # q/k rows, un-interleaved, are copies
    assert {n for n, w in default_model.weights.items() if w.ndim == 2} == set()
    for name, q in default_model.quantized.items():
        copied = re.search(r"\.w[qk]\.", name) is not None
        assert (mapped_file(q.blocks.data_ptr()) == default_model.path) != copied, name


def mapped_file(address: int) -> str | None:
    """The file this process has mapped at address (None: anonymous memory)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) == 6 else None
    return None


def test_default_gguf_tokenizer(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    assert tok("Hello world").input_ids == [19556, 905]  # no BOS for SmolLM2
    assert tok.eos_token_id == 2
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_gguf_permutation_matches_transformers(default_model: LoadedModel, default_gguf_path: str) -> None:
    """Fast check of layout and llama q/k un-permutation against transformers' LlamaTensorProcessor."""
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    tensors = {t.name: t for t in gguf.GGUFReader(default_gguf_path).tensors}
    for layer in (0, 29):
        for kind, ours in (("attn_q", "wq"), ("attn_k", "wk"), ("attn_v", "wv"), ("ffn_down", None)):
            t = tensors[f"blk.{layer}.{kind}.weight"]
            expected = processor.process(weights=dequantize(t.data, t.tensor_type), name=t.name).weights
            name = f"layers.{layer}." + (f"attention.{ours}.weight" if ours else "feed_forward.w2.weight")
            assert torch.equal(default_model.dense(name), torch.from_numpy(expected)), name


@pytest.mark.slow
def test_gguf_weights_match_transformers(default_model: LoadedModel, default_gguf_path: str) -> None:
    """Every tensor (names, layout, llama q/k un-permutation) agrees with transformers' own GGUF loader.

    `from_pretrained(..., gguf_file=...)` needs accelerate, so call the loader it uses directly.
    """
    hf_config = load_gguf_checkpoint(default_gguf_path, return_tensors=False)["config"]
    hf_config.pop("_model_name_or_path")
    config = transformers.AutoConfig.for_model(**hf_config)
    with torch.device("meta"):  # only parameter names are needed to map the tensors
        model = transformers.AutoModelForCausalLM.from_config(config)
    hf_tensors = load_gguf_checkpoint(default_gguf_path, return_tensors=True, model_to_load=model)["tensors"]
    expected = {hf_to_conveyor_name(k): v for k, v in hf_tensors.items()}
    assert expected.keys() == default_model.names()
    for name, tensor in expected.items():
        torch.testing.assert_close(default_model.dense(name), tensor, rtol=0, atol=1e-6, msg=name)
    c = default_model.config
    assert (c.rms_norm_eps, c.rope_theta) == (config.rms_norm_eps, config.rope_parameters["rope_theta"])
    assert c.max_position_embeddings == config.max_position_embeddings


def test_gguf_tokenizer_cache(default_gguf_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cached tokenizer behaves exactly like a fresh conversion, and the cache is a complete directory."""
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    fresh = load_gguf_tokenizer(default_gguf_path)
    (entry,) = os.listdir(tmp_path / "tokenizers")  # no leftover temp dirs
    assert not entry.startswith(".tmp")
    cached = load_gguf_tokenizer(default_gguf_path)
    texts = ["Hello world", "  12345 naïve café 🤗\n\nx", "<|im_start|>user\nhi<|im_end|>", "def f(x):\n\treturn x"]
    for text in texts:
        assert cached(text).input_ids == fresh(text).input_ids
        assert cached.decode(cached(text).input_ids) == text
    assert cached.chat_template == fresh.chat_template and cached.chat_template
    assert (cached.eos_token_id, cached.bos_token_id) == (fresh.eos_token_id, fresh.bos_token_id)


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_gguf_config_and_weights_roundtrip(arch: str, tied: bool, tmp_path: Path) -> None:
    """qwen2 biases, qwen3 q/k norms and head_dim, and the llama permutation survive a GGUF round trip."""
    model = make_tiny_model(arch, tie_word_embeddings=tied)
    path = str(tmp_path / f"tiny-{arch}.gguf")
    write_gguf(path, model)
    reader = read_gguf(path)
    config = gguf_config(reader)
    assert (config.architecture, config.vocab_size, config.num_layers) == (arch, 49152, 2)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 32 if arch == "qwen3" else 16)
    assert config.tie_word_embeddings == tied
    assert (config.attention_bias, config.qk_norm) == (arch == "qwen2", arch == "qwen3")
    assert config.rms_norm_eps == pytest.approx(1e-5) and config.max_position_embeddings == 4096
    weights, quantized = gguf_tensors(reader, config)
    dense = weights | {name: q.dequantize() for name, q in quantized.items()}
    check_weights(dense, config)
    expected = conveyor_state_dict(model, tied=tied)
    assert expected.keys() == dense.keys()
    for name, tensor in expected.items():
        assert torch.equal(dense[name], tensor), name


def test_a_mixed_gguf_takes_block_kernels_per_matrix_and_names_the_rest(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = make_tiny_model("llama", tie_word_embeddings=False)
    q = gguf.GGMLQuantizationType
    path = write_gguf(str(tmp_path / "mixed.gguf"), model, types={
        "attn_q": q.Q8_0, "attn_k": q.Q4_0, "attn_v": q.F16, "attn_output": q.Q5_0,
        "ffn_down": q.MXFP4, "output": q.Q8_0})
    reader = read_gguf(path)
    with caplog.at_level("INFO", logger="conveyor"):
        weights, quantized = gguf_tensors(reader, gguf_config(reader))
    # the rest of the matrices are F32: dense rows the kernels read too
    assert {re.sub(r"layers\.\d+\.", "", n) for n in quantized} == {
        "attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
        "attention.wo.weight", "feed_forward.w1.weight", "feed_forward.w3.weight",
        "output.weight", "tok_embeddings.weight"}
    assert {re.sub(r"layers\.\d+\.", "", n) for n, w in weights.items() if w.ndim == 2} == {
        "feed_forward.w2.weight"}
    assert {quantized[n].ggml_type for n in quantized if "wk" in n} == {int(q.Q4_0)}
    assert {quantized[n].ggml_type for n in quantized if "wv" in n} == {int(q.F16)}
    assert {quantized[n].ggml_type for n in quantized if "w1" in n} == {int(q.F32)}
    # Q5_0 is read as Q8_0 blocks (the same scale, q - 16 in a byte): the same weights
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for i in range(2):
        name, t = f"layers.{i}.attention.wo.weight", stored[f"blk.{i}.attn_output.weight"]
        assert quantized[name].ggml_type == int(q.Q8_0)
        as_q5 = dequantize(t.data, t.tensor_type).reshape(quantized[name].dequantize().shape)
        assert torch.equal(quantized[name].dequantize(), torch.from_numpy(as_q5))
    line = next(r.getMessage() for r in caplog.records if "no block kernel" in r.getMessage())
    assert line.endswith(": MXFP4 (layers.*.feed_forward.w2.weight)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_folder_hands_its_matrices_to_the_kernels_as_stored(tmp_path: Path, dtype) -> None:
    q = gguf.GGMLQuantizationType
    loaded = load_model(make_tiny_checkpoint(tmp_path, "llama", dtype=dtype))
    matrices = {n for n, w in loaded.weights.items() if w.ndim == 2}
    assert loaded.quantized.keys() == matrices - {"tok_embeddings.weight"}  # untied
    want = {torch.bfloat16: q.BF16, torch.float16: q.F16, torch.float32: q.F32}[dtype]
    for name, w in loaded.quantized.items():
        assert w.ggml_type == want and w.blocks.dtype == torch.uint8
        assert w.blocks.data_ptr() == loaded.weights[name].data_ptr()  # a view, not a copy


# --- tiny HF checkpoints ----------------------------------------------------------------------

TINY_CASES = {
    "llama": ("llama", {}),
    "llama-rope-llama3": ("llama", {"rope_scaling": LLAMA3_ROPE_SCALING}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
}


@pytest.mark.parametrize("case", TINY_CASES)
def test_tiny_checkpoint_roundtrip(case: str, tiny_checkpoint: Callable[..., str]) -> None:
    arch, overrides = TINY_CASES[case]
    folder = tiny_checkpoint(arch, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    loaded = load_model(folder)

    c, h = loaded.config, hf.config
    assert c.architecture == arch
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (h.vocab_size, h.hidden_size, h.intermediate_size)
    assert (c.num_layers, c.num_heads, c.num_kv_heads) == (h.num_hidden_layers, h.num_attention_heads, 2)
    assert c.head_dim == (32 if arch == "qwen3" else 16)
    assert (c.rms_norm_eps, c.rope_theta, c.max_position_embeddings) == (1e-5, 10000.0, 4096)
    assert c.rope_scaling == overrides.get("rope_scaling")
    assert c.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    assert c.attention_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3")
    assert c.torch_dtype == "float32"

    expected = conveyor_state_dict(hf, tied=c.tie_word_embeddings)
    assert expected.keys() == loaded.weights.keys() == loaded.names()
    for name, tensor in expected.items():
        assert torch.equal(loaded.weights[name], tensor), name
    assert loaded.eos_token_ids == [2]
    assert loaded.tokenizer("Hello world").input_ids == [19556, 905]
    assert loaded.tokenizer.chat_template
    assert loaded.name == os.path.basename(folder)


def test_sharded_checkpoint_and_generation_eos(tiny_checkpoint: Callable[..., str]) -> None:
    folder = tiny_checkpoint("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    os.remove(os.path.join(folder, "model.safetensors"))
    hf.save_pretrained(folder, max_shard_size="1MB")
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 0]}, f)
    loaded = load_model(folder)
    assert loaded.weights.keys() == conveyor_state_dict(hf, tied=False).keys()
    assert loaded.eos_token_ids == [2, 0]


# --- config parsing ---------------------------------------------------------------------------

_HF_CONFIG = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def test_config_defaults_and_old_style_rope() -> None:
    c = ModelConfig.from_hf_config(
        {**_HF_CONFIG, "head_dim": None, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    assert (c.num_kv_heads, c.head_dim, c.rope_theta) == (4, 16, 5e5)
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert not c.tie_word_embeddings and c.torch_dtype is None


def test_config_transformers5_rope_parameters() -> None:
    c = ModelConfig.from_hf_config(
        {**_HF_CONFIG, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "dtype": "bfloat16"}
    )
    assert (c.rope_theta, c.rope_scaling, c.torch_dtype) == (1e6, None, "bfloat16")


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},  # missing llama3 fields
    ],
)
def test_config_rejects_unsupported_rope(rope: dict) -> None:
    with pytest.raises(ValueError, match="rope"):
        ModelConfig.from_hf_config({**_HF_CONFIG, **rope})


# --- errors -----------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(str(tmp_path / "nope"))


def test_unsupported_hf_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**_HF_CONFIG, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="gpt2"):
        load_model(str(tmp_path))


def test_folder_without_config_or_weights(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(_HF_CONFIG))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(tmp_path))


def _rewrite_safetensors(folder: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = os.path.join(folder, "model.safetensors")
    tensors = safetensors.torch.load_file(path)
    edit(tensors)
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})


def test_missing_unexpected_and_misshapen_tensors(tiny_checkpoint: Callable[..., str]) -> None:
    folder = tiny_checkpoint("qwen2")
    _rewrite_safetensors(folder, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"missing layers\.1\.attention\.wk\.bias"):
        load_model(folder)
    _rewrite_safetensors(folder, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.extra\.weight"):
        load_model(folder)
    folder = tiny_checkpoint("llama")
    _rewrite_safetensors(folder, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"norm\.weight has shape \(3,\), expected \(64,\)"):
        load_model(folder)


def test_untied_checkpoint_without_lm_head(tiny_checkpoint: Callable[..., str]) -> None:
    folder = tiny_checkpoint("llama")
    _rewrite_safetensors(folder, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="lm_head"):
        load_model(folder)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = str(tmp_path / "tiny-gpt2.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_model(path)


def test_a_folder_quantized_at_load_is_that_gguf(tmp_path: Path) -> None:
    """--quantization q8_0 on a folder: the same blocks (gguf-py's quantizer) and so the same
    greedy tokens as the GGUF llama.cpp's converter would write of that model in Q8_0."""
    from conveyor import LLM, SamplingParams

    q = gguf.GGMLQuantizationType
    model = make_tiny_model("llama", vocab_size=len(TINY_VOCAB))
    model.save_pretrained(tmp_path / "folder")
    smollm2_tokenizer().save_pretrained(tmp_path / "folder")
    path = write_gguf(str(tmp_path / "q8.gguf"), model, tokenizer=True, types={
        kind: q.Q8_0 for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                  "ffn_up", "ffn_down", "output")})
    folder = load_model(str(tmp_path / "folder"), quantization="q8_0")
    assert {w.ggml_type for w in folder.quantized.values()} == {int(q.Q8_0)}
    original = conveyor_state_dict(model, tied=False)
    for name, w in folder.quantized.items():
        error = (folder.weights[name] - original[name]).abs().max()
        assert 0 < error <= original[name].abs().max() / 127, name  # half a step of Q8_0
    with pytest.raises(ValueError, match="is for Hugging Face folders"):
        load_model(path, quantization="q8_0")

    prompts = [{"prompt_token_ids": [5 + i, 40 + 3 * i, 77, 100 + i]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = [[o.outputs[0].token_ids for o in LLM(model=m, dtype="float32", **kw).generate(
        prompts, params, use_tqdm=False)]
        for m, kw in ((str(tmp_path / "folder"), {"quantization": "q8_0"}), (path, {}))]
    assert runs[0] == runs[1]
