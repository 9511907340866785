"""The model's linears: the prepacked (oneDNN) bfloat16 linear gives the same bits as F.linear at
every row count; batch invariance's fixed-shape pieces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.model.backend import can_prepack
from conveyor.model.model import Linear, in_pieces

needs_prepack = pytest.mark.skipif(
    not can_prepack(torch.device("cpu"), torch.bfloat16),
    reason="oneDNN's bfloat16 prepacking needs a CPU tier with bfloat16 arithmetic (avx512, amx) "
           "and oneDNN in this PyTorch build")


@needs_prepack
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


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), piece=st.integers(1, 16))
def test_in_pieces_calls_one_shape_and_keeps_every_row(rows, piece):
    x = torch.randn(rows, 3)
    shapes = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t * 2 + 1
    out = in_pieces(fn, x, piece)
    assert torch.equal(out, x * 2 + 1)
    assert set(shapes) == {(piece, 3)} and len(shapes) == -(-rows // piece)
