"""Damaged GGUF files: truncated, bit-flipped, a tensor of the wrong shape or type, a block
count that does not match. Each either loads and generates, or fails at load with a one-line
ValueError naming the file: never another exception, a hang or a crash in a C kernel."""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
from tiny_models import TINY_VOCAB, make_tiny_model, write_gguf

from cli_output import error_lines
from conveyor.llm import LLM
from conveyor.sampling_params import SamplingParams

Q = gguf.GGMLQuantizationType
Edit = Callable[[gguf.GGUFReader], None]
# The three block types the CPU kernels read (every linear and the head: the decode stack and
# the head's block kernel run), an F16 embedding and F32 norms.
TYPES = {"attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q8_0, "attn_output": Q.Q4_0,
         "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0, "token_embd": Q.F16,
         "output": Q.Q8_0}


@pytest.fixture(scope="module", autouse=True)
def _tokenizer_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CONVEYOR_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


def _write(path: Path) -> Path:
    model = make_tiny_model("llama", vocab_size=len(TINY_VOCAB))
    return Path(write_gguf(str(path), model, types=TYPES, tokenizer=True))


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama GGUF (~120 KB) with a tokenizer: it loads and generates."""
    return _write(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def load_or_error(path: Path) -> list[int] | str:
    """Load path into the engine and greedily generate two tokens: their ids, or the one-line
    ValueError's message. Any other exception fails the test."""
    try:
        llm = LLM(model=str(path), dtype="float32", num_kv_blocks=16, max_model_len=64,
                  max_num_seqs=2)
    except ValueError as e:
        message = str(e)
        assert "\n" not in message and message.startswith(f"{path}: "), message
        return message
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate(["the cat"], params, use_tqdm=False)
    return out.outputs[0].token_ids  # fewer than 2 where a NaN weight ended the request


def patched(good: Path, bad: Path, edit: Edit) -> Path:
    """A copy of good, edited in place through a writable reader's views of the file."""
    shutil.copy(good, bad)
    reader = gguf.GGUFReader(bad, "r+")
    edit(reader)
    reader.data.flush()
    return bad


def tensor(reader: gguf.GGUFReader, name: str) -> gguf.ReaderTensor:
    return next(t for t in reader.tensors if t.name == name)


def test_the_good_file_loads_and_generates(good: Path) -> None:
    ids = load_or_error(good)
    assert not isinstance(ids, str) and len(ids) == 2, ids


# --- (a) truncated ----------------------------------------------------------------------------

CUTS: dict[str, Callable[[gguf.GGUFReader], int]] = {
    "empty": lambda r: 0,
    "mid-magic": lambda r: 3,
    "header-only": lambda r: 24,  # magic, version, tensor and key counts
    "mid-key": lambda r: r.fields["llama.block_count"].offset + 10,
    "mid-vocabulary": lambda r: r.fields["tokenizer.ggml.tokens"].offset + 1000,
    "mid-tensor-table": lambda r: r.tensors[5].field.offset + 7,
    "no-tensor-data": lambda r: r.data_offset,
    "mid-tensor-data": lambda r: (r.data_offset + len(r.data)) // 2,
    # the file's last byte can be padding after the last tensor
    "last-data-byte-cut": lambda r: r.tensors[-1].data_offset + r.tensors[-1].n_bytes - 1,
}


@pytest.mark.parametrize("where", CUTS)
def test_truncated(good: Path, tmp_path: Path, where: str) -> None:
    cut = CUTS[where](gguf.GGUFReader(good))
    bad = tmp_path / f"cut-{cut}.gguf"
    bad.write_bytes(good.read_bytes()[:cut])
    message = load_or_error(bad)
    assert isinstance(message, str) and "not a valid GGUF file" in message, message


def test_cli_truncated_is_one_line_and_exit_2(good: Path, tmp_path: Path) -> None:
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good.read_bytes()[:good.stat().st_size // 2])
    res = subprocess.run([sys.executable, "-m", "conveyor.cli", "generate", "--model", str(bad),
                          "--max-tokens", "1"], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert res.returncode == 2, res.stderr
    (line,) = error_lines(res.stderr)
    assert line.startswith(f"conveyor: error: {bad}: not a valid GGUF file: "), line
    assert line.endswith(f"the file ({bad.stat().st_size} bytes): truncated or corrupted"), line


# --- (b) bit flips ----------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # a NaN scale, dequantized
@pytest.mark.parametrize("seed", range(72))
def test_bit_flips(good: Path, tmp_path: Path, seed: int) -> None:
    """One flipped bit, half the time in the header, metadata and tensor table (5% of the
    file), else in the tensor data, where it can still load: then it must generate."""
    data = bytearray(good.read_bytes())
    header = gguf.GGUFReader(good).data_offset
    rng = random.Random(seed)
    pos = rng.randrange(header) if seed % 2 else rng.randrange(header, len(data))
    data[pos] ^= 1 << rng.randrange(8)
    bad = tmp_path / f"flip-{pos}.gguf"
    bad.write_bytes(data)
    load_or_error(bad)


# --- (c) a tensor of the wrong shape or type, missing metadata or tensors ----------------------


def _reverse_dims(name: str) -> Edit:
    def edit(r: gguf.GGUFReader) -> None:
        dims = tensor(r, name).field.parts[3]
        dims[:] = dims[::-1].copy()
    return edit


def _set_type(name: str, ggml_type: gguf.GGMLQuantizationType) -> Edit:
    def edit(r: gguf.GGUFReader) -> None:
        tensor(r, name).field.parts[4][0] = ggml_type
    return edit


def _rename(part: Callable[[gguf.GGUFReader], np.ndarray], new: str) -> Edit:
    """Respell a name (a key's or a tensor's) as new, of the same length."""
    def edit(r: gguf.GGUFReader) -> None:
        part(r)[:] = np.frombuffer(new.encode(), np.uint8)
    return edit


def _set_dim(name: str, index: int, value: int) -> Edit:
    def edit(r: gguf.GGUFReader) -> None:
        tensor(r, name).field.parts[3][index] = value
    return edit


TENSOR_FAULTS = {
    # wk is [32 out, 64 in]: the same bytes read as [64, 32]
    "wrong-shape": (_reverse_dims("blk.0.attn_k.weight"),
                    r"layers\.0\.attention\.wk\.weight has shape \(64, 32\), expected \(32, 64\)"),
    "unsupported-type": (_set_type("blk.0.attn_norm.weight", Q.I32),  # as many bytes as F32
                         "blk.0.attn_norm.weight has ggml type I32, which the loader cannot read"),
    "wrong-type": (_set_type("blk.0.attn_q.weight", Q.Q4_0),  # Q8_0 data: 4352 bytes, not 2304
                   r"blk\.0\.attn_k\.weight starts at byte \d+, but blk\.0\.attn_q\.weight "
                   r"\(Q4_0 \(64, 64\)\) ends at \d+"),
    "partial-block-rows": (_set_dim("blk.0.attn_k.weight", 0, 48),
                           "not a valid GGUF file: .*48.* not a multiple of Q8_0 block size"),
    "missing-tensor": (_rename(lambda r: tensor(r, "blk.1.attn_output.weight").field.parts[1],
                               "blk.1.attn_q_norm.weight"),
                       r"missing layers\.1\.attention\.wo\.weight; "
                       r"unexpected layers\.1\.attention\.q_norm\.weight"),
    "unknown-tensor": (_rename(lambda r: tensor(r, "blk.1.ffn_up.weight").field.parts[1],
                               "blk.1.ffn_uq.weight"),
                       r"unsupported GGUF tensors: blk\.1\.ffn_uq\.weight"),
    "missing-key": (_rename(lambda r: r.fields["llama.context_length"].parts[1],
                            "llama.context_lengtx"),
                    "GGUF file has no 'llama.context_length' metadata"),
}


# --- (d) metadata that does not match the tensors; data of another block count -----------------


def _set_field(key: str, value: float) -> Edit:
    def edit(r: gguf.GGUFReader) -> None:
        r.fields[key].parts[-1][0] = value
    return edit


METADATA_FAULTS = {
    "block-count-3": (_set_field("llama.block_count", 3),
                      "llama.block_count is 3, but the file has tensors for 2 blocks"),
    "block-count-1": (_set_field("llama.block_count", 1),
                      "llama.block_count is 1, but the file has tensors for 2 blocks"),
    # built the expected tensors of 2**24 layers before: minutes, then the memory
    "block-count-huge": (_set_field("llama.block_count", 2**24 + 2),
                         "llama.block_count is 16777218, but the file has tensors for 2 blocks"),
    "ffn-length": (_set_field("llama.feed_forward_length", 96),
                   r"feed_forward\.w1\.weight has shape \(128, 64\), expected \(96, 64\)"),
    "zero-heads": (_set_field("llama.attention.head_count", 0),
                   "'llama.attention.head_count' is 0, expected a positive int"),
    "kv-heads": (_set_field("llama.attention.head_count_kv", 3),
                 "head_count 4 is not a multiple of head_count_kv 3"),
    "nan-eps": (_set_field("llama.attention.layer_norm_rms_epsilon", math.nan),
                "'llama.attention.layer_norm_rms_epsilon' is nan, expected a positive float"),
    "eos-past-vocab": (_set_field("tokenizer.ggml.eos_token_id", 100_000),
                       "eos_token_id 100000 is past the vocabulary's 271 tokens"),
}


EDITED = TENSOR_FAULTS | METADATA_FAULTS


@pytest.mark.parametrize("fault", EDITED)
def test_edited_files_fail_with_their_reason(good: Path, tmp_path: Path, fault: str) -> None:
    edit, expected = EDITED[fault]
    message = load_or_error(patched(good, tmp_path / f"{fault}.gguf", edit))
    assert isinstance(message, str) and re.search(expected, message), message


@pytest.mark.parametrize("name,rows", [("blk.0.attn_k.weight", -1), ("blk.0.attn_k.weight", 1),
                                       ("output.weight", -1)])
def test_data_with_another_block_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       name: str, rows: int) -> None:
    """A writer that stores a row of blocks fewer or more than the tensor table's shape says
    (the table keeps the shape; the next tensor's offset follows the data written)."""
    add_tensor = gguf.GGUFWriter.add_tensor

    def off_by_rows(self: gguf.GGUFWriter, tensor_name: str, t: np.ndarray, raw_shape=None,
                    raw_dtype=None, **kwargs) -> None:
        if tensor_name == name:
            raw_shape = t.shape
            t = t[:rows] if rows < 0 else np.concatenate([t, t[:rows]])
        add_tensor(self, tensor_name, t, raw_shape, raw_dtype, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", off_by_rows)
    message = load_or_error(_write(tmp_path / "off.gguf"))
    assert isinstance(message, str), message
    if name == "output.weight":  # the last tensor: its data runs past the end of the file
        assert "past the end of the file" in message, message
    else:
        assert "blk.0.attn_v.weight starts at byte" in message, message
        assert "blk.0.attn_k.weight (Q8_0 (32, 64)) ends" in message, message
