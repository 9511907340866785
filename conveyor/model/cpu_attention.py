"""The CPU decode-attention kernel (``paged_decode.c``): built once with the system C compiler,
cached, and called through ctypes.

Gathering a batch's pages into contiguous K/V and then running SDPA reads the cache three times
and pads every context to the longest; the kernel reads each page once, in place. It is used for
bfloat16 on the CPU when a compiler is there; otherwise (or with ``CONVEYOR_ATTENTION=sdpa``)
attention falls back to gather + SDPA, which gives the same tokens up to bfloat16 rounding.
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
from pathlib import Path

import torch

logger = logging.getLogger("conveyor")

SOURCE = Path(__file__).with_name("paged_decode.c")
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
    """The compiled library, built if this source, compiler and CPU have none in the cache."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(COMPILE_FLAGS + LINK_FLAGS),
                                    version, _cpu_signature()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "paged_decode.o", Path(tmp) / "paged_decode.so"
        for cmd in ([compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)],
                    [compiler, *LINK_FLAGS, str(obj), "-o", str(lib), "-lm"]):
            subprocess.run(cmd, capture_output=True, text=True, check=True)
        os.replace(lib, target)  # atomic: a concurrent build of the same key is harmless
    return target


class DecodeKernel:
    """``paged_decode_attention`` bound through ctypes; ``__call__`` checks what C assumes."""

    def __init__(self, path: Path) -> None:
        fn = ctypes.CDLL(str(path)).paged_decode_attention
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


@functools.cache
def _load() -> DecodeKernel | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: decode attention uses gather + SDPA (slower)")
        return None
    try:
        return DecodeKernel(_build(compiler))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("could not build the CPU decode kernel, using gather + SDPA: %s",
                       detail.strip().splitlines()[-1] if detail.strip() else e)
        return None


def decode_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> DecodeKernel | None:
    """The kernel when it applies here (CPU, bfloat16, a specialised head_dim) and builds."""
    if (device.type != "cpu" or dtype != torch.bfloat16 or head_dim not in HEAD_DIMS
            or os.environ.get("CONVEYOR_ATTENTION", "").lower() == "sdpa"):
        return None
    return _load()
