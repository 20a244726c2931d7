"""An NF4 layer dequantizes its weight a slice at a time (rows in the forward, columns in
the backward) and computes what one product with the whole dequantized weight computes:
each output element is the same dot product over the whole reduction dimension, so on
this CPU the results are bitwise the whole-weight ones. A layer whose blocks straddle
rows is computed in one piece."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from veoptim.models import quant
from veoptim.models.quant import BLOCK_SIZE, NF4Linear

pytest.importorskip("bitsandbytes")


def nf4_layer(in_features: int, out_features: int, seed: int = 0) -> NF4Linear:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    layer = NF4Linear(in_features, out_features, torch.bfloat16)
    layer.quantize_(weight)
    return layer


def whole_weight_product(layer: NF4Linear, x: torch.Tensor, grad: torch.Tensor):
    x = x.detach().requires_grad_(True)
    out = F.linear(x, layer.dequantized())
    out.backward(grad)
    return out.detach(), x.grad


def sliced_product(layer: NF4Linear, x: torch.Tensor, grad: torch.Tensor):
    x = x.detach().requires_grad_(True)
    out = layer(x)
    out.backward(grad)
    return out.detach(), x.grad


@pytest.mark.parametrize("shape", [(256, 384), (448, 192), (128, 1000)])
def test_slices_of_rows_and_columns_compute_the_whole_weight_product_bitwise(monkeypatch, shape):
    in_features, out_features = shape
    monkeypatch.setattr(quant, "SLICE_WEIGHTS", 96 * BLOCK_SIZE)  # several slices each way
    layer = nf4_layer(in_features, out_features)
    assert len(layer.row_spans()) > 2 and len(layer.column_spans()) > 1
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, in_features, generator=generator).bfloat16()
    grad = torch.randn(3, 5, out_features, generator=generator).bfloat16()
    out, grad_x = sliced_product(layer, x, grad)
    expected_out, expected_grad_x = whole_weight_product(layer, x, grad)
    assert torch.equal(out, expected_out)
    assert torch.equal(grad_x, expected_grad_x)


def test_each_slice_dequantizes_exactly_its_part_of_the_weight(monkeypatch):
    monkeypatch.setattr(quant, "SLICE_WEIGHTS", 2 * 320)
    layer = nf4_layer(320, 200)
    whole = layer.dequantized()
    rows = layer.row_spans()
    columns = layer.column_spans()
    assert rows[0] == (0, 2) and rows[-1][1] == 200 and len(rows) == 100
    assert all(stop - start == BLOCK_SIZE for start, stop in columns) and len(columns) == 5
    assert torch.equal(torch.cat([layer.dequantized_rows(a, b) for a, b in rows]), whole)
    parts = [layer.dequantized_columns(a, b) for a, b in columns]
    assert torch.equal(torch.cat(parts, dim=1), whole)


def test_a_layer_whose_blocks_straddle_rows_is_computed_in_one_piece(monkeypatch):
    monkeypatch.setattr(quant, "SLICE_WEIGHTS", BLOCK_SIZE)
    layer = nf4_layer(96, 64)  # 96 weights a row: the second block starts mid-row
    assert layer.row_spans() == [(0, 64)] and layer.column_spans() == [(0, 96)]
    x = torch.randn(4, 96).bfloat16()
    grad = torch.randn(4, 64).bfloat16()
    out, grad_x = sliced_product(layer, x, grad)
    expected_out, expected_grad_x = whole_weight_product(layer, x, grad)
    assert torch.equal(out, expected_out) and torch.equal(grad_x, expected_grad_x)


def test_the_default_slice_keeps_a_large_layers_temporaries_to_a_few_mb():
    layer = NF4Linear(2048, 5632, torch.bfloat16, device="meta")
    for start, stop in layer.row_spans():
        assert (stop - start) * layer.in_features * 2 <= 2 * 2**20
    for start, stop in layer.column_spans():
        assert (stop - start) * layer.out_features * 2 <= 2 * 2**20
