"""``moe_ffn`` (csrc/moe_ffn.c) bound to one layer's experts: the router, the grouping and every
chosen expert of a step in one call, the experts side by side across threads. The Python
path (model/moe.py) computes the same, an expert at a time."""

from __future__ import annotations

import ctypes

import torch

from conveyor.kernels.blocks import QuantizedWeight
from conveyor.kernels.signatures import entry
from conveyor.kernels.structs import Experts, Matrix, Shape, matrix

# the pieces moe_ffn takes from its scratch, each aligned to 64 bytes
_PIECES, _ALIGN = 11, 64


class MoEKernel:
    """One layer's experts. ``max_rows``, ``levels``, ``int_rows``, ``superblock_rows`` and
    ``invariant``: the block linear's (``QuantLinear``, ``IntQuantLinear``), so that each
    expert's calls go where the Python path's go."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype, router: torch.Tensor,
                 w13: list[tuple[QuantizedWeight, ...]], w2: list[tuple[QuantizedWeight, ...]],
                 *, used: int, norm_topk: bool, act: str, stats: torch.Tensor, max_rows: int,
                 levels: int = 0, int_rows: int = 0, superblock_rows: int = 0,
                 invariant: bool = False) -> None:
        """router: [experts, hidden] float32; w13, w2: each expert's runs; stats: int64 [2],
        to which each call adds its nanoseconds and the distinct experts it ran."""
        assert router.dtype == torch.float32 and router.is_contiguous()
        assert stats.dtype == torch.int64 and stats.shape == (2,) and stats.device.type == "cpu"
        assert len(w13) == len(w2) == router.shape[0]
        self.dtype = dtype
        self.experts, self.hidden = router.shape
        self.used = used
        self.intermediate = w2[0][0].in_features
        self.max_rows = max_rows
        self._fn = entry(lib, "moe_ffn", dtype)
        self._w13 = (Matrix * self.experts)(*[matrix(runs, dtype) for runs in w13])
        self._w2 = (Matrix * self.experts)(*[matrix(runs, dtype) for runs in w2])
        self._experts = Experts(router.data_ptr(), ctypes.addressof(self._w13),
                                 ctypes.addressof(self._w2), self.experts, used,
                                 self.intermediate, int(norm_topk), self.max_rows,
                                 stats.data_ptr())
        self._shape = Shape(hidden=self.hidden, intermediate=self.intermediate,
                             gelu=int(act == "gelu_pytorch_tanh"), levels=levels,
                             int_rows=int_rows, superblock_rows=int(superblock_rows),
                             invariant=int(invariant))
        self.address = ctypes.addressof(self._experts)
        self.stats = stats
        self._keep = router, w13, w2  # the pointers above are into these tensors
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def takes(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows runs here: where its experts' rows are, on average,
        within a block-linear call (a prompt's chunk at a tier whose kernel takes few rows
        runs the Python path, whose experts' many rows go to the dense matmul)."""
        return rows * self.used <= self.experts * self.max_rows

    def scratch_bytes(self, rows: int) -> int:
        """What one call of ``rows`` rows takes from its scratch (moe_ffn.c's pieces)."""
        elem = torch.finfo(self.dtype).bits // 8
        pairs = rows * self.used
        return (4 * (rows * (self.experts + self.hidden) + 4 * pairs + 2 * self.experts + 1)
                + elem * pairs * (2 * self.hidden + 2 * self.intermediate)
                + _PIECES * _ALIGN)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, hidden] (rows may be strided). Returns the experts' weighted sum."""
        rows = x.shape[0]
        assert x.dtype == self.dtype and x.stride(1) == 1 and x.shape[1] == self.hidden
        need = self.scratch_bytes(rows)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.uint8)
        out = torch.empty(rows, self.hidden, dtype=self.dtype)
        rc = self._fn(ctypes.byref(self._experts), ctypes.byref(self._shape), x.data_ptr(),
                      x.stride(0), out.data_ptr(), out.stride(0), rows,
                      self._scratch.data_ptr(), torch.get_num_threads())
        if rc == -2:
            raise MemoryError("moe_ffn: no memory for a kernel's scratch")
        if rc != 0:
            raise ValueError(f"moe_ffn: a block type or shape it does not handle ({rc})")
        return out
