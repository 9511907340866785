"""Loading a GGUF takes about the memory of its file: its matrices are read where the file's map
has them, never copied to float32 or to dense weights. Measured in a fresh process, on a random
Q8_0 model of ~270 MB (SmolLM2's tokenizer, a Llama layout of 12 layers of 1024), and on a
mixture of experts of ~190 MB (Mixtral's layout: 8 experts of 512 a layer, stacked in 3-D
tensors, the routers F32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

from conveyor.model.gguf_reader import GGUFFile
from conveyor.model.loader import default_model_path

Q = gguf.GGMLQuantizationType
HIDDEN, LAYERS, FFN, HEADS, KV_HEADS = 1024, 12, 4096, 16, 4
EXPERTS, EXPERT_FFN = 8, 512

# Loads the file, generates (every matrix read once), and prints resident memory before
# loading and the peak after, in bytes (VmHWM: ru_maxrss would carry the parent's peak over the
# fork and exec).
PROBE = """
import json, sys
from conveyor import LLM, SamplingParams
from conveyor.engine.engine import resident_gib
before = resident_gib()[0] * 2**30
llm = LLM(model=sys.argv[1], num_kv_blocks=64, max_model_len=256, max_num_seqs=2)
out = llm.generate(["the cat sat"], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 2
print(json.dumps({"before": before, "peak": resident_gib()[1] * 2**30,
                  "dtype": str(llm.engine.dtype)}))
"""


def random_q8_0(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / 32 * 34] valid Q8_0 blocks: a small fp16 scale, random int8 values."""
    blocks = rng.integers(0, 256, (rows, cols // 32, 34), dtype=np.uint8)
    blocks[..., :2] = np.full((rows, cols // 32, 1), 0.002, np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.fixture(scope="module", params=["dense", "experts"])
def q8_model(tmp_path_factory, request) -> str:
    experts = request.param == "experts"
    path = str(tmp_path_factory.mktemp("memory") / "q8.gguf")
    source = GGUFFile(default_model_path())
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(4096)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(EXPERT_FFN if experts else FFN)
    if experts:
        writer.add_expert_count(EXPERTS)
        writer.add_expert_used_count(2)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    for key in source.keys:
        if key.startswith("tokenizer."):
            kind, _ = source._fields[key]
            value = source.value(key)
            if kind == gguf.GGUFValueType.ARRAY:
                item = gguf.GGUFValueType(source._read("<I", source._fields[key][1]))
                writer.add_key_value(key, value, kind, item)
            else:
                writer.add_key_value(key, value, kind)
    vocab = len(source.value("tokenizer.ggml.tokens"))
    rng = np.random.default_rng(0)
    kv = HIDDEN // HEADS * KV_HEADS
    writer.add_tensor("token_embd.weight", random_q8_0(vocab, HIDDEN, rng), raw_dtype=Q.Q8_0)
    for i in range(LAYERS):
        for name, rows, cols in (("attn_q", HIDDEN, HIDDEN), ("attn_k", kv, HIDDEN),
                                 ("attn_v", kv, HIDDEN), ("attn_output", HIDDEN, HIDDEN)):
            writer.add_tensor(f"blk.{i}.{name}.weight", random_q8_0(rows, cols, rng),
                              raw_dtype=Q.Q8_0)
        for name, rows, cols in (("ffn_gate", FFN, HIDDEN), ("ffn_up", FFN, HIDDEN),
                                 ("ffn_down", HIDDEN, FFN)):
            if not experts:
                writer.add_tensor(f"blk.{i}.{name}.weight", random_q8_0(rows, cols, rng),
                                  raw_dtype=Q.Q8_0)
                continue
            rows, cols = (EXPERT_FFN, HIDDEN) if name != "ffn_down" else (HIDDEN, EXPERT_FFN)
            stacked = random_q8_0(EXPERTS * rows, cols, rng).reshape(EXPERTS, rows, -1)
            writer.add_tensor(f"blk.{i}.{name}_exps.weight", stacked, raw_dtype=Q.Q8_0)
        if experts:
            writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight",
                              rng.standard_normal((EXPERTS, HIDDEN), np.float32))
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(HIDDEN, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_gguf_loads_in_about_the_memory_of_its_file(q8_model, tmp_path):
    size = os.path.getsize(q8_model)
    params = size / 34 * 32
    env = dict(os.environ, HF_HUB_OFFLINE="1", CONVEYOR_CACHE_DIR=str(tmp_path))
    for _ in range(2):  # the first run converts the tokenizer (its peak is not the loader's)
        done = subprocess.run([sys.executable, "-c", PROBE, q8_model], capture_output=True,
                              text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
    m = json.loads(done.stdout.strip().splitlines()[-1])
    grown = m["peak"] - m["before"]
    # the file once, read in place (on the bfloat16 tiers its Q8_0 blocks are widened: 36
    # bytes a block, a copy whose source pages are given back), and what a process that has run
    # a step holds besides (~100 MB here: the tokenizer, the kernels, PyTorch's first step);
    # a dense copy would be 2 (bfloat16) or 4 (float32) bytes a weight more: 470 MB or more
    assert grown <= 36 / 34 * size + 200e6, (grown, size, m["dtype"])
    assert grown < size + 2 * params
