"""The prepacked (oneDNN) bfloat16 linear gives the same bits as F.linear at every row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.model.backend import can_prepack
from conveyor.model.model import Linear

pytestmark = pytest.mark.skipif(
    not can_prepack(torch.device("cpu"), torch.bfloat16),
    reason="oneDNN's bfloat16 prepacking needs a CPU tier with bfloat16 arithmetic (avx512, amx) "
           "and oneDNN in this PyTorch build")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 200])
def test_prepacked_linear_matches_f_linear(rows, bias):
    torch.manual_seed(rows)
    layer = Linear(576, 960, bias=bias).to(torch.bfloat16)
    with torch.no_grad():  # Linear skips the random init: every weight of a model is loaded
        layer.weight.normal_()
        if bias:
            layer.bias.normal_()
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = F.linear(x, layer.weight, layer.bias)
        layer.prepack()
        assert layer.packed is not None
        assert torch.equal(layer(x), expected)
