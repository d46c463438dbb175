"""Serving-path review: a ``quantize_weights`` model given high-precision weights holding an inf or NaN, through
``load_state_dict`` (``assign=True`` or not), ``copy_`` or ``.data =``, raises a ``ValueError`` naming the rows (as
``quantize_weights`` and ``ScaledFp8Tensor.from_hp`` do: quantized, each such row would be all NaN) and leaves the
module's weight, bias and outputs as they were; finite values written the same ways are seen by the next call, within
the fp8 bound of a float64 reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fp8tensor
from fp8tensor import ScaledFp8Tensor
from conftest import E4M3_GEMM_BOUND, rel_err, same_bits

MODES = ("no_grad", "inference_mode", "grad")


def _run(model, x, mode):
    if mode == "no_grad":
        with torch.no_grad():
            return model(x)
    if mode == "inference_mode":
        with torch.inference_mode():
            return model(x)
    return model(x).detach()


def _model(dtype=torch.bfloat16):
    return fp8tensor.quantize_weights(nn.Sequential(nn.Linear(64, 48).to(dtype)))


def _snapshot(lin):
    return lin.weight.qdata.view(torch.uint8).clone(), lin.weight.scale.clone(), lin.bias.detach().clone()


def _unchanged(lin, snap) -> bool:
    w = lin.weight
    return (type(w) is ScaledFp8Tensor and torch.equal(w.qdata.view(torch.uint8), snap[0])
            and torch.equal(w.scale, snap[1]) and torch.equal(lin.bias.detach(), snap[2]))


def _bad_weight(dtype, value):
    w = torch.randn(48, 64, dtype=dtype)
    w[5, 7] = value
    w[30, 0] = value
    return w


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_load_state_dict_of_nonfinite_weights_raises_and_changes_nothing(value, assign, mode):
    model = _model()
    lin = model[0]
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    y0 = _run(model, x, mode)
    snap = _snapshot(lin)
    state = {"0.weight": _bad_weight(torch.bfloat16, value), "0.bias": torch.zeros(48, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match=r"load_state_dict \('0\.weight'\): inf or NaN in 2 row\(s\).*rows \[5, 30\]"):
        model.load_state_dict(state, assign=assign)
    assert _unchanged(lin, snap)  # (with assign=True the bf16 weight used to stay in the model, the bias zeroed)
    assert same_bits(_run(model, x, mode), y0)


@pytest.mark.parametrize("how", ["copy_", "data.copy_", "data ="])
def test_nonfinite_writes_into_an_fp8_weight_raise_and_change_nothing(how):
    model = _model()
    lin = model[0]
    snap = _snapshot(lin)
    bad = _bad_weight(torch.bfloat16, float("nan"))
    with pytest.raises(ValueError, match=r"ScaledFp8Tensor( copy_|\.data = \.\.\.): inf or NaN in 2 row\(s\)"), \
            torch.no_grad():
        if how == "copy_":
            lin.weight.copy_(bad)
        elif how == "data.copy_":
            lin.weight.data.copy_(bad)
        else:
            lin.weight.data = bad
    assert _unchanged(lin, snap)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_finite_weights_written_are_seen_by_the_next_call(dtype, assign, mode):
    model = _model(dtype)
    x = torch.randn(2, 3, 64, dtype=dtype)
    _run(model, x, mode)  # a first call before the writes: nothing of it may be reused
    w2, b2 = torch.randn(48, 64, dtype=dtype), torch.randn(48, dtype=dtype)
    model.load_state_dict({"0.weight": w2, "0.bias": b2}, assign=assign)
    assert type(model[0].weight) is ScaledFp8Tensor
    ref = x.double() @ w2.double().t() + b2.double()
    assert rel_err(_run(model, x, mode), ref) < E4M3_GEMM_BOUND
    w3 = torch.randn(48, 64, dtype=dtype)
    with torch.no_grad():
        model[0].weight.copy_(w3)
    assert rel_err(_run(model, x, mode), x.double() @ w3.double().t() + b2.double()) < E4M3_GEMM_BOUND
    w4 = torch.randn(48, 64, dtype=dtype)
    model[0].weight.data = w4
    assert rel_err(_run(model, x, mode), x.double() @ w4.double().t() + b2.double()) < E4M3_GEMM_BOUND
