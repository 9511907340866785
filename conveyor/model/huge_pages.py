"""KV caches and GGUF weight blocks on transparent huge pages (Linux, CPU).

Decode attention reads each request's pages, which lie anywhere in a pool of hundreds of MB, a
few KB at a time: with 4 KB pages nearly every read of a KV page also misses the TLB (and the
block linears stream every layer's weights each step). Asking the
kernel for 2 MB pages (``madvise(MADV_HUGEPAGE)``, honoured where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``) before the pool is
first touched removes most of those misses.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros``, with the whole 2 MB pages inside a CPU tensor asked to be huge pages
    before they are first written. Elsewhere (or if the kernel refuses) plain pages, silently:
    only speed differs."""
    t = torch.empty(shape, dtype=dtype, device=device)
    madvise = _madvise()
    if device.type == "cpu" and madvise is not None:
        start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            madvise(start, end - start, MADV_HUGEPAGE)
    return t.zero_()
