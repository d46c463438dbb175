"""The core numerics on CUDA (skipped without a GPU): backends vs float64, folding, training grads, compile."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fp8tensor
from fp8tensor import ScaledFp8Tensor, convert_to_fp8, quantize_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda"


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("backend", ["rowwise", "tensorwise", "emulated"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(256, 512, 384), (100, 200, 72)])  # second: K, N not multiples of 16
def test_backends_vs_float64(backend, out_dtype, shape):
    M, K, N = shape
    x = torch.randn(M, K, device=DEV, dtype=out_dtype)
    w = torch.randn(N, K, device=DEV, dtype=out_dtype)
    b = torch.randn(N, device=DEV, dtype=out_dtype)
    w8 = ScaledFp8Tensor.from_hp(w)
    with fp8tensor.gemm_backend(backend):
        y = F.linear(x, w8, b)
    ref = x.double() @ w.double().t() + b.double()
    assert y.dtype == out_dtype and y.shape == (M, N)
    assert rel(y, ref) < 5e-2


def test_backends_agree():
    x = torch.randn(512, 1024, device=DEV, dtype=torch.bfloat16)
    w8 = ScaledFp8Tensor.from_hp(torch.randn(768, 1024, device=DEV, dtype=torch.bfloat16), fast_accum=False)
    outs = {}
    for be in ("rowwise", "tensorwise", "emulated"):
        with fp8tensor.gemm_backend(be):
            outs[be] = F.linear(x, w8).float()
    assert rel(outs["rowwise"], outs["emulated"]) < 1e-2
    assert rel(outs["tensorwise"], outs["emulated"]) < 1e-2


def test_folding_grad_input():
    w = torch.randn(384, 512, device=DEV, dtype=torch.bfloat16)
    lin = nn.Linear(512, 384, bias=False, device=DEV, dtype=torch.bfloat16)
    lin.weight.data.copy_(w)
    quantize_weights(lin)
    x = torch.randn(4, 64, 512, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(4, 64, 384, device=DEV, dtype=torch.bfloat16)
    lin(x).backward(gy)
    ref = gy.double() @ w.double()
    assert rel(x.grad, ref) < 5e-2


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp"])
@pytest.mark.parametrize("compiled", [False, True])
def test_training_grads(recipe, compiled):
    lin = nn.Linear(512, 768, device=DEV, dtype=torch.bfloat16)
    w0 = lin.weight.detach().clone()
    b0 = lin.bias.detach().clone()
    convert_to_fp8(lin, recipe=recipe)
    m = torch.compile(lin, fullgraph=True) if compiled else lin
    x = torch.randn(2, 256, 512, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(2, 256, 768, device=DEV, dtype=torch.bfloat16)
    y = m(x)
    y.backward(gy)
    xd, wd = x.detach().double(), w0.double()
    assert rel(y, xd @ wd.t() + b0.double()) < 5e-2
    assert rel(x.grad, gy.double() @ wd) < 5e-2
    gw_ref = gy.double().reshape(-1, 768).t() @ xd.reshape(-1, 512)
    assert rel(lin.weight.grad, gw_ref) < (5e-2 if recipe == "rowwise" else 1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1000, 300), (4096, 512), (7, 33)])
@pytest.mark.parametrize("float8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantize_dim0_t_kernel_matches_reference(dtype, shape, float8_dtype):
    from fp8tensor.quantize import _reference_dim0_t, quantize_dim0_t

    x = torch.randn(*shape, device=DEV, dtype=dtype) * torch.rand(1, shape[1], device=DEV, dtype=dtype) * 10
    x[:, 0] = 0  # an all-zero column
    x[:, 1] *= 1e-30  # tiny columns: scale amax / fmax, not floored (the floor is float32's smallest normal)
    x[:, 2] *= 1e-37  # below fmax * 2^-126: the floor scale
    q, s = quantize_dim0_t(x, float8_dtype)
    qr, sr = _reference_dim0_t(x, float8_dtype)
    assert q.shape == (shape[1], shape[0]) and q.is_contiguous() and s.shape == (shape[1], 1)
    torch.testing.assert_close(s, sr, rtol=0, atol=0)
    # identical up to one fp8 rounding step where division rounding differs
    assert ((q.float() - qr.float()).abs() > 0).float().mean() < 1e-3
    assert torch.equal(q[0].float(), torch.zeros_like(q[0].float()))
    assert rel(q.float() * s, x.t()) < (0.04 if float8_dtype == torch.float8_e4m3fn else 0.08)


def test_quantize_dim0_t_nan_column_stays_nonfinite():
    from fp8tensor.quantize import quantize_dim0_t

    x = torch.randn(256, 64, device=DEV, dtype=torch.bfloat16)
    x[5, 3] = float("nan")
    q, s = quantize_dim0_t(x, torch.float8_e4m3fn)
    deq = q.float() * s
    assert not torch.isfinite(deq[3]).all()
    assert torch.isfinite(torch.cat([deq[:3], deq[4:]])).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1000, 300), (4096, 512), (7, 33), (3, 5, 1030), (14336, 4096), (3, 5000),
                                   (6, 8192), (9, 14336), (5, 28672), (4, 40000)])
@pytest.mark.parametrize("float8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_row_kernel_bit_identical_to_eager_ops(dtype, shape, float8_dtype):
    """The fused last-dim kernel (used by eager quantize_rowwise / from_hp on CUDA; rows of up to 8192 elements read
    once, wider ones twice) gives the same fp8 bits and scales as the eager ops, including all-zero rows, tiny rows
    (scale floor 2^-126) and saturating values."""
    from fp8tensor.kernels import quantize_last_dim, row_kernel_available
    from fp8tensor.quantize import SCALE_FLOOR
    from fp8tensor.quantize import cast_to_fp8, quantize_rowwise, rowwise_scale

    x = (torch.randn(*shape, device=DEV) * torch.rand(*shape[:-1], 1, device=DEV) * 100).to(dtype)
    x.view(-1, shape[-1])[0] = 0  # an all-zero row
    if dtype != torch.float16:  # tiny rows (fp16 cannot hold them): amax / fmax, and below the floor
        x.view(-1, shape[-1])[1] *= 1e-30
        x.view(-1, shape[-1])[2] *= 1e-37
    assert row_kernel_available(x)
    q, s = quantize_last_dim(x, float8_dtype, SCALE_FLOOR)
    sr = rowwise_scale(x, -1, float8_dtype)
    qr = cast_to_fp8(x, sr, float8_dtype)
    assert q.shape == x.shape and s.shape == (*shape[:-1], 1) and q.dtype == float8_dtype
    assert torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    q2, s2 = quantize_rowwise(x, -1, float8_dtype)  # the public entry point routes to the kernel
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
    assert rel(q.float() * s, x) < (0.04 if float8_dtype == torch.float8_e4m3fn else 0.08)


def test_row_kernel_nan_row_stays_nonfinite_and_skipped_when_not_contiguous():
    from fp8tensor.kernels import row_kernel_available
    from fp8tensor.quantize import quantize_rowwise

    x = torch.randn(64, 256, device=DEV)
    x[3, 7] = float("nan")
    q, s = quantize_rowwise(x, -1)
    deq = q.float() * s
    assert not torch.isfinite(deq[3]).all()
    assert torch.isfinite(torch.cat([deq[:3], deq[4:]])).all()
    xt = torch.randn(256, 64, device=DEV).t()
    assert not row_kernel_available(xt)
    q, s = quantize_rowwise(xt, -1)
    assert rel(q.float() * s, xt) < 0.04
