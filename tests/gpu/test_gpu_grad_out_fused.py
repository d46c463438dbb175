"""The fused ``grad_out`` quantization kernels on CUDA (skipped without a GPU): same bits as the separate kernels."""
import pytest
import torch

from fp8tensor.quantize import quantize, quantize_rows_and_tokens, quantize_tokens


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
