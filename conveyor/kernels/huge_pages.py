"""KV caches and repacked weights on transparent huge pages (Linux, CPU).

Decode attention reads each request's pages, which lie anywhere in a pool of hundreds of MB, a
few KB at a time: with 4 KB pages nearly every read of a KV page also misses the TLB (and the
block linears stream every layer's weights each step, so their copies in a kernel's own layout
are allocated here too). Asking the
kernel for 2 MB pages (``madvise(MADV_HUGEPAGE)``, honoured where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``) before the pool is
first touched removes most of those misses. (A GGUF's blocks are read from the file's map, where
a kernel with large page-cache folios maps them in 2 MB pages too.)
"""

from __future__ import annotations

import math
import mmap

import torch


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros`` that costs nothing until used: on the CPU, fresh anonymous memory (the
    kernel hands it out zeroed, page by page, as it is first written, so a KV pool of GBs is
    neither written nor resident at start), asked to be huge pages where the kernel allows
    (elsewhere plain pages, silently: only speed differs)."""
    numel = math.prod(shape)
    if device.type != "cpu" or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # (the tensor keeps buf alive)
