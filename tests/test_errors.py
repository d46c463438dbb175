"""Bad inputs to the core API: a clear Python error naming the operation and the reason; inputs unchanged."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fp8tensor import E4M3, ScaledFp8Tensor, fp8_linear, quantize_rowwise
from fp8tensor.gemm import fp8_mm, scaled_mm
from fp8tensor.quantize import check_float8_dtype

from conftest import same_bits

UNSUPPORTED_F8 = [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.bfloat16, torch.int8]


def _snapshot(*ts):
    return [t.detach().clone() if not isinstance(t, ScaledFp8Tensor) else (t.qdata.clone(), t.scale.clone()) for t in ts]


def _unchanged(before, *ts):
    for b, t in zip(before, ts):
        if isinstance(t, ScaledFp8Tensor):
            assert same_bits(b[0], t.qdata) and torch.equal(b[1], t.scale)
        else:
            assert same_bits(b, t.detach())
    return True


@pytest.mark.parametrize(
    "x,exc,msg",
    [
        (torch.randn(5), ValueError, r"from_hp: expected a tensor with at least 2 dims.*\(5,\)"),
        (torch.tensor(1.5), ValueError, r"from_hp: expected a tensor with at least 2 dims.*\(\)"),
        (torch.ones(4, 4, dtype=torch.int32), TypeError, r"from_hp: expected a high-precision floating-point.*int32"),
        (torch.ones(4, 4, dtype=torch.bool), TypeError, r"from_hp: .*bool"),
        (torch.ones(4, 4, dtype=torch.complex64), TypeError, r"from_hp: .*complex64"),
        (torch.ones(4, 4).to(torch.float8_e4m3fn), TypeError, r"from_hp: .*float8_e4m3fn"),
        (torch.ones(4, 4).to(torch.float8_e5m2), TypeError, r"from_hp: .*float8_e5m2"),
        (np.ones((4, 4), dtype=np.float32), TypeError, r"from_hp: expected a torch.Tensor, got ndarray"),
        ([[1.0, 2.0]], TypeError, r"from_hp: expected a torch.Tensor, got list"),
    ],
    ids=["1d", "0d", "int32", "bool", "complex", "fp8-e4m3", "fp8-e5m2", "numpy", "list"],
)
def test_from_hp_rejects_bad_inputs(x, exc, msg):
    before = x.clone() if isinstance(x, torch.Tensor) else None
    with pytest.raises(exc, match=msg):
        ScaledFp8Tensor.from_hp(x)
    if before is not None:
        assert same_bits(before, x) if before.dtype.is_floating_point else torch.equal(before, x)


def test_from_hp_rejects_already_quantized():
    t = ScaledFp8Tensor.from_hp(torch.randn(4, 8))
    before = _snapshot(t)
    with pytest.raises(TypeError, match=r"already a ScaledFp8Tensor.*to_hp\(\)"):
        ScaledFp8Tensor.from_hp(t)
    assert _unchanged(before, t)


@pytest.mark.parametrize("f8", UNSUPPORTED_F8, ids=str)
def test_unsupported_float8_dtypes(f8):
    x = torch.randn(4, 16)
    before = x.clone()
    for op, fn in [
        ("ScaledFp8Tensor.from_hp", lambda: ScaledFp8Tensor.from_hp(x, f8)),
        ("quantize_rowwise", lambda: quantize_rowwise(x, -1, f8)),
        ("myop", lambda: check_float8_dtype(f8, "myop")),
    ]:
        with pytest.raises(TypeError, match=rf"{op}: unsupported float8 dtype {f8}.*float8_e4m3fn or torch.float8_e5m2"):
            fn()
    assert same_bits(before, x)


def test_constructor_validates_parts():
    q, s = quantize_rowwise(torch.randn(8, 16))
    with pytest.raises(TypeError, match="qdata must be float8"):
        ScaledFp8Tensor(q.float(), s, torch.float32)
    with pytest.raises(TypeError, match="scale must be float32"):
        ScaledFp8Tensor(q, s.double(), torch.float32)
    with pytest.raises(TypeError, match="orig_dtype must be a high-precision float"):
        ScaledFp8Tensor(q, s, torch.int32)
    with pytest.raises(TypeError, match="orig_dtype must be a high-precision float"):
        ScaledFp8Tensor(q, s, E4M3)
    with pytest.raises(ValueError, match=r"scale of shape \(8, 2\) does not broadcast"):
        ScaledFp8Tensor(q, torch.ones(8, 2), torch.float32)
    with pytest.raises(ValueError, match=r"scale of shape \(8,\) does not broadcast"):
        ScaledFp8Tensor(q, torch.ones(8), torch.float32)


def _fp8_w():
    return ScaledFp8Tensor.from_hp(torch.randn(32, 64))


@pytest.mark.parametrize(
    "case",
    ["mm_inner", "linear_inner", "addmm_inner", "mm_3d", "mm_1d", "int_operand", "meta_a", "meta_b", "fp8_mm_inner"],
)
def test_gemm_rejects_bad_operands(case):
    w8 = _fp8_w()
    x = torch.randn(4, 32)  # K = 32, but w8 has K = 64
    good_x = torch.randn(4, 64)
    cases = {
        "mm_inner": (lambda: torch.mm(x, w8.t()), RuntimeError, r"aten\.mm: mat1 and mat2 shapes cannot be multiplied \(4x32 and 64x32\)"),
        "linear_inner": (lambda: F.linear(x, w8), RuntimeError, r"shapes cannot be multiplied \(4x32 and 64x32\)"),
        "addmm_inner": (lambda: torch.addmm(torch.randn(32), x, w8.t()), RuntimeError, r"aten\.addmm: mat1 and mat2 shapes"),
        "mm_3d": (lambda: torch.mm(torch.randn(2, 4, 64), w8.t()), RuntimeError, r"aten\.mm: expected 2-D operands"),
        "mm_1d": (lambda: torch.mm(torch.randn(64), w8.t()), RuntimeError, r"2-D"),
        "int_operand": (lambda: fp8_mm(torch.ones(4, 64, dtype=torch.int64), w8.t()), RuntimeError, r"fp8tensor\.mm: expected floating-point operands, got torch\.int64"),
        "meta_a": (lambda: torch.mm(torch.randn(4, 64, device="meta"), w8.t()), RuntimeError, r"aten\.mm: operands are on different devices \(meta and cpu\)"),
        "meta_b": (lambda: torch.mm(good_x, ScaledFp8Tensor.from_hp(torch.randn(32, 64, device="meta")).t()), RuntimeError, r"aten\.mm: operands are on different devices \(cpu and meta\)"),
        "fp8_mm_inner": (lambda: fp8_mm(x, w8.t(), op="myop"), RuntimeError, r"myop: mat1 and mat2"),
    }
    fn, exc, msg = cases[case]
    before = _snapshot(x, good_x, w8)
    with pytest.raises(exc, match=msg):
        fn()
    assert _unchanged(before, x, good_x, w8)


def test_fp8_linear_rejects_bad_shapes():
    w = torch.randn(32, 64)
    x = torch.randn(4, 48)
    before = _snapshot(w, x)
    with pytest.raises(RuntimeError, match=r"fp8_linear: input's last dim \(48,\) does not match weight's in_features 64"):
        fp8_linear(x, w)
    with pytest.raises(RuntimeError, match=r"fp8_linear: weight must be 2-D"):
        fp8_linear(x, torch.randn(48))
    with pytest.raises(ValueError, match=r"fp8tensor: unknown recipe 'tensorwise'"):
        fp8_linear(torch.randn(4, 64), w, recipe="tensorwise")
    b = torch.randn(48)
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(
                RuntimeError, match=r"fp8_linear: bias shape \(48,\) does not match the weight's out_features 32"):
            fp8_linear(torch.randn(4, 64), w, b)
    # a bias of several dims that does not broadcast to the output shape (it would grow it, or mismatch x's
    # leading dims): one per output row of the flattened GEMM is not the same thing
    for xs, bs in (((3, 1, 64), (3, 32)), ((2, 3, 64), (6, 32)), ((4, 64), (1, 1, 32)), ((2, 3, 64), (2, 2, 32))):
        xb, bb = torch.randn(xs), torch.randn(bs)
        before_b = _snapshot(xb, bb)
        for grad in (True, False):
            with torch.set_grad_enabled(grad), pytest.raises(
                    RuntimeError, match=rf"fp8_linear: bias shape \({bs[0]}, .*does not broadcast to the output shape"):
                fp8_linear(xb, w, bb)
        assert _unchanged(before_b, xb, bb)
    assert _unchanged(before, w, x)


@pytest.mark.parametrize("x_shape, shape", [((4, 64), s) for s in [(), (1,), (32,), (1, 32), (4, 32)]]
                         + [((2, 3, 64), s) for s in [(1, 32), (3, 32), (2, 1, 32), (1, 3, 1), (2, 3, 32)]])
def test_fp8_linear_broadcasts_the_bias_as_f_linear(x_shape, shape):
    """A bias that broadcasts to the output shape works as ``input @ weight.T + bias`` (within the fp8 bound of
    float64), with autograd on and off; its gradient is the output gradient summed over the dims it broadcasts over
    (a bias of several dims broadcasts over ``x``'s leading dims, not over the rows of the flattened GEMM)."""
    w, x, b = torch.randn(32, 64), torch.randn(x_shape), torch.randn(shape)
    ref_b = b.double().requires_grad_()
    ref = x.double() @ w.double().t() + ref_b
    with torch.no_grad():
        out_nograd = fp8_linear(x, w, b)
    b.requires_grad_()
    out = fp8_linear(x, w, b)
    for o in (out.detach(), out_nograd):
        assert o.shape == ref.shape and float((o.double() - ref.detach()).norm() / ref.detach().norm()) < 5e-2
    gy = torch.randn(ref.shape)
    out.backward(gy)
    ref.backward(gy.double())
    assert b.grad.shape == b.shape and torch.allclose(b.grad.double(), ref_b.grad, rtol=1e-5, atol=1e-5)


def test_scaled_mm_rejects_unknown_backend():
    a8, sa = quantize_rowwise(torch.randn(4, 16))
    b8, sb = quantize_rowwise(torch.randn(8, 16))
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        scaled_mm(a8, sa, b8.t(), sb.t(), torch.float32, backend="nope")


@pytest.mark.parametrize("kind", ["plain", "master", "frozen"])
def test_fp8_linear_rejects_bad_operands_in_eager(kind):
    """The eager fp8 Linear calls its GEMM engine without the dispatcher; bad inputs still get the GEMM's named
    errors (not a result from uninitialized memory): an input on another device, an integer input."""
    import torch.nn as nn

    from fp8tensor import convert_to_fp8, quantize_weights

    lin = nn.Linear(64, 32, bias=False)
    if kind != "plain":
        convert_to_fp8(lin)
    if kind == "frozen":
        quantize_weights(lin)
    fn = (lambda x: fp8_linear(x, lin.weight)) if kind == "plain" else lin
    with torch.no_grad():
        with pytest.raises(RuntimeError, match=r"aten\.mm: operands are on different devices"):
            fn(torch.randn(4, 64, device="meta"))
        with pytest.raises(RuntimeError, match=r"aten\.mm: expected floating-point operands, got torch\.int64"):
            fn(torch.ones(4, 64, dtype=torch.int64))


@pytest.mark.parametrize("conversion", ["quantize_weights", "convert_to_fp8"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_converted_linear_names_itself_for_a_non_tensor_or_sparse_input(conversion, grad):
    """A list, a sparse or a nested input gets a ``TypeError`` naming ``fp8_linear``, not an AttributeError or a backend's
    message; the weights are unchanged."""
    import fp8tensor

    lin = getattr(fp8tensor, conversion)(torch.nn.Linear(32, 16))
    assert type(lin).__name__.startswith("Fp8")
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    with torch.set_grad_enabled(grad):
        with pytest.raises(TypeError, match="fp8_linear: input must be a Tensor, got list"):
            lin([[1.0] * 32])
        with pytest.raises(TypeError, match="fp8_linear: input must be a dense"):
            lin(torch.randn(3, 32).to_sparse())
        # a strided nested tensor reports the strided layout (nn.Linear takes it; fp8_linear asks for a dense one)
        nested = torch.nested.nested_tensor([torch.randn(2, 32), torch.randn(3, 32)], layout=torch.strided)
        with pytest.raises(TypeError, match="fp8_linear: input must be a dense .*nested tensor"):
            lin(nested)
    after = lin.state_dict()
    assert all(torch.equal(fp8tensor.dequantize(after[k]) if isinstance(after[k], ScaledFp8Tensor) else after[k],
                           fp8tensor.dequantize(v) if isinstance(v, ScaledFp8Tensor) else v) for k, v in before.items())


@pytest.mark.parametrize("src_dtype", [torch.bool, torch.int32])
def test_copy_of_integer_or_bool_values_into_an_fp8_weight(src_dtype):
    """``weight.copy_(src)`` converts bool and integer values as ``copy_`` does for a high-precision weight: the
    weight then holds them quantized per row, within e4m3's rounding."""
    w = ScaledFp8Tensor.from_hp(torch.randn(4, 8))
    vals = torch.randn(4, 8) * 3
    src = (vals > 0) if src_dtype is torch.bool else vals.to(src_dtype)
    want = src.to(torch.float64)
    w.copy_(src)
    got = w.to_hp(torch.float64)
    assert ((got - want).abs() <= 2.0**-4 * want.abs().amax(dim=1, keepdim=True)).all(), (got, want)


@pytest.mark.parametrize("f8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_copy_of_a_plain_fp8_tensor_into_an_fp8_weight_raises_and_changes_nothing(f8):
    """A plain fp8 tensor holds the codes of some scaled tensor, not values: ``copy_`` refuses it (a checkpoint's
    ``weight`` without its ``weight_scale`` would otherwise load as codes, orders of magnitude off)."""
    w = ScaledFp8Tensor.from_hp(torch.randn(4, 8))
    before = w.qdata.view(torch.uint8).clone(), w.scale.clone()
    with pytest.raises(TypeError, match="copy_: the source is a plain torch.float8"):
        w.copy_(ScaledFp8Tensor.from_hp(torch.randn(4, 8), f8).qdata)
    assert torch.equal(w.qdata.view(torch.uint8), before[0]) and torch.equal(w.scale, before[1])


def test_copy_of_complex_values_into_an_fp8_weight_raises_and_changes_nothing():
    w = ScaledFp8Tensor.from_hp(torch.randn(4, 8))
    before = w.qdata.view(torch.uint8).clone(), w.scale.clone()
    with pytest.raises(TypeError, match="copy_: a complex source"):
        w.copy_(torch.randn(4, 8, dtype=torch.complex64))
    assert torch.equal(w.qdata.view(torch.uint8), before[0]) and torch.equal(w.scale, before[1])


def test_fp8_linear_names_itself_for_a_non_tensor_weight():
    """``fp8_linear`` with a weight that is not a tensor: a ``TypeError`` naming the op, as for the input."""
    import fp8tensor

    with pytest.raises(TypeError, match="fp8_linear: weight must be a Tensor, got list"):
        fp8tensor.fp8_linear(torch.randn(2, 4), [[1.0] * 4])


def test_refused_quantize_weights_leaves_the_model_unchanged():
    """A NaN in a selected weight: ``quantize_weights`` raises before any change, ``fp8_skipped`` of an earlier
    conversion included, and warns of nothing it did not do."""
    import warnings

    import fp8tensor

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 32)
            self.a = torch.nn.Linear(32, 32)
            self.head = torch.nn.Linear(32, 16)
            self.head.weight = self.emb.weight  # (left in high precision: a warning when the conversion happens)

    m = M()
    m.fp8_skipped = ["earlier"]
    with torch.no_grad():
        m.a.weight[0, 0] = float("nan")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=r"quantize_weights: a\.weight: inf or NaN"):
            fp8tensor.quantize_weights(m)
    assert not [str(c.message) for c in caught if "quantize_weights" in str(c.message)]
    assert m.fp8_skipped == ["earlier"] and type(m.a) is torch.nn.Linear
    assert all(torch.equal(v.nan_to_num(), before[k].nan_to_num()) for k, v in m.state_dict().items())
