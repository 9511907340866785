"""The kernels of one tier's library, bound through ctypes for one dtype.

Each kernel has a float32 entry point (``<name>_f32``, in every tier) and a bfloat16 one
(``<name>_bf16``, in the tiers with bfloat16 arithmetic); a binding takes the one for its
dtype and checks what the C code assumes before calling it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from conveyor.kernels.activations import K_QUANTS
from conveyor.kernels import huge_pages
from conveyor.kernels.blocks import BLOCK_TYPES, DENSE_TYPES, WIDE_SCALARS, QuantizedWeight
from conveyor.kernels.signatures import bind, entry
from conveyor.kernels.structs import Layer, Shape, matrix

if TYPE_CHECKING:
    from conveyor.kernels.experts import MoEKernel

def kv_type(cache: torch.Tensor, dtype: torch.dtype, head_dim: int) -> int:
    """The kernels' code for a cache's storage (csrc/common.h): 0, the model dtype; 1, int8
    head rows of head_dim values and a float32 scale; 2, halves of a float32 model's values
    (model/kv_cache.py)."""
    if cache.dtype == torch.int8:
        assert cache.shape[-1] == head_dim + 4
        return 1
    assert cache.shape[-1] == head_dim
    if cache.dtype == torch.float16:
        assert dtype == torch.float32
        return 2
    assert cache.dtype == dtype
    return 0


class DecodeKernel:
    """Attention of single-token queries straight from the paged cache."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._fn = entry(lib, "paged_decode_attention", dtype)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor,
                 out: torch.Tensor, *, scale: float | None = None, window: int | None = None,
                 softcap: float | None = None) -> None:
        """q, out: [n, H, D] (rows may be strided, heads packed); caches: [blocks, block_size,
        KVH, D] of the dtype, float16 or int8 head rows (``kv_type``), contiguous; block_tables:
        [n, W] int32; context_lens: [n] int32. scale: the scores' (default head_dim^-0.5);
        window: the tokens a query attends to at most (its own and the window - 1 before it);
        softcap: scores become softcap * tanh(s / softcap)."""
        n, num_heads, dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        assert q.dtype == out.dtype == self.dtype and k_cache.dtype == v_cache.dtype
        storage = kv_type(k_cache, self.dtype, dim)
        assert block_tables.dtype == context_lens.dtype == torch.int32
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        assert block_tables.stride(1) == 1 and context_lens.is_contiguous()
        for t in (q, out):
            assert t.stride(2) == 1 and t.stride(1) == dim
        rc = self._fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), storage,
                      block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(),
                      out.data_ptr(), out.stride(0), n, num_heads, kv_heads, dim, block_size,
                      dim ** -0.5 if scale is None else scale, window or 0, softcap or 0.0,
                      torch.get_num_threads())
        if rc == -1:
            raise ValueError(f"paged_decode_attention: head_dim {dim} is not handled")
        if rc != 0:
            raise MemoryError("paged_decode_attention: no memory for its scratch buffers")


class AddRMSNorm:
    """``residual += x`` (if given), then RMSNorm, in one call."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._fn = entry(lib, "add_rms_norm", dtype)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
        """x: [rows, dim] (rows may be strided); residual: [rows, dim], contiguous, updated in
        place; weight: [dim]. Returns the normalised rows, new and contiguous."""
        rows, dim = x.shape
        assert x.dtype == weight.dtype == self.dtype and x.stride(1) == 1
        assert weight.is_contiguous() and weight.shape == (dim,)
        if residual is not None:
            assert residual.dtype == self.dtype and residual.is_contiguous()
            assert residual.shape == x.shape
        out = torch.empty(rows, dim, dtype=x.dtype)
        self._fn(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                 weight.data_ptr(), out.data_ptr(), out.stride(0), rows, dim, eps,
                 torch.get_num_threads())
        return out


# The gated feed-forward's activations (ModelConfig.hidden_act) by their kernels' names.
GLU_KERNELS = {"silu": "silu_mul", "gelu_pytorch_tanh": "gelu_tanh_mul"}


class GatedMul:
    """``act(gate) * up`` from the fused gate/up output, written over the gate: act is SiLU
    (``F.silu``) or GELU's tanh approximation (``F.gelu(approximate="tanh")``)."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype, act: str) -> None:
        self.dtype = dtype
        self.act = act
        self._fn = entry(lib, GLU_KERNELS[act], dtype)

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [rows, 2 * inter], each row's gate then up; overwritten. Returns the
        products: [rows, inter], a view of the gate's half."""
        rows, width = gate_up.shape
        assert gate_up.dtype == self.dtype and gate_up.stride(1) == 1 and width % 2 == 0
        self._fn(gate_up.data_ptr(), gate_up.stride(0), rows, width // 2, torch.get_num_threads())
        return gate_up[:, :width // 2]


class ArgmaxRows:
    """Each row's first maximum of float32 logits, as ``argmax(dim=-1)``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = bind(lib, "argmax_rows")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, cols] float32 (rows may be strided), on the CPU. Returns [rows] int64."""
        rows, cols = x.shape
        assert x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1
        out = torch.empty(rows, dtype=torch.int64)
        self._fn(x.data_ptr(), x.stride(0), rows, cols, out.data_ptr(), torch.get_num_threads())
        return out


class SampleRows:
    """One token a row drawn under temperature, top_k, top_p and min_p
    (``csrc/generic/sample.c``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = bind(lib, "sample_rows")

    def __call__(self, x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """x: [rows, cols] float32 logits (rows may be strided), on the CPU; per row:
        temperature (> 0), top_p, min_p float32, top_k int64 (0: off), u float64 uniforms.
        Returns [rows] int64."""
        rows, cols = x.shape
        assert x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1
        args = [temperature, top_k, top_p, min_p, u]
        for t, dtype in zip(args, (torch.float32, torch.int64, torch.float32, torch.float32,
                                   torch.float64)):
            assert t.dtype == dtype and t.shape == (rows,) and t.is_contiguous()
        out = torch.empty(rows, dtype=torch.int64)
        if self._fn(x.data_ptr(), x.stride(0), rows, cols, *(t.data_ptr() for t in args),
                    out.data_ptr(), torch.get_num_threads()):
            raise MemoryError("sample_rows: no memory for its scratch buffers")
        return out


class RopeKVWrite:
    """Rotate q and k in place and write k and v to the cache, in one call a layer."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._fn = entry(lib, "rope_kv_write", dtype)

    def __call__(self, qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """qk: [T, H + KVH, D], v: [T, KVH, D] (rows may be strided, heads packed); cos/sin:
        [T, 1, D]; slots: [T] int64; caches: [blocks, block_size, KVH, D] of the dtype, float16
        or int8 head rows (``kv_type``)."""
        tokens, num_qk, dim = qk.shape
        kv_heads = v.shape[1]
        assert qk.dtype == v.dtype == cos.dtype == sin.dtype == self.dtype
        assert k_cache.dtype == v_cache.dtype and slots.dtype == torch.int64
        storage = kv_type(k_cache, self.dtype, dim)
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and slots.is_contiguous()
        for t in (qk, v):
            assert t.stride(2) == 1 and t.stride(1) == dim
        assert cos.stride() == sin.stride() and cos.stride(2) == 1
        self._fn(qk.data_ptr(), qk.stride(0), v.data_ptr(), v.stride(0), cos.data_ptr(),
                 sin.data_ptr(), cos.stride(0), slots.data_ptr(), k_cache.data_ptr(),
                 v_cache.data_ptr(), storage, tokens, num_qk - kv_heads, kv_heads, dim,
                 torch.get_num_threads())


class DequantRows:
    """Rows of a matrix in GGUF blocks (in the format the dtype's block linears read), as
    dense rows of the model dtype: the embedding table's rows a step looks up."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._fn = entry(lib, "dequant_rows", dtype)

    def __call__(self, weight: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
        """ids: [n] int64 row numbers (in range: the engine checks token ids). Returns
        [n, in_features]."""
        ids = ids.contiguous()
        assert ids.dtype == torch.int64 and ids.device.type == "cpu"
        k = weight.blocks.shape[1] // weight.block_bytes * weight.block_values
        out = torch.empty(len(ids), k, dtype=self.dtype)
        assert not weight.repacked
        rc = self._fn(weight.blocks.data_ptr(), weight.blocks.stride(0), weight.ggml_type,
                      ids.data_ptr(), len(ids), k, out.data_ptr(), out.stride(0),
                      torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"dequant_rows: ggml type {weight.ggml_type} is not handled")
        return out


class QuantLinear:
    """``x @ w.T + bias`` with w in GGUF blocks, at any number of rows (``max_rows`` a call of
    the kernel; more are taken in pieces, or, by the bfloat16 FMA kernel, as dense rows)."""

    # bfloat16, AVX-512 FMAs (no AMX): the kernel's most rows (MAX_ROWS in
    # quant_linear_bf16.c). Past them each run is dequantized to bfloat16 and multiplied by
    # F.linear.
    FMA_ROWS = 8
    # bfloat16, AMX: faster than the prepacked linear up to 512 rows, slower past them, where
    # its activation tiles outgrow the L2 (docs/results/design-notes#amx-rows): more rows are
    # taken 512 at a time.
    AMX_ROWS = 512
    # float32, and batch invariance at either dtype: any number of rows (the kernels' own
    # blocking)
    ANY_ROWS = 1 << 30
    # the output rows dequantized to bfloat16 at a time past FMA_ROWS (_dense_pieces)
    DENSE_PIECE = 1024

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype, invariant: bool = False) -> None:
        """invariant: each row's result the same whatever the other rows (batch invariance):
        one kernel, a row's sums in one order, at every row count (bfloat16: dot products on
        the loader's weights rounded; float32: the few-rows kernel)."""
        self.dtype = dtype
        self.invariant = invariant
        self._fn = entry(lib, "quant_linear", dtype)
        self.amx = dtype == torch.bfloat16 and bool(bind(lib, "has_amx")())
        # the bfloat16 kernels read Q4_0, Q4_1 and Q8_0 with their scalars widened
        self.wide = dtype == torch.bfloat16
        # the float32 kernels read every block type and dense rows; the bfloat16 ones the
        # block types
        self.types = BLOCK_TYPES - set(DENSE_TYPES.values() if self.wide else ())
        self.max_rows = (self.ANY_ROWS if dtype == torch.float32 or invariant
                         else self.AMX_ROWS if self.amx else self.FMA_ROWS)
        self._dense_rows = (DequantRows(lib, dtype) if self.wide and not self.amx
                            and not invariant else None)

    def in_format(self, weight: QuantizedWeight) -> QuantizedWeight:
        """The weight's blocks as this kernel reads them."""
        return self.lookup_format(weight)

    def lookup_format(self, weight: QuantizedWeight) -> QuantizedWeight:
        """The weight's blocks as the float kernels and ``DequantRows`` read them."""
        return weight.widened() if self.wide and weight.ggml_type in WIDE_SCALARS else weight

    def __call__(self, x: torch.Tensor, weight: QuantizedWeight | tuple[QuantizedWeight, ...],
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [rows, in] (rows may be strided); weight: in_format's, or runs of output rows
        (a fused linear's parts); bias: [out]. Returns [rows, out]."""
        runs = weight if isinstance(weight, tuple) else (weight,)
        rows, k = x.shape
        n = sum(w.blocks.shape[0] for w in runs)
        assert x.dtype == self.dtype and x.stride(1) == 1
        assert bias is None or (bias.dtype == self.dtype and bias.is_contiguous())
        y = torch.empty(rows, n, dtype=self.dtype)
        n0 = 0
        for w in runs:
            assert w.wide == (self.wide and w.ggml_type in WIDE_SCALARS)
            assert w.ggml_type in self.types
            assert w.blocks.shape[1] == k // w.block_values * w.block_bytes
            part = None if bias is None else bias[n0:n0 + w.blocks.shape[0]]
            whole = self._takes_whole(rows, w)
            if rows > self.max_rows and self._dense_rows is not None and not whole:
                self._dense_pieces(x, w, part, y[:, n0:n0 + w.blocks.shape[0]])
            else:
                piece = rows if whole else self.max_rows
                for m0 in range(0, rows, piece):
                    m1 = min(rows, m0 + piece)
                    self._call(x[m0:m1], w, part, y[m0:m1, n0:])
            n0 += w.blocks.shape[0]
        return y

    def _takes_whole(self, rows: int, weight: QuantizedWeight) -> bool:
        """Whether one kernel call takes all ``rows`` rows past ``max_rows``."""
        return False

    def _dense_pieces(self, x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None,
                      y: torch.Tensor) -> None:
        """y = x w^T (+ bias), w dequantized DENSE_PIECE output rows at a time: a large matrix
        (a vocabulary's head) dequantized whole and multiplied was several times slower
        (docs/results/moe#dense-pieces)."""
        n = w.blocks.shape[0]
        for p0 in range(0, n, self.DENSE_PIECE):
            p1 = min(n, p0 + self.DENSE_PIECE)
            dense = self._dense_rows(w, torch.arange(p0, p1))
            y[:, p0:p1] = F.linear(x, dense, None if bias is None else bias[p0:p1])

    def _call(self, x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None,
              y: torch.Tensor) -> None:
        rows, k = x.shape
        assert not w.repacked
        rc = self._fn(x.data_ptr(), x.stride(0), w.blocks.data_ptr(), w.blocks.stride(0),
                      w.ggml_type, None if bias is None else bias.data_ptr(), y.data_ptr(),
                      y.stride(0), rows, w.blocks.shape[0], k, int(self.invariant),
                      torch.get_num_threads())
        if rc == -2:
            raise MemoryError("quant_linear: no memory for its scratch buffer")
        if rc != 0:
            raise ValueError(f"quant_linear: {rows} rows of {k} with ggml type "
                             f"{w.ggml_type} is not handled")


class IntQuantLinear(QuantLinear):
    """``QuantLinear`` on integer activations (``--activation-quant``): each run of inputs
    quantized to int16 (15 bits) or int8 (``activations.quantize``, llama.cpp's Q8_0, and Q8_K
    on the K-quants) and multiplied with the blocks' integers (csrc/avx512/quant_linear_int.c:
    VNNI; csrc/avx2/: pmaddubsw; plain C below). Calls of more than ``int_rows`` rows, and dense
    weights, take the float kernels where they are faster (docs/results/activation-quant): at
    the avx512/amx tiers past a decode's few rows. Where the tier's library repacks the
    K-quants for int8 (the avx2 tier: csrc/repacked.h) they are read so at every row count,
    faster than the float kernels; the other weights are in the float kernels' format."""

    LEVELS = {"int16": 16383, "int8": 127, "auto": 127}
    # the most rows the integer kernel is faster at, at the avx512/amx tiers (AMX or the few-row
    # FMA kernel take more); its two products a value make int16 faster only at one; auto
    # leaves the 32-weight types to the float kernels (library.AUTO_INT8_TIERS)
    INT_ROWS = {"int16": 1, "int8": 4, "auto": 0}
    # the most rows int8 takes K-quant calls at, on its super-block integer sums, by tier: at
    # avx512 faster than the FMA kernel and the dense rows up to 16
    # (docs/results/moe#int8-super-blocks); AMX unmeasured, so int_rows there; at avx2 the
    # repacked K-quants take every call
    SUPERBLOCK_ROWS = {"avx512": 16}

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype, mode: str, tier: str) -> None:
        """mode: int16, int8, or auto (int8 on the K-quants alone)."""
        super().__init__(lib, dtype)
        self.mode, self.levels, self.int_rows = mode, self.LEVELS[mode], self.INT_ROWS[mode]
        self.superblock_rows = self.SUPERBLOCK_ROWS.get(tier, 0) if self.levels == 127 else 0
        self._int_fn = entry(lib, "quant_linear_int", dtype)
        self._repack = (bind(lib, "repack_rows"), bind(lib, "repacked_row_bytes")) if (
            self.levels == 127 and dtype == torch.float32 and hasattr(lib, "repack_rows")) else None

    def numerics(self) -> str:
        """What this linear multiplies, in a few words (the start-up line, ``conveyor env``)."""
        which = " on the K-quants (auto)" if self.mode == "auto" else ""
        layout = ", the K-quants repacked in groups of 8 rows" if self._repack else ""
        return f"{'int8' if self.levels == 127 else 'int16'} activations{which}{layout}"

    def in_format(self, weight: QuantizedWeight) -> QuantizedWeight:
        """The float kernels' format, or the K-quants repacked where this tier's int8 kernel
        reads them so (a copy, rows padded to a multiple of 8 in its storage)."""
        weight = self.lookup_format(weight)
        if self._repack is None or weight.ggml_type not in K_QUANTS or weight.repacked:
            return weight
        repack, row_bytes = self._repack
        n, k = weight.blocks.shape[0], weight.in_features
        width = row_bytes(weight.ggml_type, k)
        if width < 0:
            return weight
        out = huge_pages.zeros((-(-n // 8) * 8, width), torch.uint8, torch.device("cpu"))
        code = repack(weight.blocks.data_ptr(), weight.blocks.stride(0), weight.ggml_type, n, k,
                      out.data_ptr(), torch.get_num_threads())
        assert code > 0
        return QuantizedWeight(weight.ggml_type, out[:n], repacked=code,
                               repacked_bytes=width // (k // weight.block_values))

    def takes(self, rows: int, weight: QuantizedWeight) -> bool:
        """Whether a call of ``rows`` rows on these blocks runs on integers."""
        if weight.ggml_type in DENSE_TYPES.values():
            return False
        return bool(weight.repacked) or rows <= self.int_rows or (
            weight.ggml_type in K_QUANTS and rows <= self.superblock_rows)

    def _takes_whole(self, rows: int, weight: QuantizedWeight) -> bool:
        return self.takes(rows, weight)

    def _call(self, x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None,
              y: torch.Tensor) -> None:
        rows, k = x.shape
        if not self.takes(rows, w):
            return super()._call(x, w, bias, y)
        rc = self._int_fn(x.data_ptr(), x.stride(0), w.blocks.data_ptr(), w.blocks.stride(0),
                          w.kernel_type, None if bias is None else bias.data_ptr(), y.data_ptr(),
                          y.stride(0), rows, w.blocks.shape[0], k, self.levels,
                          torch.get_num_threads())
        if rc == -2:
            raise MemoryError("quant_linear_int: no memory for its scratch buffers")
        if rc != 0:
            raise ValueError(f"quant_linear_int: {rows} rows of {k} with ggml type "
                             f"{w.kernel_type} is not handled")


@dataclass
class StackLayer:
    """One decoder layer's weights and KV cache, as ``decode_stack`` reads them."""

    attention_norm: torch.Tensor  # [hidden], the model dtype
    ffn_norm: torch.Tensor
    wqkv: tuple[QuantizedWeight, ...]  # q, k and v rows, fused: runs of one type each
    wo: tuple[QuantizedWeight, ...]
    w13: tuple[QuantizedWeight, ...]   # gate and up rows, fused
    w2: tuple[QuantizedWeight, ...]
    qkv_bias: torch.Tensor | None
    k_cache: torch.Tensor         # [blocks, block_size, kv_heads, head_dim], contiguous (or
                                  # int8 head rows: kv_type)
    v_cache: torch.Tensor
    window: int | None = None     # its sliding window, if it has one
    rope: int = 0                 # its rope table (ModelConfig.rope_index)
    q_norm: torch.Tensor | None = None  # [head_dim]: per-head norms of q and k (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    post_attention_norm: torch.Tensor | None = None  # [hidden]: Gemma's after-norms
    post_ffn_norm: torch.Tensor | None = None
    experts: MoEKernel | None = None  # the feed-forward's experts (then w13, w2 unused)


class DecodeStack:
    """``decode_stack`` bound to one model's layers: call it with a step's embeddings, up to
    ``max_rows`` (the rows a block-linear call takes). ``levels``, ``int_rows`` and
    ``superblock_rows``: an ``IntQuantLinear``'s, for the calls its integer linears take
    (levels 0: none); ``invariant``: a ``QuantLinear``'s."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype, layers: list[StackLayer], *,
                 max_rows: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 eps: float, scale: float | None = None, softcap: float | None = None,
                 act: str = "silu", levels: int = 0, int_rows: int = 0,
                 superblock_rows: int = 0, invariant: bool = False) -> None:
        self.dtype = dtype
        self.max_rows = max_rows
        self._fn = entry(lib, "decode_stack", dtype)

        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        storage = kv_type(layers[0].k_cache, dtype, head_dim)
        for layer in layers:
            for t in (layer.attention_norm, layer.ffn_norm, layer.q_norm, layer.k_norm,
                      layer.post_attention_norm, layer.post_ffn_norm):
                assert t is None or t.dtype == dtype and t.is_contiguous()
            for t in (layer.k_cache, layer.v_cache):
                assert kv_type(t, dtype, head_dim) == storage and t.is_contiguous()
            assert (layer.q_norm is None) == (layer.k_norm is None)
        self._layers = (Layer * len(layers))(*[Layer(
            l.attention_norm.data_ptr(), l.ffn_norm.data_ptr(), *[
                matrix(m, dtype) for m in (l.wqkv, l.wo, l.w13, l.w2)], ptr(l.qkv_bias),
            l.k_cache.data_ptr(), l.v_cache.data_ptr(), l.window or 0, l.rope, ptr(l.q_norm),
            ptr(l.k_norm), ptr(l.post_attention_norm), ptr(l.post_ffn_norm),
            None if l.experts is None else l.experts.address) for l in layers])
        # the MoE layers' experts, which share one shape (ModelConfig.moe): one sizes the scratch
        self._experts = next((layer.experts for layer in layers if layer.experts is not None),
                             None)
        self.ropes = 1 + max(layer.rope for layer in layers)
        self._keep = layers  # the pointers above are into these tensors
        self.hidden = layers[0].attention_norm.shape[0]
        self._shape = Shape(self.hidden, heads, kv_heads, head_dim, intermediate,
                             layers[0].k_cache.shape[1], eps,
                             head_dim ** -0.5 if scale is None else scale, softcap or 0.0,
                             int(act == "gelu_pytorch_tanh"), levels, int_rows,
                             int(superblock_rows), int(invariant), storage)
        # a row's activations between the kernels (decode_stack.c); kept across steps, grown
        # as rows grow
        self._row_width = (2 * self.hidden + (2 * heads + 2 * kv_heads) * head_dim
                           + 2 * intermediate)
        self._scratch = torch.empty(0, dtype=dtype)

    def __call__(self, h: torch.Tensor, residual: torch.Tensor,
                 ropes: list[tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
        """h: [rows, hidden] embeddings in, last layer's output out; residual: [rows, hidden]
        set to the stream before it; ropes: each table's cos/sin, [rows, 1, head_dim]; slots:
        [rows] int64; block_tables: [rows, W], context_lens: [rows], int32."""
        rows = h.shape[0]
        assert 1 <= rows <= self.max_rows and h.shape == residual.shape == (rows, self.hidden)
        assert h.dtype == residual.dtype == self.dtype and len(ropes) >= self.ropes
        for t in (t for rope in ropes for t in rope):
            assert t.dtype == self.dtype and t.is_contiguous()
        assert h.is_contiguous() and residual.is_contiguous()
        assert slots.dtype == torch.int64 and slots.is_contiguous()
        assert block_tables.dtype == context_lens.dtype == torch.int32
        assert block_tables.stride(1) == 1 and context_lens.is_contiguous()
        width = rows * self._row_width + (
            0 if self._experts is None
            else -(-self._experts.scratch_bytes(rows) // self._scratch.element_size()))
        if self._scratch.numel() < width:
            self._scratch = torch.empty(width, dtype=self.dtype)
        cos = (ctypes.c_void_p * 2)(*[c.data_ptr() for c, _ in ropes[:2]])
        sin = (ctypes.c_void_p * 2)(*[s.data_ptr() for _, s in ropes[:2]])
        rc = self._fn(self._layers, len(self._keep), ctypes.byref(self._shape), h.data_ptr(),
                      residual.data_ptr(), rows, cos, sin,
                      slots.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
                      context_lens.data_ptr(), self._scratch.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"decode_stack failed ({rc})")
