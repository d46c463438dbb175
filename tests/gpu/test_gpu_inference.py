"""The decode-sized inference GEMM on CUDA (skipped without a GPU): ``decode_mm`` against a float64 reference (up to
``max_m`` tokens the fp8 weight widened exactly, float32 accumulation, one rounding; up to ``max_m_fp8x`` the
activations quantized per row too), the Linear's no-grad path taking it up to ``max_m_fp8x`` tokens (and not past),
eager vs ``torch.compile`` (default and ``reduce-overhead``), and the model within the fp8 bound of the float64
model."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fp8tensor
from fp8tensor import kernels
from fp8tensor.quantize import decode_mm, quantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda"
from conftest import E4M3_GEMM_BOUND, rel_err  # noqa: E402

MAX_M = kernels.W8_MM_CONFIG["max_m"]
MAX_M_FP8X = kernels.W8_MM_CONFIG["max_m_fp8x"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,N", [(1, 4096, 1024), (8, 4096, 14336), (32, 14336, 4096), (24, 4096, 6144), (3, 300, 70),
                                   (17, 96, 5), (1, 16, 1), (16, 4096, 4096), (64, 4096, 14336), (48, 14336, 4096),
                                   (40, 1000, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_against_float64(dtype, M, K, N, bias):
    torch.manual_seed(M * 7 + N)
    x = torch.randn(M, K, device=DEV).to(dtype)
    w = torch.randn(N, K, device=DEV) * torch.logspace(-2, 1, N, device=DEV)[:, None]
    q, s = quantize(w, -1)
    b = torch.randn(N, device=DEV).to(dtype) if bias else None
    out = decode_mm(x, q, s, b)
    assert out is not None and out.dtype == dtype and out.shape == (M, N)
    ref = x.double() @ (q.double() * s.double()).t() + (b.double() if bias else 0)
    if M <= MAX_M:  # float32 accumulation and one rounding to the output dtype (2^-8 bf16, 2^-11 fp16 per element)
        assert rel_err(out, ref) < (4e-3 if dtype == torch.bfloat16 else 6e-4), (M, K, N)
    else:  # x quantized per row to e4m3 as well: the fp8 GEMM bound, and the dual-fp8 GEMM's own result
        assert rel_err(out, ref) < E4M3_GEMM_BOUND, (M, K, N)
        xq, xs = quantize(x, -1)
        dual = ((xq.double() * xs.double()) @ (q.double() * s.double()).t() + (b.double() if bias else 0))
        assert rel_err(out, dual) < (4e-3 if dtype == torch.bfloat16 else 6e-4), (M, K, N)
    assert torch.equal(decode_mm(x, q, s, b), out)  # deterministic (fixed split-K order)


def test_not_taken_where_it_does_not_apply():
    q, s = quantize(torch.randn(32, 64, device=DEV), -1)
    x = torch.randn(MAX_M_FP8X + 1, 64, device=DEV, dtype=torch.bfloat16)
    assert decode_mm(x[:MAX_M_FP8X], q, s) is not None and decode_mm(x, q, s) is None
    q5, s5 = quantize(torch.randn(32, 64, device=DEV), -1, torch.float8_e5m2)  # e5m2: weight-only rows only
    assert decode_mm(x[:MAX_M], q5, s5) is not None and decode_mm(x[:MAX_M + 1], q5, s5) is None
    assert decode_mm(torch.randn(4, 64, device=DEV), q, s) is None  # float32 input
    assert decode_mm(torch.randn(0, 64, device=DEV, dtype=torch.bfloat16), q, s) is None  # no tokens


def _model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    hp = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 256, bias=False)).to(DEV, dtype)
    return hp, fp8tensor.quantize_weights(copy.deepcopy(hp)).eval()


@pytest.mark.parametrize("tokens", [(1, 1), (8, 1), (2, 8), (17, 1), (2, 16), (33, 1), (3, 16), (65, 1), (1, 0)])
def test_linear_no_grad_takes_it_up_to_max_m_tokens(tokens, monkeypatch):
    hp, m = _model()
    x = torch.randn(*tokens, 512, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():  # (the first call of a launch plan also launches the split once: a later capture's)
        m(x)
    calls = []
    real = kernels.launch_w8_mm
    monkeypatch.setattr(kernels, "launch_w8_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        y = m(x)
        with fp8tensor.config(weight_only_decode=False):
            y_w8a8 = m(x)
    n = tokens[0] * tokens[1]
    assert len(calls) == (2 if 1 <= n <= MAX_M_FP8X else 0)
    assert y.shape == (*tokens, 256)
    if n:
        ref = hp.double()(x.double())
        # two GEMMs in series: the weight-only form rounds only the weights (one GEMM's bound), the fp8 x fp8 forms
        # the activations too (two GEMMs' worth: 5.3% measured at 65 tokens)
        assert rel_err(y, ref) < (E4M3_GEMM_BOUND if n <= MAX_M else 2 * E4M3_GEMM_BOUND)
        assert rel_err(y_w8a8, ref) < 2 * E4M3_GEMM_BOUND
        if n > MAX_M_FP8X:
            assert torch.equal(y, y_w8a8)
        elif n > MAX_M:  # the first Linear (not the model's output: bf16 roundings of the first output flip some of
            # the second Linear's e4m3 roundings of its input, 1.5% apart measured): the decode GEMM's fp8 x form and
            # cuBLAS's dual-fp8 GEMM both against the float64 product of the same quantized operands. The fp8 x form
            # rounds once to bf16 (bias added in float32); the dual-fp8 route rounds the GEMM's output, then the bias
            # add: two bf16 roundings (2^-8 relative each at most)
            with torch.no_grad():
                y1 = m[0](x)
                with fp8tensor.config(weight_only_decode=False):
                    y1_w8a8 = m[0](x)
            xq, xs = quantize(x.reshape(-1, 512), -1)
            w1 = m[0].weight
            dual = ((xq.double() * xs.double()) @ (w1.qdata.double() * w1.scale.double()).t()
                    + m[0].bias.double()).reshape(*tokens, 1024)
            assert rel_err(y1, dual) < 4e-3, n
            assert rel_err(y1_w8a8, dual) < 8e-3, n


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_equals_eager(mode):
    torch.manual_seed(0)  # Linears only: an activation between them would be rounded by inductor's own kernel
    m = fp8tensor.quantize_weights(nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 256, bias=False)).to(
        DEV, torch.bfloat16)).eval()
    torch._dynamo.reset()
    c = torch.compile(m, mode=mode)
    with torch.no_grad():
        for n in (1, 8, MAX_M, MAX_M + 1, 48, MAX_M_FP8X):
            x = torch.randn(n, 512, device=DEV, dtype=torch.bfloat16)
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            y = c(x).clone()
            if n <= MAX_M:
                assert torch.equal(y, m(x)), n
            else:  # the second Linear's row quantization fused with the first's epilogue reads its float32 value
                assert rel_err(y, m(x)) < 1e-2, n  # (before the rounding to bf16): an fp8 step apart at most
    torch._dynamo.reset()


@pytest.mark.parametrize("n", [1, MAX_M_FP8X])
def test_compiled_decode_graph_takes_each_weights_parts_as_plain_inputs(n):
    """The compiled decode route reads each fp8 weight's ``qdata`` and ``scale``, so dynamo hands the graph those
    plain tensors, never the ScaledFp8Tensor: AOTAutograd then unwraps no tensor subclass on each call (torch 2.11
    does that in Python, per subclass input: docs/benchmarks.md, "Serving"). The model compiles into one graph without
    a graph break, which reduce-overhead runs as a CUDA graph. The output is the eager model's: equal up to
    ``max_m`` tokens, past it within the bound of ``test_compiled_equals_eager``."""
    from torch._dynamo.utils import counters

    from fp8tensor import ScaledFp8Tensor

    torch.manual_seed(n)
    m = fp8tensor.quantize_weights(nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 256, bias=False)).to(
        DEV, torch.bfloat16)).eval()
    x = torch.randn(n, 512, device=DEV, dtype=torch.bfloat16)
    graph_tensors = []

    def backend(gm, inputs):  # the graph's inputs and any tensor it holds as an attribute
        graph_tensors.extend(t for t in inputs if isinstance(t, torch.Tensor))
        graph_tensors.extend(gm.parameters())
        graph_tensors.extend(gm.buffers())
        return gm.forward

    try:
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            y = torch.compile(m, backend=backend)(x)
            ref = m(x)
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], (
            dict(counters["stats"]), dict(counters["graph_break"]))
        assert not any(isinstance(t, ScaledFp8Tensor) for t in graph_tensors), [type(t).__name__ for t in graph_tensors]
        ptrs = {t.data_ptr() for t in graph_tensors}
        for i, lin in enumerate(m):
            assert lin.weight.qdata.data_ptr() in ptrs and lin.weight.scale.data_ptr() in ptrs, i
        assert torch.equal(y, ref) if n <= MAX_M else rel_err(y, ref) < 1e-2, n

        torch._dynamo.reset()
        counters.clear()
        c = torch.compile(m, mode="reduce-overhead")
        with torch.no_grad():
            for _ in range(3):
                torch.compiler.cudagraph_mark_step_begin()
                y = c(x).clone()
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], (
            dict(counters["stats"]), dict(counters["graph_break"]))
        assert torch.equal(y, ref) if n <= MAX_M else rel_err(y, ref) < 1e-2, n
    finally:
        torch._dynamo.reset()
