"""Small C kernels for the bfloat16 CPU path (``kernels/*.c``): built once into one library with
the system C compiler, cached, and called through ctypes.

- ``paged_decode.c``: decode attention. Gathering a batch's pages into contiguous K/V and then
  running SDPA reads the cache three times and pads every context to the longest; the kernel
  reads each page once, in place.
- ``rms_norm.c``: residual add + RMSNorm in one call instead of ~10 small PyTorch ops.
- ``silu_mul.c``: the feed-forward's SiLU(gate) * up in one pass, written over the gate.
- ``rope_kv.c``: rotary embedding of q and k and the K/V cache write in one call a layer.
- ``quant_linear.c``: a linear read from a GGUF's Q4_0/Q4_1/Q8_0 blocks (about a third, a third
  and a half of bfloat16's bytes), giving the bfloat16 model's weights bit for bit: with AMX
  tiles up to 512 rows, else with AVX-512 FMAs for a few rows.
- ``argmax.c``: greedy sampling's argmax over each row of the logits (PyTorch's takes ~2 ms a
  step at 32 rows).
- ``decode_stack.c``: all decoder layers of a step of single-token queries in one call (any
  batch the block linear takes; 8 requests without AMX), made of the kernels above, so that such
  a step pays no per-op Python cost. Decodes, and the tokens of short prompt chunks as queries of
  their own (``runner.UNIFIED_CHUNK_WORK``).

They are used for bfloat16 on the CPU when a compiler is there; otherwise (or with
``CONVEYOR_CPU_KERNELS=off``) the model runs the plain PyTorch path (gather + SDPA, F.rms_norm),
which gives the same tokens up to bfloat16 rounding.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from conveyor.model.gguf_file import QUANT_BLOCK_BYTES, QuantizedWeight

logger = logging.getLogger("conveyor")

KERNELS = Path(__file__).with_name("kernels")
SOURCES = ("paged_decode.c", "rms_norm.c", "silu_mul.c", "rope_kv.c", "quant_linear.c",
           "decode_stack.c", "argmax.c")
HEAD_DIMS = (64, 128)  # the specialisations paged_decode.c compiles
# Fast math lets GCC vectorise the dot products and exp; it is not passed when linking, so the
# library does not switch the whole process to flush-to-zero.
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
LINK_FLAGS = ["-shared", "-fopenmp"]


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "conveyor" / "kernels"


def _build(compiler: str) -> Path:
    """The compiled library, built if these sources, compiler and CPU have none in the cache."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True).stdout
    texts = [(KERNELS / name).read_text() for name in (*SOURCES, "bf16.h")]
    key = hashlib.sha256("\0".join([*texts, " ".join(COMPILE_FLAGS + LINK_FLAGS), version,
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"conveyor-kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [str(Path(tmp) / f"{Path(name).stem}.o") for name in SOURCES]
        lib = Path(tmp) / "kernels.so"
        for name, obj in zip(SOURCES, objects):
            subprocess.run([compiler, *COMPILE_FLAGS, "-c", str(KERNELS / name), "-o", obj],
                           capture_output=True, text=True, check=True)
        subprocess.run([compiler, *LINK_FLAGS, *objects, "-o", str(lib), "-lm"],
                       capture_output=True, text=True, check=True)
        os.replace(lib, target)  # atomic: a concurrent build of the same key is harmless
    return target


class DecodeKernel:
    """``paged_decode_attention`` bound through ctypes; ``__call__`` checks what C assumes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.paged_decode_attention
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [p, i64, p, p, p, i64, p, p, i64, i32, i32, i32, i32, i32, ctypes.c_float,
                       i32]
        fn.restype = i32
        self._fn = fn

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor,
                 out: torch.Tensor) -> None:
        """q, out: [n, H, D] (rows may be strided, heads packed); caches: [blocks, block_size,
        KVH, D], contiguous; block_tables: [n, W] int32; context_lens: [n] int32."""
        n, num_heads, dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        assert q.dtype == out.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16
        assert block_tables.dtype == context_lens.dtype == torch.int32
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        assert block_tables.stride(1) == 1 and context_lens.is_contiguous()
        for t in (q, out):
            assert t.stride(2) == 1 and t.stride(1) == dim
        rc = self._fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                      block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(),
                      out.data_ptr(), out.stride(0), n, num_heads, kv_heads, dim, block_size,
                      dim ** -0.5, torch.get_num_threads())
        if rc == -1:
            raise ValueError(f"paged_decode_attention: head_dim {dim} not in {HEAD_DIMS}")
        if rc != 0:
            raise MemoryError("paged_decode_attention: no memory for its scratch buffers")


class AddRMSNorm:
    """``add_rms_norm`` bound through ctypes: ``residual += x`` (if given), then RMSNorm."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.add_rms_norm
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [p, i64, p, p, p, i64, i32, i32, ctypes.c_float, i32]
        fn.restype = None
        self._fn = fn

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
        """x: [rows, dim] bfloat16 (rows may be strided); residual: [rows, dim], contiguous,
        updated in place; weight: [dim]. Returns the normalised rows, new and contiguous."""
        rows, dim = x.shape
        assert x.dtype == weight.dtype == torch.bfloat16 and x.stride(1) == 1
        assert weight.is_contiguous() and weight.shape == (dim,)
        if residual is not None:
            assert residual.dtype == torch.bfloat16 and residual.is_contiguous()
            assert residual.shape == x.shape
        out = torch.empty(rows, dim, dtype=x.dtype)
        self._fn(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                 weight.data_ptr(), out.data_ptr(), out.stride(0), rows, dim, eps,
                 torch.get_num_threads())
        return out


class SiluMul:
    """``silu_mul`` bound through ctypes: ``F.silu(gate) * up`` from the fused gate/up output."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.silu_mul
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = None
        self._fn = fn

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [rows, 2 * inter] bfloat16, each row's gate then up; overwritten. Returns
        the products: [rows, inter], a view of the gate's half."""
        rows, width = gate_up.shape
        assert gate_up.dtype == torch.bfloat16 and gate_up.stride(1) == 1 and width % 2 == 0
        self._fn(gate_up.data_ptr(), gate_up.stride(0), rows, width // 2, torch.get_num_threads())
        return gate_up[:, :width // 2]


class ArgmaxRows:
    """``argmax_rows`` bound through ctypes: each row's first maximum, as ``argmax(dim=-1)``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.argmax_rows
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [p, i64, i32, i64, p, i32]
        fn.restype = None
        self._fn = fn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, cols] float32 (rows may be strided), on the CPU. Returns [rows] int64."""
        rows, cols = x.shape
        assert x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1
        out = torch.empty(rows, dtype=torch.int64)
        self._fn(x.data_ptr(), x.stride(0), rows, cols, out.data_ptr(), torch.get_num_threads())
        return out


class RopeKVWrite:
    """``rope_kv_write`` bound through ctypes: rotate q and k in place, write k and v to cache."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.rope_kv_write
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [p, i64, p, i64, p, p, i64, p, p, p, i32, i32, i32, i32, i32]
        fn.restype = None
        self._fn = fn

    def __call__(self, qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """qk: [T, H + KVH, D], v: [T, KVH, D] bfloat16 (rows may be strided, heads packed);
        cos/sin: [T, 1, D]; slots: [T] int64; caches: [blocks, block_size, KVH, D]."""
        tokens, num_qk, dim = qk.shape
        kv_heads = v.shape[1]
        assert qk.dtype == v.dtype == cos.dtype == sin.dtype == k_cache.dtype == torch.bfloat16
        assert v_cache.dtype == torch.bfloat16 and slots.dtype == torch.int64
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and slots.is_contiguous()
        for t in (qk, v):
            assert t.stride(2) == 1 and t.stride(1) == dim
        assert cos.stride() == sin.stride() and cos.stride(2) == 1
        self._fn(qk.data_ptr(), qk.stride(0), v.data_ptr(), v.stride(0), cos.data_ptr(),
                 sin.data_ptr(), cos.stride(0), slots.data_ptr(), k_cache.data_ptr(),
                 v_cache.data_ptr(), tokens, num_qk - kv_heads, kv_heads, dim,
                 torch.get_num_threads())


class QuantLinear:
    """``quant_linear`` bound through ctypes: ``x @ w.T + bias`` with w in GGUF blocks."""

    # With AVX-512 FMAs (no AMX): up to this many rows it beat the prepacked bfloat16 linear by
    # 1.3-1.4x on SmolLM2's layers (dequantizing is compute-bound); at 5-8 rows they tie.
    FMA_ROWS = 4
    # With AMX: 0.8x the prepacked linear's time from 1 to 64 rows, ~0.95x up to 512, 1.35x at
    # 2048 (SmolLM2's layers, alternated runs), where its activation tiles outgrow the L2.
    AMX_ROWS = 512

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.quant_linear
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [p, i64, p, i64, i32, p, p, i64, i32, i32, i32, i32]
        fn.restype = i32
        self._fn = fn
        self._set_amx = lib.set_amx
        self.set_amx(True)

    def set_amx(self, wanted: bool) -> None:
        """Use AMX where the CPU and OS allow it (the default), or the FMA kernel (for tests
        and comparisons). Process-wide: the decode stack's linears follow it too, but a stack
        already built keeps its row limit (``DecodeStack.FMA_ROWS`` without AMX)."""
        self.amx = bool(self._set_amx(int(wanted)))
        self.max_rows = self.AMX_ROWS if self.amx else self.FMA_ROWS

    def __call__(self, x: torch.Tensor, weight: QuantizedWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [rows, in] bfloat16 (rows may be strided); bias: [out] bfloat16. Returns [rows, out]."""
        rows, k = x.shape
        n = weight.blocks.shape[0]
        assert x.dtype == torch.bfloat16 and x.stride(1) == 1
        assert weight.blocks.shape[1] == k // 32 * QUANT_BLOCK_BYTES[weight.ggml_type]
        assert bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())
        y = torch.empty(rows, n, dtype=torch.bfloat16)
        rc = self._fn(x.data_ptr(), x.stride(0), weight.blocks.data_ptr(), weight.blocks.stride(0),
                      weight.ggml_type, None if bias is None else bias.data_ptr(), y.data_ptr(),
                      y.stride(0), rows, n, k, torch.get_num_threads())
        if rc == -2:
            raise MemoryError("quant_linear: no memory for its scratch buffer")
        if rc != 0:
            raise ValueError(f"quant_linear: {rows} rows of {k} with ggml type "
                             f"{weight.ggml_type} is not handled")
        return y


class _Matrix(ctypes.Structure):
    _fields_ = [("blocks", ctypes.c_void_p), ("row_bytes", ctypes.c_int64),
                ("type", ctypes.c_int32)]


class _Layer(ctypes.Structure):
    _fields_ = [("attention_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p),
                ("wqkv", _Matrix), ("wo", _Matrix), ("w13", _Matrix), ("w2", _Matrix),
                ("qkv_bias", ctypes.c_void_p), ("k_cache", ctypes.c_void_p),
                ("v_cache", ctypes.c_void_p)]


class _Shape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in ("hidden", "heads", "kv_heads", "dim",
                                                    "intermediate", "block_size")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


@dataclass
class StackLayer:
    """One decoder layer's weights and KV cache, as ``decode_stack`` reads them."""

    attention_norm: torch.Tensor  # [hidden] bfloat16
    ffn_norm: torch.Tensor
    wqkv: QuantizedWeight         # q, k and v rows, fused
    wo: QuantizedWeight
    w13: QuantizedWeight          # gate and up rows, fused
    w2: QuantizedWeight
    qkv_bias: torch.Tensor | None
    k_cache: torch.Tensor         # [blocks, block_size, kv_heads, head_dim], contiguous
    v_cache: torch.Tensor


class DecodeStack:
    """``decode_stack`` bound to one model's layers: call it with a step's embeddings."""

    # Without AMX, the FMA kernel's limit (MAX_ROWS in quant_linear.c): from 5 to 8 rows its
    # linears only tie the prepacked matmul, but a step without ~20 Python-side ops a layer
    # still wins (29.9 vs 41.2 ms a step at 6 decodes, 35.5 vs 43.5 at 8, SmolLM2, alternated).
    # With AMX, as many rows as the linears take.
    FMA_ROWS = 8

    def __init__(self, lib: ctypes.CDLL, layers: list[StackLayer], *, max_rows: int, heads: int,
                 kv_heads: int, head_dim: int, intermediate: int, eps: float) -> None:
        self.max_rows = max_rows
        fn = lib.decode_stack
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [p, i32, p, p, p, i32, p, p, p, p, i64, p, i32]
        fn.restype = i32
        self._fn = fn

        def matrix(w: QuantizedWeight) -> _Matrix:
            assert w.blocks.is_contiguous()
            return _Matrix(w.blocks.data_ptr(), w.blocks.stride(0), w.ggml_type)

        for layer in layers:
            for t in (layer.attention_norm, layer.ffn_norm, layer.k_cache, layer.v_cache):
                assert t.dtype == torch.bfloat16 and t.is_contiguous()
        self._layers = (_Layer * len(layers))(*[_Layer(
            l.attention_norm.data_ptr(), l.ffn_norm.data_ptr(), matrix(l.wqkv), matrix(l.wo),
            matrix(l.w13), matrix(l.w2), None if l.qkv_bias is None else l.qkv_bias.data_ptr(),
            l.k_cache.data_ptr(), l.v_cache.data_ptr()) for l in layers])
        self._keep = layers  # the pointers above are into these tensors
        self.hidden = layers[0].attention_norm.shape[0]
        self._shape = _Shape(self.hidden, heads, kv_heads, head_dim, intermediate,
                             layers[0].k_cache.shape[1], eps, head_dim ** -0.5)

    def __call__(self, h: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor) -> None:
        """h: [rows, hidden] embeddings in, last layer's output out; residual: [rows, hidden]
        set to the stream before it; cos/sin: [rows, 1, head_dim]; slots: [rows] int64;
        block_tables: [rows, W], context_lens: [rows], int32."""
        rows = h.shape[0]
        assert 1 <= rows <= self.max_rows and h.shape == residual.shape == (rows, self.hidden)
        assert h.dtype == residual.dtype == cos.dtype == sin.dtype == torch.bfloat16
        assert h.is_contiguous() and residual.is_contiguous() and cos.is_contiguous()
        assert sin.is_contiguous() and slots.dtype == torch.int64 and slots.is_contiguous()
        assert block_tables.dtype == context_lens.dtype == torch.int32
        assert block_tables.stride(1) == 1 and context_lens.is_contiguous()
        rc = self._fn(self._layers, len(self._keep), ctypes.byref(self._shape), h.data_ptr(),
                      residual.data_ptr(), rows, cos.data_ptr(), sin.data_ptr(),
                      slots.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
                      context_lens.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"decode_stack failed ({rc})")


@dataclass
class CPUKernels:
    decode_attention: DecodeKernel | None  # None where the CPU lacks AVX-512 BF16
    add_rms_norm: AddRMSNorm
    silu_mul: SiluMul
    rope_kv_write: RopeKVWrite
    quant_linear: QuantLinear | None      # likewise
    argmax_rows: ArgmaxRows
    lib: ctypes.CDLL

    def decode_stack(self, layers: list[StackLayer], **shape) -> DecodeStack | None:
        """The one-call layer stack over these layers (None without ``quant_linear``)."""
        q = self.quant_linear
        return None if q is None else DecodeStack(
            self.lib, layers, max_rows=q.max_rows if q.amx else DecodeStack.FMA_ROWS, **shape)


@functools.cache
def _load() -> CPUKernels | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: the CPU kernels are off, the model runs plain "
                       "PyTorch (slower)")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = (getattr(e, "stderr", "") or str(e)).strip()
        logger.warning("could not build the CPU kernels, running plain PyTorch: %s",
                       detail.splitlines()[-1] if detail else e)
        return None
    avx512 = lib.has_avx512_bf16()
    return CPUKernels(DecodeKernel(lib) if avx512 else None, AddRMSNorm(lib), SiluMul(lib),
                      RopeKVWrite(lib), QuantLinear(lib) if avx512 else None, ArgmaxRows(lib),
                      lib)


def cpu_kernels(device: torch.device, dtype: torch.dtype, head_dim: int) -> CPUKernels | None:
    """The kernels when they apply here (CPU, bfloat16, a specialised head_dim) and build."""
    if (device.type != "cpu" or dtype != torch.bfloat16 or head_dim not in HEAD_DIMS
            or os.environ.get("CONVEYOR_CPU_KERNELS", "").lower() == "off"):
        return None
    return _load()
