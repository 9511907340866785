"""The ctypes copies of ``csrc/stack.h``'s structs, which ``decode_stack`` and ``moe_ffn`` read:
one module for the dense and the expert bindings. ``csrc/layout.c`` exports the compiler's
sizes and offsets of them, and ``tests/kernels/test_structs.py`` holds these copies to it, so a
field added on one side only fails a test instead of shifting what the kernels read."""

from __future__ import annotations

import ctypes

import torch

from conveyor.kernels.blocks import WIDE_SCALARS, QuantizedWeight

MAX_RUNS = 3  # stack.h's: the runs of one ggml type a linear's rows come in


class Run(ctypes.Structure):
    _fields_ = [("blocks", ctypes.c_void_p), ("row_bytes", ctypes.c_int64),
                ("type", ctypes.c_int32), ("rows", ctypes.c_int32)]


class Matrix(ctypes.Structure):
    _fields_ = [("run", Run * MAX_RUNS), ("runs", ctypes.c_int32)]


class Experts(ctypes.Structure):
    _fields_ = [("router", ctypes.c_void_p), ("w13", ctypes.c_void_p), ("w2", ctypes.c_void_p),
                ("experts", ctypes.c_int32), ("used", ctypes.c_int32),
                ("intermediate", ctypes.c_int32), ("norm_topk", ctypes.c_int32),
                ("max_rows", ctypes.c_int32), ("stats", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    _fields_ = [("attention_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p),
                ("wqkv", Matrix), ("wo", Matrix), ("w13", Matrix), ("w2", Matrix),
                ("qkv_bias", ctypes.c_void_p), ("k_cache", ctypes.c_void_p),
                ("v_cache", ctypes.c_void_p), ("window", ctypes.c_int32),
                ("rope", ctypes.c_int32), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("post_attention_norm", ctypes.c_void_p),
                ("post_ffn_norm", ctypes.c_void_p), ("experts", ctypes.c_void_p)]


class Shape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in ("hidden", "heads", "kv_heads", "dim",
                                                    "intermediate", "block_size")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
        ("gelu", ctypes.c_int), ("levels", ctypes.c_int), ("int_rows", ctypes.c_int),
        ("superblock_rows", ctypes.c_int), ("invariant", ctypes.c_int), ("kv_type", ctypes.c_int)]


STRUCTS = (Run, Matrix, Experts, Layer, Shape)


def matrix(runs: tuple[QuantizedWeight, ...], dtype: torch.dtype) -> Matrix:
    """A linear's runs as the C side reads them."""
    assert len(runs) <= MAX_RUNS  # (none: a layer whose experts replace them)
    for w in runs:
        assert w.blocks.stride(1) == 1
        assert w.wide == (dtype == torch.bfloat16 and w.ggml_type in WIDE_SCALARS)
    return Matrix((Run * MAX_RUNS)(*[
        Run(w.blocks.data_ptr(), w.blocks.stride(0), w.kernel_type, w.blocks.shape[0])
        for w in runs]), len(runs))
