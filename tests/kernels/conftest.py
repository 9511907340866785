"""The kernels split their work over threads: their tests run on two at least, whatever the
worker's own count, so that a split that loses or repeats rows fails here."""

from __future__ import annotations

import pytest
import torch

KERNEL_THREADS = 2


@pytest.fixture(autouse=True)
def two_threads_at_least():
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, KERNEL_THREADS))
    yield
    torch.set_num_threads(before)
