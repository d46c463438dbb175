"""The fp8 Linear with autograd off (serving): eager calls skip the autograd Function, give the bits of the training
forward (on CPU; on CUDA a trained Linear's forward quantizes ``x`` with the two-layout cast, whose fp8 values may
differ by one step next to rounding ties: docs/design.md), record no graph, and stay within the fp8 bound of a float64
reference; every shape, 0 and 1 tokens included."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fp8tensor
import fp8tensor.linear as linear_mod
from fp8tensor import ScaledFp8Tensor
from conftest import E4M3_GEMM_BOUND, rel_err, same_bits


def _refuse_function(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the autograd Function ran under no_grad")

    monkeypatch.setattr(linear_mod._Fp8Linear, "apply", refuse)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(0, 48), (1, 48), (7, 48), (3, 5, 48), (2, 1, 48)])
@pytest.mark.parametrize("conversion", ["quantize_weights", "convert_to_fp8"])
def test_no_grad_forward_skips_the_function(monkeypatch, dtype, shape, conversion):
    torch.manual_seed(0)
    base = nn.Linear(48, 32).to(dtype)
    m = getattr(fp8tensor, conversion)(nn.Sequential(base))[0]
    assert fp8tensor.is_fp8_module(m) if hasattr(fp8tensor, "is_fp8_module") else type(m) is not nn.Linear
    x = torch.randn(*shape, dtype=dtype)
    ref_train = m(x).detach()  # grad mode on: the autograd Function (its forward's pairs path)
    with monkeypatch.context() as mp:
        _refuse_function(mp)
        with torch.no_grad():
            y = m(x)
        with torch.inference_mode():
            yi = m(x)
    assert y.grad_fn is None and y.shape == (*shape[:-1], 32) and y.dtype == dtype
    assert same_bits(y, ref_train) and same_bits(yi, ref_train)
    ref = x.double() @ base.weight.double().t() + base.bias.double()
    if x.numel():
        assert rel_err(y, ref) < E4M3_GEMM_BOUND
    else:
        assert y.numel() == 0


def test_no_grad_output_is_writable_and_independent():
    """The output may be changed in place (a residual add) without touching anything the Linear keeps."""
    torch.manual_seed(0)
    m = fp8tensor.quantize_weights(nn.Sequential(nn.Linear(32, 16, bias=False)))[0]
    x = torch.randn(2, 3, 32)
    with torch.no_grad():
        y = m(x)
        y2 = m(x).clone()
        y.add_(1.0)
        assert same_bits(m(x), y2)


def test_no_grad_bad_input_names_the_op():
    m = fp8tensor.quantize_weights(nn.Sequential(nn.Linear(32, 16)))[0]
    with torch.no_grad(), pytest.raises(RuntimeError, match="fp8_linear: input's last dim"):
        m(torch.randn(4, 31))


def test_decode_token_limit_has_tiles_and_matches_the_docs():
    # Every input size the decode GEMM takes has tiles for its row block, and the documented limit is the code's.
    from pathlib import Path

    from fp8tensor.numerics import kernels

    c = kernels.W8_MM_CONFIG
    for m in range(1, c["max_m_fp8x"] + 1):
        tiles = c["tiles"][kernels._w8_mm_bucket(m)]
        # (a gemv tile takes one row: only the 1-row block may hold one; MMA tiles take blocks of 16 rows or more)
        assert kernels._w8_mm_plan(m, 4096, 4096, torch.device("cpu"))[0] == (
            1 if tiles.get("gemv") else max(16, 1 << (m - 1).bit_length())), m
        assert m == 1 or not tiles.get("gemv"), m
    root = Path(__file__).resolve().parents[1]
    for doc in ("README.md", "docs/serving.md", "docs/design.md"):
        text = " ".join((root / doc).read_text().split())
        assert f"up to {c['max_m']} tokens" in text, doc
        assert f"up to {c['max_m_fp8x']} tokens" in text, doc


@pytest.mark.parametrize("bias", [True, False])
def test_eager_decode_launches_directly_with_a_bias_parameter(monkeypatch, bias):
    """Eager decode (no grad, a decode-sized input): the no-grad Linear launches the decode GEMM directly, not through
    the ``fp8tensor::w8_mm`` op (a dispatcher round trip of tens of µs), whether or not it has a bias (an
    ``nn.Parameter``). The kernels are CUDA-only: availability and the launch are replaced by recorders here."""
    from fp8tensor.numerics import kernels

    calls = []

    def launch(x, w8, scale, b, *, traced=False, **kw):
        calls.append(traced)
        return torch.zeros(x.shape[0], w8.shape[0], dtype=x.dtype)

    monkeypatch.setattr(kernels, "w8_mm_available", lambda x, w8: True)
    monkeypatch.setattr(kernels, "launch_w8_mm", launch)
    m = fp8tensor.quantize_weights(nn.Sequential(nn.Linear(64, 32, bias=bias, dtype=torch.bfloat16)))[0]
    assert bias == isinstance(m.bias, nn.Parameter)
    with torch.no_grad():
        m(torch.randn(2, 64, dtype=torch.bfloat16))
    assert calls == [False], calls


@pytest.mark.parametrize("rows", [1, 16, 17, 40, 64])
def test_eager_decode_quantizes_x_past_max_m(monkeypatch, rows):
    """The decode route's two forms: up to ``W8_MM_CONFIG["max_m"]`` rows ``x`` goes to the kernel in its precision;
    past that (up to ``max_m_fp8x``) quantized per row to e4m3 with its row scales, the quantization of the ordinary
    fp8 Linear (``quantize(x, -1)``), as 2-D rows whatever ``x``'s leading dims. Availability and the launch are
    recorders here (the kernels are CUDA-only)."""
    from fp8tensor.numerics import kernels
    from fp8tensor.quantize import quantize

    seen = []

    def launch(x, w8, scale, b, *, traced=False, x_scale=None, out_dtype=torch.bfloat16, **kw):
        seen.append((x, x_scale, out_dtype))
        return torch.zeros(*x.shape[:-1], w8.shape[0], dtype=out_dtype if x_scale is not None else x.dtype)

    monkeypatch.setattr(kernels, "w8_mm_available", lambda x, w8: True)
    monkeypatch.setattr(kernels, "launch_w8_mm", launch)
    m = fp8tensor.quantize_weights(nn.Sequential(nn.Linear(64, 32, dtype=torch.bfloat16)))[0]
    torch.manual_seed(rows)
    x = torch.randn(1, rows, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        y = m(x)
    assert y.shape == (1, rows, 32) and y.dtype == torch.bfloat16
    (xk, xs, out_dtype), = seen
    if rows <= kernels.W8_MM_CONFIG["max_m"]:
        assert xk is x and xs is None
    else:
        q, s = quantize(x.reshape(rows, 64), -1)
        assert xk.shape == (rows, 64) and xs.shape == (rows, 1) and out_dtype == torch.bfloat16
        assert same_bits(xk.view(torch.uint8), q.view(torch.uint8)) and same_bits(xs, s)


@pytest.mark.parametrize("rows", [8, 40])
def test_decode_route_keeps_x_unquantized_for_a_high_precision_output_recipe(monkeypatch, rows):
    """A recipe whose output GEMM is high precision never rounds ``x``: the decode route's weight-only form up to
    ``max_m`` rows, and past that the ordinary route (its high-precision GEMM), not the fp8 x fp8 form. Availability
    and the launch are recorders here (the kernels are CUDA-only)."""
    from fp8tensor.numerics import kernels
    from fp8tensor.training.recipes import Gemm, Recipe

    seen = []

    def launch(x, w8, scale, b, *, traced=False, x_scale=None, out_dtype=torch.bfloat16, **kw):
        seen.append(x_scale)
        return torch.zeros(*x.shape[:-1], w8.shape[0], dtype=x.dtype)

    monkeypatch.setattr(kernels, "w8_mm_available", lambda x, w8: True)
    monkeypatch.setattr(kernels, "launch_w8_mm", launch)
    torch.manual_seed(rows)
    w = ScaledFp8Tensor.from_hp(torch.randn(32, 64, dtype=torch.bfloat16))
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        y = fp8tensor.fp8_linear(x, w, recipe=Recipe("hp_output", output=Gemm("hp", "hp")))
    if rows <= kernels.W8_MM_CONFIG["max_m"]:
        assert seen == [None]
    else:
        assert seen == []
        ref = x.double() @ w.to_hp(torch.float64).t()
        assert rel_err(y, ref) < 1e-2  # (no activation rounding: bf16's own)


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.float16])
def test_eager_decode_with_a_bias_of_another_dtype_promotes_as_the_other_routes(monkeypatch, bias_dtype):
    """A bias of another dtype than ``x`` (a bf16 model with a float32 bias, say) promotes the output (``out + bias``)
    whatever the token count: the decode GEMM, which adds the bias in ``x``'s dtype, is not taken for it (else the
    output dtype would change between prefill and decode). Availability and the launch are recorders here (the
    kernels are CUDA-only)."""
    from fp8tensor.numerics import kernels

    calls = []

    def launch(x, w8, scale, b, *, traced=False, **kw):
        calls.append(traced)
        return torch.zeros(*x.shape[:-1], w8.shape[0], dtype=x.dtype)

    monkeypatch.setattr(kernels, "w8_mm_available", lambda x, w8: True)
    monkeypatch.setattr(kernels, "launch_w8_mm", launch)
    lin = nn.Linear(64, 32, dtype=torch.bfloat16)
    lin.bias = nn.Parameter(torch.randn(32, dtype=bias_dtype))
    w, b = lin.weight.detach().double(), lin.bias.detach().double()
    m = fp8tensor.quantize_weights(nn.Sequential(lin))[0]
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    ref_train = m(x).detach()  # grad mode: the autograd Function, out + bias
    with torch.no_grad():
        y = m(x)
    assert calls == [], calls
    assert y.dtype == torch.promote_types(torch.bfloat16, bias_dtype) == ref_train.dtype
    assert same_bits(y, ref_train)
    assert rel_err(y, x.double() @ w.t() + b) < E4M3_GEMM_BOUND
