"""The KV-cache allocation: zeros, and on Linux marked for huge pages before first use."""

from __future__ import annotations

import sys

import pytest
import torch

from conveyor.kernels import huge_pages


def mapping_field(address: int, field: str) -> list[str]:
    """The values of ``field`` (``VmFlags``, ``Rss``, ...) of the mapping of this process that
    holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == f"{field}:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def rss_kib(t: torch.Tensor) -> int:
    """Rss (KiB) of the mapping that holds the tensor's storage."""
    return int(mapping_field(t.data_ptr(), "Rss")[0])


def test_zeros_are_zeros():
    t = huge_pages.zeros((3, 5, 7), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and not t.any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_large_tensor_is_advised_huge():
    t = huge_pages.zeros((16 << 20,), torch.float32, torch.device("cpu"))  # 64 MB
    assert not t.any()
    middle = t.data_ptr() + t.numel() * t.element_size() // 2
    assert "hg" in mapping_field(middle, "VmFlags")  # MADV_HUGEPAGE is set on that range


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_the_pool_is_not_resident_until_written():
    """A GB pool costs nothing at start: the kernel hands its pages out zeroed as they are
    first written (so no seconds spent zeroing it, no memory held for pages never used)."""
    t = huge_pages.zeros((256 << 20,), torch.float32, torch.device("cpu"))  # 1 GiB
    assert rss_kib(t) < 4096
    t[: 16 << 20] = 1.0  # 64 MB written
    assert 60 << 10 <= rss_kib(t) < 100 << 10

