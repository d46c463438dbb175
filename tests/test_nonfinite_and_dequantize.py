"""Conversion-time checks and warning-free dequantization.

* ``ScaledFp8Tensor.from_hp`` and ``fp8tensor.quantize_weights`` given an inf or NaN raise ``ValueError`` naming the
  rows (one such value would make its row's scale non-finite and the whole row NaN); the model is left unchanged.
* The training hot path has no such check: an fp8 Linear given a NaN input raises nothing (no host read per step).
* ``t.dequantize()`` and ``t.to(dtype)`` emit no warning, even with ``fp8tensor.config(unknown_ops="raise")``, and
  return the exact dequantized values, within e4m3's rounding of the float64 original.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import fp8tensor
from fp8tensor import ScaledFp8Tensor

#: e4m3 keeps 3 mantissa bits: a normal value rounds within 2^-4 of itself (relative); a value below the smallest
#: normal (2^-6 of the scaled range) within half its subnormal step, 2^-10 of the row scale.
E4M3_REL = 2.0**-4
E4M3_SUBNORMAL_ABS = 2.0**-10


def _within_e4m3(deq: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> bool:
    x64, d64, s64 = x.double(), deq.double(), scale.double()
    return bool(((d64 - x64).abs() <= E4M3_REL * x64.abs() + E4M3_SUBNORMAL_ABS * s64).all())


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_from_hp_raises_naming_rows(bad):
    x = torch.randn(6, 16)
    x[1, 3] = bad
    x[4, 0] = bad
    before = x.clone()
    with pytest.raises(ValueError, match=r"inf or NaN in 2 row\(s\) of a tensor of shape \(6, 16\): rows \[1, 4\]"):
        ScaledFp8Tensor.from_hp(x)
    assert torch.equal(x.nan_to_num(0.0, 1.0, -1.0), before.nan_to_num(0.0, 1.0, -1.0))  # input untouched


def test_float64_values_beyond_float32_range_are_refused_as_non_finite():
    """The scales are float32: a float64 row with a value beyond float32's range would get an inf scale and
    dequantize to NaN, so conversion refuses it as it refuses inf / NaN (naming the rows, the model unchanged); a row
    just inside the range converts within e4m3's rounding."""
    x = torch.randn(5, 8, dtype=torch.float64)
    x[2, 1] = 1e39
    with pytest.raises(ValueError, match=r"beyond float32's range .* in 1 row\(s\) of a tensor of shape \(5, 8\): rows \[2\]"):
        ScaledFp8Tensor.from_hp(x)
    lin = nn.Linear(8, 5).double()
    with torch.no_grad():
        lin.weight.copy_(x)
    w = lin.weight
    with pytest.raises(ValueError, match=r"quantize_weights: weight: .*beyond float32's range"):
        fp8tensor.quantize_weights(lin)
    assert lin.weight is w and type(lin) is nn.Linear
    x[2, 1] = 3e38
    t = ScaledFp8Tensor.from_hp(x)
    assert bool(torch.isfinite(t.scale).all()) and _within_e4m3(t.to_hp(torch.float64), x, t.scale)


def test_from_hp_names_rows_of_a_3d_tensor_and_caps_the_list():
    x = torch.randn(2, 3, 8)
    x[1, 2, 5] = float("nan")
    with pytest.raises(ValueError, match=r"rows \[\(1, 2\)\]"):
        ScaledFp8Tensor.from_hp(x)
    y = torch.full((20, 4), float("inf"))
    with pytest.raises(ValueError, match=r"in 20 row\(s\).*\(first 8 of 20\)"):
        ScaledFp8Tensor.from_hp(y)


def test_from_hp_of_finite_values_is_unchanged_by_the_check():
    x = torch.randn(32, 64) * torch.logspace(-3, 3, 32).unsqueeze(1)
    w = ScaledFp8Tensor.from_hp(x)
    assert _within_e4m3(w.to_hp(torch.float32), x, w.scale)
    z = ScaledFp8Tensor.from_hp(torch.zeros(3, 5))  # all-zero rows stay fine (finite scale, exact zeros)
    assert torch.equal(z.to_hp(), torch.zeros(3, 5)) and bool(torch.isfinite(z.scale).all())


def test_quantize_weights_raises_naming_parameter_and_rows_and_leaves_model_unchanged():
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    with torch.no_grad():
        model[2].weight[3, 1] = float("nan")
    w0, w2 = model[0].weight, model[2].weight
    with pytest.raises(ValueError, match=r"quantize_weights: 2\.weight: inf or NaN in 1 row\(s\).*rows \[3\]"):
        fp8tensor.quantize_weights(model)
    assert model[0].weight is w0 and model[2].weight is w2  # nothing converted, not even the finite Linear
    assert type(model[0].weight) is nn.Parameter and type(model[0]) is nn.Linear


def test_training_hot_path_has_no_finiteness_check():
    """A converted Linear given a NaN input runs (NaN rows out, the rest finite): no check, no host read, per step."""
    lin = fp8tensor.convert_to_fp8(nn.Sequential(nn.Linear(32, 16)))[0]
    x = torch.randn(4, 32)
    x[2, 7] = float("nan")
    y = lin(x)
    assert bool(y[2].isnan().all()) and bool(torch.isfinite(y[[0, 1, 3]]).all())


def test_dequantize_and_to_emit_no_warning_even_when_unknown_ops_raise():
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    w = ScaledFp8Tensor.from_hp(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fp8tensor.config(unknown_ops="raise"):
            d = w.dequantize()
            b = w.to(torch.float32)
            h = w.to(torch.float16)
    assert type(d) is torch.Tensor and d.dtype == torch.float32
    assert torch.equal(d, w.qdata.float() * w.scale)
    assert _within_e4m3(d, x, w.scale)
    assert type(b) is ScaledFp8Tensor and b.dtype == torch.float32 and torch.equal(b.to_hp(), d)
    assert h.dtype == torch.float16 and torch.equal(h.to_hp(), d.half())
