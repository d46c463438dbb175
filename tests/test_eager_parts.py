"""The eager fp8 Linear's plain-tensor path (``fp8tensor.config(eager_fast_path=...)``) gives the same bits as the
general path.

The plain path runs the same quantizations and ``scaled_mm`` calls on ``(qdata, scale)`` pairs instead of building
ScaledFp8Tensors and dispatching through ``fp8_mm``; outputs and all gradients must be bit-identical, and both must
track a float64 reference within fp8 precision. Also checks that the plain path is really taken (no ``fp8_mm`` call)
and that anything it does not take (a DTensor-free but column-scaled fp8 weight) still works.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fp8tensor
from fp8tensor import gemm as gemm_mod
from fp8tensor import linear as linear_mod
from fp8tensor.tensor import ScaledFp8Tensor

from conftest import E4M3_GEMM_BOUND, rel_err, set_knobs

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _run(parts: bool, make, x, gy, monkeypatch):
    set_knobs(monkeypatch, eager_fast_path=parts)
    lin = make()
    xr = x.detach().clone().requires_grad_(x.requires_grad)
    y = lin(xr)
    y.backward(gy)
    grads = [p.grad for p in lin.parameters() if p.requires_grad]
    return y.detach(), (xr.grad if xr.requires_grad else None), grads


def _linear(k, n, dtype, bias, seed):
    """The same initial Linear for a given seed (drawn in float32, then cast to ``dtype``)."""
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        for p in lin.parameters():
            p.uniform_(-k ** -0.5, k ** -0.5, generator=gen)
    return lin.to(device=DEV, dtype=dtype)


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp"])
@pytest.mark.parametrize("shape", [(16,), (0,), (1,), (2, 7)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_master_weight_linear_bit_identical(recipe, shape, bias, dtype, monkeypatch, _fresh_seed):
    K, N = 64, 48
    seed = _fresh_seed
    x = torch.randn(*shape, K, device=DEV, dtype=dtype, requires_grad=True)
    gy = torch.randn(*shape, N, device=DEV, dtype=dtype)

    def make():
        return fp8tensor.convert_to_fp8(_linear(K, N, dtype, bias, seed), recipe=recipe)

    calls = []
    real = gemm_mod.fp8_mm
    monkeypatch.setattr(gemm_mod, "fp8_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    y1, gx1, g1 = _run(True, make, x, gy, monkeypatch)
    assert calls == [], "the plain path went through fp8_mm"
    y0, gx0, g0 = _run(False, make, x, gy, monkeypatch)
    assert torch.equal(y1, y0) and torch.equal(gx1, gx0)
    assert len(g1) == len(g0) and all(torch.equal(a, b) for a, b in zip(g1, g0))
    if x.numel():  # and both track the float64 math (e4m3: 2^-4 relative rounding per operand)
        # One token: every output shares the rounding of one quantized row of x (and of gy), so the error does not
        # average over rows; it can exceed the typical-GEMM bound (seen: 5.2% forward). A wrong scale or layout
        # gives errors far above twice the bound.
        bound = E4M3_GEMM_BOUND if x.numel() // K > 1 else 2 * E4M3_GEMM_BOUND
        ref_lin = _linear(K, N, torch.float64, bias, seed)
        xd = x.detach().double().requires_grad_()
        yd = ref_lin(xd)
        yd.backward(gy.double())
        assert rel_err(y1, yd) <= bound
        assert rel_err(gx1, xd.grad) <= bound
        assert rel_err(g1[0], ref_lin.weight.grad) <= bound


@pytest.mark.parametrize("shape", [(16,), (3, 5)])
def test_frozen_fp8_weight_bit_identical(shape, monkeypatch, _fresh_seed):
    """A frozen row-scaled fp8 weight (``quantize_weights``): forward and the input gradient (scale folding)."""
    K, N, dtype = 64, 32, torch.bfloat16
    seed = _fresh_seed
    x = torch.randn(*shape, K, device=DEV, dtype=dtype, requires_grad=True)
    gy = torch.randn(*shape, N, device=DEV, dtype=dtype)

    def make():
        lin = _linear(K, N, dtype, True, seed)
        fp8tensor.quantize_weights(lin)
        assert type(lin.weight) is ScaledFp8Tensor
        return lin

    y1, gx1, g1 = _run(True, make, x, gy, monkeypatch)
    y0, gx0, g0 = _run(False, make, x, gy, monkeypatch)
    assert torch.equal(y1, y0) and torch.equal(gx1, gx0)
    assert all(torch.equal(a, b) for a, b in zip(g1, g0))  # the bias gradient
    ref = _linear(K, N, torch.float64, True, seed)
    xd = x.detach().double().requires_grad_()
    ref(xd).backward(gy.double())
    assert rel_err(gx1, xd.grad) <= E4M3_GEMM_BOUND


def test_column_scaled_fp8_weight_takes_general_path(monkeypatch):
    """An fp8 weight scaled per input column is not the plain path's case: the general path runs (and is right)."""
    K, N = 64, 32
    w = torch.randn(N, K, device=DEV, dtype=torch.bfloat16)
    q, s = fp8tensor.quantize.quantize_rowwise(w, dim=0)  # one scale per column, (1, K)
    w8 = ScaledFp8Tensor(q, s, torch.bfloat16)
    x = torch.randn(8, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    calls = []
    real = gemm_mod.fp8_mm
    monkeypatch.setattr(gemm_mod, "fp8_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    y = fp8tensor.fp8_linear(x, w8)
    assert calls, "a column-scaled weight must take the general path"
    ref = x.detach().double() @ w.double().t()
    assert rel_err(y, ref) <= E4M3_GEMM_BOUND


def test_device_mismatch_error_names_op():
    """The plain path keeps the general path's argument checks (same message)."""
    if DEV != "cuda":
        pytest.skip("needs two devices")
    lin = fp8tensor.convert_to_fp8(nn.Linear(32, 16, bias=False, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="aten.mm: operands are on different devices"):
        lin(torch.randn(4, 32, dtype=torch.bfloat16))


def test_bad_dtypes_raise_the_general_paths_errors(monkeypatch):
    """Integer / complex weights and inputs, and fp8 inputs without a scale, are not the plain path's: they raise
    exactly what the general path raises (the GEMM's error naming ``aten.mm`` where it applies), and nothing is
    modified."""
    x = torch.randn(4, 16, device=DEV)
    w = torch.randn(8, 16, device=DEV)
    cases = [(x, torch.randint(-3, 4, (8, 16), device=DEV)), (x, w.to(torch.complex64)),
             (torch.randint(0, 3, (4, 16), device=DEV), w), (x.to(torch.complex64), w), (x.to(torch.float8_e4m3fn), w)]
    for a, b in cases:
        errors = []
        for parts in (True, False):
            set_knobs(monkeypatch, eager_fast_path=parts)
            a0, b0 = a.clone(), b.clone()
            with pytest.raises(Exception) as info:
                fp8tensor.fp8_linear(a, b)
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               a0.view(torch.uint8) if a0.dtype == torch.float8_e4m3fn else a0)
            assert torch.equal(b, b0)
            errors.append((type(info.value), str(info.value)))
        assert errors[0] == errors[1], errors
        if a.dtype.is_floating_point and not b.dtype.is_floating_point or a.dtype == torch.int64:
            assert "aten.mm: expected floating-point operands" in errors[0][1]


@pytest.mark.skipif(DEV != "cpu", reason="the backward of CUDA tensors runs in autograd's device threads")
def test_config_block_selects_the_general_path(monkeypatch):
    """``with fp8tensor.config(eager_fast_path=False)`` (thread-local) reaches the forward and the CPU backward: every
    GEMM goes through ``fp8_mm``; outside the block none does; the same bits."""
    K, N = 64, 48
    x = torch.randn(4, K, dtype=torch.bfloat16)
    gy = torch.randn(4, N, dtype=torch.bfloat16)
    calls = []
    real = gemm_mod.fp8_mm
    monkeypatch.setattr(gemm_mod, "fp8_mm", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run():
        lin = fp8tensor.convert_to_fp8(_linear(K, N, torch.bfloat16, True, 0))
        xr = x.clone().requires_grad_()
        y = lin(xr)
        y.backward(gy)
        return y.detach(), xr.grad, lin.weight.grad

    with fp8tensor.config(eager_fast_path=False):
        general = run()
    assert len(calls) == 3  # output, grad_input, grad_weight
    calls.clear()
    fast = run()
    assert calls == []
    assert all(torch.equal(a, b) for a, b in zip(fast, general))
