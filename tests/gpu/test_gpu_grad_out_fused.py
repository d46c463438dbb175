"""The fused ``grad_out`` quantization on CUDA (skipped without a GPU): same bits as the separate kernels, and the
fp8 Linear's gradients unchanged by it (eager and compiled)."""
import pytest
import torch

import fp8tensor
from fp8tensor.quantize import E4M3, quantize, quantize_rows_and_tokens, quantize_tokens
from fp8tensor.tensor import make_scaled

from conftest import set_knobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda"


def _same(a, b):
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(8192, 2048), (1000, 5632), (3, 7, 80), (17, 2)])
@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("f8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_same_bits_as_separate_kernels(dtype, shape, fold, f8):
    g = (torch.randn(*shape, device=DEV) * torch.logspace(-4, 4, shape[-1], device=DEV)).to(dtype)
    g.view(-1, shape[-1])[1] = 0  # an all-zero row
    N = shape[-1]
    s = (torch.rand(N, device=DEV) + 0.5) / 448 if fold else None
    g2 = g.reshape(-1, N)
    q, sq = quantize(g2 if s is None else g2.float() * s, -1, f8)
    t, st = quantize_tokens(g, f8)
    (q1, sq1), (t1, st1) = quantize_rows_and_tokens(g, f8, col_mul=s)
    assert _same(q1, q) and _same(sq1, sq) and _same(t1, t) and _same(st1, st)


def test_nan_row_and_column_stay_non_finite():
    g = torch.randn(64, 48, device=DEV, dtype=torch.bfloat16)
    g[5, 7] = float("nan")
    (q, s), (t, st) = quantize_rows_and_tokens(g)
    (q0, s0), (t0, st0) = (quantize(g, -1), quantize_tokens(g))
    assert _same(q, q0) and _same(s, s0) and _same(t, t0) and _same(st, st0)
    assert s[5].isinf().all() and st[0, 7].isinf()


def _linear_grads(weight, w, x, gy, compiled):
    if weight == "fp8":  # an fp8 weight scaled per row that requires grad (FSDP2's gathered one): folding
        q, s = quantize(w, -1, E4M3)
        wt = make_scaled(q, s, torch.bfloat16, requires_grad=True)
        fn = lambda a: fp8tensor.fp8_linear(a, wt)  # noqa: E731
    else:
        fn = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=DEV, dtype=torch.bfloat16)
        with torch.no_grad():
            fn.weight.copy_(w)
        fp8tensor.convert_to_fp8(fn)
        wt = fn.weight
    torch._dynamo.reset()
    f = torch.compile(fn) if compiled else fn
    xr = x.clone().requires_grad_()
    y = f(xr)
    y.backward(gy)
    return y.detach(), xr.grad, wt.grad


@pytest.mark.parametrize("weight", ["master", "fp8"])
def test_linear_grads_unchanged(weight, monkeypatch):
    """Eager: the fused pass over grad_out (where it runs: an fp8 weight with row scales) changes no bit of the
    output or the gradients; compiled, the gradients are within the fp8 bound of float64 (inductor quantizes
    grad_out row-wise in its own fused code)."""
    M, K, N = 4096, 1024, 768
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    gy = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * K ** -0.5
    set_knobs(monkeypatch, fused_grad_out="never")
    y0, gx0, gw0 = _linear_grads(weight, w, x, gy, False)
    set_knobs(monkeypatch, fused_grad_out="eager")
    y1, gx1, gw1 = _linear_grads(weight, w, x, gy, False)
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1) and torch.equal(gw0, gw1)
    _, gxc0, gwc0 = _linear_grads(weight, w, x, gy, True)
    if weight == "fp8":
        q, s = quantize(w, -1, E4M3)
        ref_w = q.double() * s.double()
    else:
        ref_w = w.double()
    gx = gy.double() @ ref_w
    gw = gy.double().t() @ x.double()
    for a, ref in ((gx1, gx), (gxc0, gx), (gw1, gw), (gwc0, gw)):
        assert ((a.double() - ref).norm() / ref.norm()).item() < 5e-2
