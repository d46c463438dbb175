"""fp8 GEMMs (fp8tensor/subclass/gemm.py, the mm/addmm entries of the op table) against float64 references.

Two kinds of reference:

* the float64 product of the original high-precision operands: bound :data:`E4M3_GEMM_BOUND` (fp8 rounding of
  both operands, ≈3.6 % typical);
* an exact float64 emulation of the *same* fp8 operands (row-wise quantization along K, or scale folding):
  bound :data:`EMULATION_BOUND` (only float32 accumulation differs). This is what proves that the GEMM really
  ran on fp8 data quantized as documented, rather than e.g. silently on dequantized operands.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fp8tensor
from fp8tensor import E4M3, E5M2, ScaledFp8Tensor, gemm_backend, get_gemm_backend, set_gemm_backend
from fp8tensor.gemm import choose_backend, fp8_mm, scaled_mm
from fp8tensor.quantize import quantize_rowwise

from conftest import (
    BACKENDS,
    BF16_OUT_BOUND,
    E4M3_GEMM_BOUND,
    E5M2_GEMM_BOUND,
    EMULATION_BOUND,
    dequant_rowwise,
    emulated_fp8_mm,
    rel_err,
    same_bits,
)

SHAPES = [(64, 128, 96), (33, 72, 40)]  # (M, K, N); the second is not a multiple of 16


def _operands(combo: str, a: torch.Tensor, b: torch.Tensor):
    """Build the operand pair of ``combo`` from high-precision ``a`` (M, K) and ``b`` (K, N)."""
    col = lambda t: ScaledFp8Tensor.from_hp(t.t().contiguous()).t()  # (K, N) scaled per column (over K)
    if combo == "hp_x_fp8":  # x @ W^T
        return a, col(b)
    if combo == "fp8_x_hp":
        return ScaledFp8Tensor.from_hp(a), b
    if combo == "fp8_x_fp8":
        return ScaledFp8Tensor.from_hp(a), col(b)
    if combo == "transposed_a":  # A stored transposed: scaled along K -> folded into B
        return ScaledFp8Tensor.from_hp(a.t().contiguous()).t(), b
    if combo == "folded_b":  # grad_out @ W with W (K, N) scaled per row = along K: folded into A
        return a, ScaledFp8Tensor.from_hp(b)
    if combo == "both_on_k":  # both scaled along K: dequantized and re-quantized
        return ScaledFp8Tensor.from_hp(a.t().contiguous()).t(), ScaledFp8Tensor.from_hp(b)
    if combo == "e5m2_x_hp":
        return ScaledFp8Tensor.from_hp(a, E5M2), b
    if combo == "e5m2_x_e5m2":
        return ScaledFp8Tensor.from_hp(a, E5M2), ScaledFp8Tensor.from_hp(b.t().contiguous(), E5M2).t()
    raise AssertionError(combo)


COMBOS = ["hp_x_fp8", "fp8_x_hp", "fp8_x_fp8", "transposed_a", "folded_b", "both_on_k", "e5m2_x_hp", "e5m2_x_e5m2"]


def _bound(combo):
    return E5M2_GEMM_BOUND if "e5m2" in combo else E4M3_GEMM_BOUND


@pytest.mark.parametrize("shape", SHAPES, ids=["64x128x96", "33x72x40"])
@pytest.mark.parametrize("combo", COMBOS)
def test_mm_vs_float64_each_backend_and_backends_agree(combo, shape):
    M, K, N = shape
    a, b = torch.randn(M, K), torch.randn(K, N)
    ref = a.double() @ b.double()
    A, B = _operands(combo, a, b)
    outs = {}
    for be in BACKENDS:
        with gemm_backend(be):
            out = torch.mm(A, B)
        assert type(out) is torch.Tensor and out.dtype == torch.float32 and out.shape == (M, N)
        err = rel_err(out, ref)
        assert err <= _bound(combo), f"{combo} on {be}: rel err {err:.4f}"
        assert err > 1e-3, f"{combo} on {be}: rel err {err:.2e} is too small for an fp8 GEMM"
        outs[be] = out
    for be in ("rowwise", "tensorwise"):
        assert rel_err(outs[be], outs["emulated"]) <= EMULATION_BOUND, be


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("combo", ["hp_x_fp8", "fp8_x_hp", "fp8_x_fp8", "e5m2_x_e5m2"])
def test_mm_equals_exact_fp8_emulation(combo, backend):
    """Plain operands are quantized on the fly row-wise along K; fp8 operands are used as stored."""
    a, b = torch.randn(48, 96), torch.randn(96, 80)
    A, B = _operands(combo, a, b)
    with gemm_backend(backend):
        out = torch.mm(A, B)
    assert rel_err(out, emulated_fp8_mm(A, B)) <= EMULATION_BOUND


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_folding_grad_out_at_row_scaled_weight(backend):
    """``g @ W`` with W (N, K) scaled per row (along the contraction dim N): folds W's scales into g, keeps W8.

    Exact emulation: ``quantize_rowwise(g · s_W) @ W8`` (W8 never re-quantized); compare also to float64 truth.
    """
    M, N, K = 40, 64, 96
    g, w = torch.randn(M, N), torch.randn(N, K) * torch.logspace(-2, 2, N).unsqueeze(1)  # very different row scales
    w8 = ScaledFp8Tensor.from_hp(w)
    with gemm_backend(backend):
        out = torch.mm(g, w8)
    folded = dequant_rowwise(g * w8.scale.reshape(1, -1), dim=1)
    expected = folded @ w8.qdata.to(torch.float64)
    assert rel_err(out, expected) <= EMULATION_BOUND
    assert rel_err(out, g.double() @ w.double()) <= E4M3_GEMM_BOUND
    # re-quantizing W per column instead would be a different (worse-defined) result: make sure it is not that
    requant = dequant_rowwise(g, 1) @ dequant_rowwise(w8.to_hp(), 0)
    assert rel_err(out, requant) > 10 * EMULATION_BOUND


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(
    "fn,ndim",
    [("linear", 2), ("linear", 3), ("matmul", 2), ("matmul", 3), ("matmul_op", 3), ("mm_addmm", 2)],  # mm: 2-D only
)
def test_linear_mm_addmm_matmul(fn, ndim, bias, dtype, backend):
    K, N = 64, 48
    x = torch.randn((2, 5, K) if ndim == 3 else (10, K), dtype=dtype)
    w = torch.randn(N, K, dtype=dtype)
    b = torch.randn(N, dtype=dtype) if bias else None
    w8 = ScaledFp8Tensor.from_hp(w)
    with gemm_backend(backend):
        if fn == "linear":
            out = F.linear(x, w8, b)
        elif fn == "matmul":
            out = torch.matmul(x, w8.t()) + (b if bias else 0)
        elif fn == "matmul_op":
            out = x @ w8.t() + (b if bias else 0)
        else:
            out = torch.addmm(b, x, w8.t()) if bias else torch.mm(x, w8.t())
    assert type(out) is torch.Tensor and out.dtype == dtype and out.shape == (*x.shape[:-1], N)
    x2 = x.reshape(-1, K)
    expected = emulated_fp8_mm(x2, w8.t()).reshape(*x.shape[:-1], N) + (b.double() if bias else 0)
    truth = x.double() @ w.double().t() + (b.double() if bias else 0)
    assert rel_err(out, expected) <= (EMULATION_BOUND if dtype == torch.float32 else BF16_OUT_BOUND)
    assert rel_err(out, truth) <= E4M3_GEMM_BOUND


@pytest.mark.parametrize("backend", BACKENDS)
def test_addmm_beta_alpha_and_2d_bias(backend):
    x, w = torch.randn(16, 64), torch.randn(32, 64)
    w8 = ScaledFp8Tensor.from_hp(w)
    bias2d = torch.randn(16, 32)
    with gemm_backend(backend):
        out = torch.addmm(bias2d, x, w8.t(), beta=0.5, alpha=2.0)
        out1 = torch.addmm(bias2d, x, w8.t())
    prod = emulated_fp8_mm(x, w8.t())
    assert rel_err(out, 2.0 * prod + 0.5 * bias2d.double()) <= EMULATION_BOUND
    assert rel_err(out1, prod + bias2d.double()) <= EMULATION_BOUND



@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias_shape", [(32,), (16, 32)])
def test_addmm_beta_zero_ignores_the_input(backend, bias_shape):
    """``torch.addmm(input, x, w8.t(), beta=0)`` ignores ``input``, NaN and inf included, as ``torch.addmm`` does:
    the result is ``alpha * x @ w8.t()``. Before: ``0 * input`` was added, so a NaN (or an uninitialized buffer,
    ``torch.empty``) in ``input`` made the output NaN."""
    x, w = torch.randn(16, 64), torch.randn(32, 64)
    w8 = ScaledFp8Tensor.from_hp(w)
    junk = torch.full(bias_shape, float("nan"))
    junk.view(-1)[::2] = float("inf")
    with gemm_backend(backend):
        out = torch.addmm(junk, x, w8.t(), beta=0, alpha=1.5)
    assert not bool(out.isnan().any())
    prod = emulated_fp8_mm(x, w8.t())
    assert rel_err(out, 1.5 * prod) <= EMULATION_BOUND
    assert rel_err(out, 1.5 * (x.double() @ w.double().t())) <= E4M3_GEMM_BOUND

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_all_zero_input_row_gives_exactly_the_bias(dtype, backend):
    x = torch.randn(8, 64, dtype=dtype)
    x[3] = 0
    w8 = ScaledFp8Tensor.from_hp(torch.randn(32, 64, dtype=dtype))
    b = torch.randn(32, dtype=dtype)
    with gemm_backend(backend):
        y = F.linear(x, w8, b)
        # an all-zero weight row gives exactly the bias in that output column
        w0 = torch.randn(32, 64, dtype=dtype)
        w0[5] = 0
        y2 = F.linear(x, ScaledFp8Tensor.from_hp(w0), b)
    assert y.dtype == dtype
    assert same_bits(y[3], b)
    assert same_bits(y2[:, 5], b[5].expand(8))
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_tiny_input(backend):
    """fp16 activations with max|x| ~ 1e-6 (fp16 subnormals): finite scales, finite correct outputs."""
    x = (torch.randn(16, 64) * 3e-7).clamp(-1e-6, 1e-6).half()
    w = torch.randn(32, 64).half()
    w8 = ScaledFp8Tensor.from_hp(w)
    _, sx = quantize_rowwise(x, dim=1)
    assert torch.isfinite(sx).all() and (sx > 0).all()
    with gemm_backend(backend):
        y = F.linear(x, w8)
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
    assert rel_err(y, x.double() @ w.double().t()) <= E4M3_GEMM_BOUND


@pytest.mark.parametrize("backend", BACKENDS)
def test_scaled_mm_accepts_padded_column_major_b(backend):
    """B given column-major with a leading stride larger than K (a view into a padded buffer)."""
    M, K, N, ld = 32, 64, 48, 80
    a8, sa = quantize_rowwise(torch.randn(M, K), dim=1)
    bt8, sbt = quantize_rowwise(torch.randn(N, K), dim=1)
    store = torch.zeros(N, ld, dtype=E4M3)
    store[:, :K] = bt8
    b_padded = store[:, :K].t()
    assert b_padded.stride() == (1, ld) and b_padded.shape == (K, N)
    a_store = torch.zeros(M, ld, dtype=E4M3)
    a_store[:, :K] = a8
    out = scaled_mm(a8, sa, b_padded, sbt.t(), torch.float32, backend=backend)
    out_a_padded = scaled_mm(a_store[:, :K], sa, b_padded, sbt.t(), torch.float32, backend=backend)
    ref = scaled_mm(a8, sa, bt8.t().contiguous(), sbt.t(), torch.float32, backend=backend)
    assert torch.equal(out, ref) and torch.equal(out_a_padded, ref)
    expected = (a8.double() * sa.double()) @ (bt8.double() * sbt.double()).t()
    assert rel_err(out, expected) <= EMULATION_BOUND
    assert torch.equal(store[:, K:].view(torch.uint8), torch.zeros(N, ld - K, dtype=torch.uint8))  # untouched


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_scaled_mm_bias_each_output_dtype(out_dtype, backend):
    a8, sa = quantize_rowwise(torch.randn(24, 64), dim=1)
    bt8, sbt = quantize_rowwise(torch.randn(40, 64), dim=1)
    bias = torch.randn(40, dtype=out_dtype) * 10
    out = scaled_mm(a8, sa, bt8.t(), sbt.t(), out_dtype, bias=bias, backend=backend)
    assert out.dtype == out_dtype and out.shape == (24, 40)
    expected = (a8.double() * sa.double()) @ (bt8.double() * sbt.double()).t() + bias.double()
    assert rel_err(out, expected) <= (EMULATION_BOUND if out_dtype == torch.float32 else BF16_OUT_BOUND)
    # bias added exactly once: subtracting it leaves the product
    no_bias = scaled_mm(a8, sa, bt8.t(), sbt.t(), torch.float32, backend=backend)
    assert rel_err(out.double() - bias.double(), no_bias) <= (1e-5 if out_dtype == torch.float32 else 5e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["input", "weight"])
def test_nan_inf_poison_only_their_row(where, backend):
    x, w = torch.randn(8, 64), torch.randn(16, 64)
    xb, wb = x.clone(), w.clone()
    if where == "input":
        xb[2, 5], xb[4, 1] = float("nan"), float("inf")
    else:
        wb[3, 7], wb[9, 0] = float("nan"), -float("inf")
    from fp8tensor.subclass.tensor import make_scaled, rowwise_dims

    def unchecked(t):  # from_hp refuses non-finite rows; the per-step quantization (no host check) lets them through
        q, s = quantize_rowwise(t, dim=-1)
        return make_scaled(q, s, t.dtype, True, rowwise_dims(t.ndim, -1))

    with gemm_backend(backend):
        clean = F.linear(x, ScaledFp8Tensor.from_hp(w))
        y = F.linear(xb, unchecked(wb))
        # the fp8 operand may also be the activation
        y_act8 = F.linear(unchecked(xb), wb)
    bad = [2, 4] if where == "input" else [3, 9]
    good = [i for i in range(8 if where == "input" else 16) if i not in bad]
    for out in (y, y_act8):
        o = out if where == "input" else out.t()
        c = clean if where == "input" else clean.t()
        assert not torch.isfinite(o[bad]).any()
        assert torch.isfinite(o[good]).all()
        if out is y:
            assert torch.equal(o[good], c[good])  # row-wise scales: other rows are bit-identical


def test_backend_selection_api():
    assert get_gemm_backend() == "auto"
    with gemm_backend("emulated"):
        assert get_gemm_backend() == "emulated"
        with gemm_backend("tensorwise"):
            assert get_gemm_backend() == "tensorwise"
        assert get_gemm_backend() == "emulated"
    assert get_gemm_backend() == "auto"
    try:
        set_gemm_backend("emulated")
        assert get_gemm_backend() == "emulated"
        with gemm_backend("rowwise"):
            assert get_gemm_backend() == "rowwise"
        assert get_gemm_backend() == "emulated"
    finally:
        set_gemm_backend("auto")
    with pytest.raises(ValueError, match="unknown backend 'cublas'"):
        set_gemm_backend("cublas")
    with pytest.raises(ValueError, match="unknown backend"):
        with gemm_backend("fast"):
            pass
    assert get_gemm_backend() == "auto"
    assert set(fp8tensor.BACKENDS) == {"auto", *BACKENDS}
    for be in fp8tensor.BACKENDS:
        assert choose_backend(torch.device("cpu"), E4M3, E4M3, torch.float32, be) in BACKENDS
    assert choose_backend(torch.device("meta"), E4M3, E4M3, torch.float32, "rowwise") == "emulated"


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_choice_is_honoured(backend, monkeypatch):
    """"emulated" never calls torch._scaled_mm; the scaled-mm backends call it (when it works on this CPU)."""
    calls = []
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append(kwargs.get("scale_a").numel())
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    x, w8 = torch.randn(16, 64), ScaledFp8Tensor.from_hp(torch.randn(32, 64))
    with gemm_backend(backend):
        F.linear(x, w8)
    resolved = choose_backend(x.device, E4M3, E4M3, torch.float32, backend)
    if resolved == "emulated":
        assert calls == []
    elif resolved == "rowwise":
        assert calls == [16]  # per-row scales in the epilogue
    else:
        assert calls == [1]  # unit tensor-wise scales


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_linear_with_fp8_weight_equals_eager(backend):
    torch._dynamo.reset()
    lin = nn.Linear(64, 32)
    lin.weight = nn.Parameter(ScaledFp8Tensor.from_hp(lin.weight.detach()), requires_grad=False)
    x = torch.randn(2, 8, 64)
    eager = lin(x)
    compiled = torch.compile(lin, backend=backend, fullgraph=True)
    out = compiled(x)
    assert out.dtype == eager.dtype and out.shape == eager.shape
    if backend == "aot_eager":
        assert torch.equal(out, eager)
    else:  # inductor may fuse the on-the-fly quantization; allow float32 rounding differences only
        assert rel_err(out, eager) <= EMULATION_BOUND
    x2 = torch.randn(2, 8, 64)
    assert rel_err(compiled(x2), lin(x2)) <= EMULATION_BOUND


def test_cpu_backend_probe_ignores_the_default_dtype():
    """The CPU backend is probed once per process and cached: a first GEMM under ``torch.set_default_dtype(float64)``
    gets the same answer as one under float32 (the probe's tensors name their dtype)."""
    import subprocess
    import sys

    code = ("import torch, fp8tensor; from fp8tensor.gemm import choose_backend; torch.set_default_dtype({dt}); "
            "print(choose_backend(torch.device('cpu'), torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16))")
    got = [subprocess.run([sys.executable, "-c", code.format(dt=dt)], capture_output=True, text=True, timeout=300)
           for dt in ("torch.float64", "torch.float32")]
    assert all(g.returncode == 0 for g in got), [g.stderr[-2000:] for g in got]
    assert got[0].stdout.strip() == got[1].stdout.strip() != "", [g.stdout for g in got]
