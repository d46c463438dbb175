"""The decode-sized inference GEMM on CUDA (skipped without a GPU): ``weight_only_mm`` against a float64 reference
(the fp8 weight widened exactly, float32 accumulation, one rounding), the Linear's no-grad path taking it up to
``kernels.w8_max_m(N)`` tokens (32, or 64 for weights of fewer than ``narrow_n`` output features; and not past), eager vs ``torch.compile`` (default and ``reduce-overhead``) bit for bit, and the model
within the fp8 bound of the float64 model."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fp8tensor
from fp8tensor import kernels
from fp8tensor.quantize import quantize, weight_only_mm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda"
from conftest import E4M3_GEMM_BOUND, rel_err  # noqa: E402

MAX_M = kernels.W8_MM_CONFIG["max_m"]
MAX_M_NARROW = kernels.W8_MM_CONFIG["max_m_narrow"]
NARROW_N = kernels.W8_MM_CONFIG["narrow_n"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,N", [(1, 4096, 1024), (8, 4096, 14336), (32, 14336, 4096), (24, 4096, 6144), (3, 300, 70),
                                   (17, 96, 5), (1, 16, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_against_float64(dtype, M, K, N, bias):
    torch.manual_seed(M * 7 + N)
    x = torch.randn(M, K, device=DEV).to(dtype)
    w = torch.randn(N, K, device=DEV) * torch.logspace(-2, 1, N, device=DEV)[:, None]
    q, s = quantize(w, -1)
    b = torch.randn(N, device=DEV).to(dtype) if bias else None
    out = weight_only_mm(x, q, s, b)
    assert out is not None and out.dtype == dtype and out.shape == (M, N)
    ref = x.double() @ (q.double() * s.double()).t() + (b.double() if bias else 0)
    # float32 accumulation and one rounding to the output dtype (2^-8 bf16, 2^-11 fp16 relative per element)
    assert rel_err(out, ref) < (4e-3 if dtype == torch.bfloat16 else 6e-4)
    assert torch.equal(weight_only_mm(x, q, s, b), out)  # deterministic (fixed split-K order)


def test_not_taken_where_it_does_not_apply():
    q, s = quantize(torch.randn(32, 64, device=DEV), -1)
    x = torch.randn(MAX_M + 1, 64, device=DEV, dtype=torch.bfloat16)
    assert weight_only_mm(x, q, s) is not None  # a narrow weight (32 output features): up to max_m_narrow tokens
    assert weight_only_mm(torch.randn(MAX_M_NARROW + 1, 64, device=DEV, dtype=torch.bfloat16), q, s) is None
    qw, sw = quantize(torch.randn(NARROW_N, 64, device=DEV), -1)  # a wide weight: up to max_m tokens
    assert weight_only_mm(x[:MAX_M], qw, sw) is not None and weight_only_mm(x, qw, sw) is None
    assert weight_only_mm(torch.randn(4, 64, device=DEV), q, s) is None  # float32 input
    assert weight_only_mm(torch.randn(0, 64, device=DEV, dtype=torch.bfloat16), q, s) is None  # no tokens


def _model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    hp = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 256, bias=False)).to(DEV, dtype)
    return hp, fp8tensor.quantize_weights(copy.deepcopy(hp)).eval()


@pytest.mark.parametrize("tokens", [(1, 1), (8, 1), (2, 16), (33, 1), (3, 16), (65, 1), (1, 0)])
def test_linear_no_grad_takes_it_up_to_max_m_tokens(tokens, monkeypatch):
    hp, m = _model()
    x = torch.randn(*tokens, 512, device=DEV, dtype=torch.bfloat16)
    calls = []
    real = kernels.launch_w8_mm
    monkeypatch.setattr(kernels, "launch_w8_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        y = m(x)
        with fp8tensor.config(weight_only_decode=False):
            y_w8a8 = m(x)
    n = tokens[0] * tokens[1]
    assert len(calls) == (2 if 1 <= n <= MAX_M_NARROW else 0)  # (both weights narrow: 1024 and 256 features)
    assert y.shape == (*tokens, 256)
    if n:
        ref = hp.double()(x.double())
        # two GEMMs in series: the weight-only path rounds only the weights (one GEMM's bound), the fp8 x fp8 path the
        # activations too (two GEMMs' worth: 5.3% measured at 65 tokens)
        assert rel_err(y, ref) < (E4M3_GEMM_BOUND if n <= MAX_M_NARROW else 2 * E4M3_GEMM_BOUND)
        assert rel_err(y_w8a8, ref) < 2 * E4M3_GEMM_BOUND
        if n > MAX_M_NARROW:
            assert torch.equal(y, y_w8a8)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_equals_eager(mode):
    torch.manual_seed(0)  # Linears only: an activation between them would be rounded by inductor's own kernel
    m = fp8tensor.quantize_weights(nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 256, bias=False)).to(
        DEV, torch.bfloat16)).eval()
    torch._dynamo.reset()
    c = torch.compile(m, mode=mode)
    with torch.no_grad():
        for n in (1, 8, MAX_M, 48, MAX_M_NARROW):
            x = torch.randn(n, 512, device=DEV, dtype=torch.bfloat16)
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            y = c(x).clone()
            assert torch.equal(y, m(x)), n
    torch._dynamo.reset()
