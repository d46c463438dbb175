"""Edge shapes and modes, single process: empty and one-row tensors, zero tokens, inference mode,
``torch.compile`` with dynamic shapes, ``LocalTensor`` inputs, ``.to(fp8)``, tiny rows, constructor validation.

Every check goes through the public API. References: the same computation on the dequantized values in float64
(GEMMs, within the e4m3 GEMM bound), or bit equality where the math is the same (quantizing a slice, a view, the
simulated collectives). Collectives on real gloo processes are in ``tests/distributed/test_small_shards_gloo.py``.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

from fp8tensor import E4M3, E5M2, ScaledFp8Tensor, convert_to_fp8, fp8_linear, quantize_weights

from conftest import E4M3_GEMM_BOUND, rel_err, same_bits, same_fp8

RECIPES = ("rowwise", "rowwise_gw_hp")
TINY = torch.finfo(torch.float32).tiny  # smallest normal float32


def _snapshot(t: ScaledFp8Tensor):
    return t.qdata.view(torch.uint8).clone(), t.scale.clone()


def _unchanged(before, t: ScaledFp8Tensor) -> bool:
    return torch.equal(before[0], t.qdata.view(torch.uint8)) and same_bits(before[1], t.scale)


# ============================================================================================ 1. empty / one-row
@pytest.mark.parametrize("shape", [(7, 0), (0, 7), (0, 0), (3, 0, 5), (2, 3, 0), (1, 9), (1, 1)])
@pytest.mark.parametrize("f8", [E4M3, E5M2])
def test_from_hp_empty_and_one_row(shape, f8):
    """``from_hp`` of tensors with no elements or a single row: one scale per row (``(*shape[:-1], 1)``), finite and
    positive; the values round-trip as for any other tensor (an empty row has amax 0, like an all-zero row)."""
    x = torch.randn(shape)
    t = ScaledFp8Tensor.from_hp(x, f8)
    assert t.shape == x.shape and t.qdata.dtype == f8
    assert t.scale.shape == (*shape[:-1], 1)
    assert bool(torch.isfinite(t.scale).all()) and bool((t.scale > 0).all())
    if x.numel():
        # one rounding step of the format: relative error of each element <= 2^-(mantissa bits + 1)
        eps = 2.0 ** -(4 if f8 == E4M3 else 3)
        err = (t.to_hp().double() - x.double()).abs()
        assert bool((err <= eps * x.double().abs().amax(-1, keepdim=True) + 1e-30).all())
    # a slice of the rows quantizes like the rows themselves (bit-exact)
    if x.dim() == 2 and x.shape[0]:
        assert same_fp8(t[:1], ScaledFp8Tensor.from_hp(x[:1], f8))


def test_views_of_empty_and_one_row_tensors_keep_per_row_scales():
    """Views that keep the shape keep the scale layout: an empty ``[0, 7]`` tensor keeps its ``[0, 1]`` scale (it was
    widened to ``[0, 7]``, which made padding and all-gathers of that rank disagree with the others), a one-row
    ``[1, 7]`` tensor keeps ``[1, 1]``; dequantized values are those of the base."""
    for rows in (0, 1, 2):
        x = torch.randn(rows, 7)
        t = ScaledFp8Tensor.from_hp(x)
        for v in (t.view(rows, 7), t.reshape(rows, 7), t.view(t.shape), t[:], t.narrow(0, 0, rows), t.contiguous()):
            assert isinstance(v, ScaledFp8Tensor)
            assert v.scale.shape == (rows, 1), (rows, tuple(v.scale.shape))
            assert torch.equal(v.to_hp(), t.to_hp())
        cols = t.narrow(1, 0, 0)  # empty column slice
        assert cols.shape == (rows, 0) and cols.scale.shape == (rows, 1)


@pytest.mark.parametrize("rows", [0, 1, 2, 5])
def test_zero_padding_pads_per_row_scales_of_short_shards(rows):
    """DTensor zero-pads uneven shards before a collective: a per-row scale is padded with the data on the row dim
    also when the shard has a single row (a ``[1, 1]`` scale, not to be taken for a tensor-wide one) or none, and is
    never padded on the dim it is shared over. The padded tensor dequantizes to the rows followed by zeros."""
    import torch.nn.functional as F

    x = torch.randn(rows, 6)
    t = ScaledFp8Tensor.from_hp(x)
    before = _snapshot(t)
    p = F.pad(t, (0, 0, 0, 3 - rows if rows < 3 else 1))
    n = p.shape[0]
    assert isinstance(p, ScaledFp8Tensor) and p.scale.shape == (n, 1)
    assert torch.equal(p.to_hp()[:rows], t.to_hp()) and not bool(p.to_hp()[rows:].any())
    q = F.pad(t, (0, 2))  # pad columns: the row scales stay one per row
    assert q.scale.shape == (rows, 1) and torch.equal(q.to_hp()[:, :6], t.to_hp())
    assert _unchanged(before, t)


@pytest.mark.parametrize("rows", [0, 1, 3])
def test_aten_pad_keeps_fp8(rows):
    """``aten.pad`` (what ``F.pad`` calls) reaches the op table itself below autograd, where DTensor runs its local
    ops (DTensor pads uneven shards with ``F.pad`` before an all-gather). It pads like ``constant_pad_nd``: fp8 zeros,
    per-row scales padded with ones: a dequantized result would make a rank whose shard needs padding send a plain
    all-gather while the others send fp8 ones (a hang on gloo, torch 2.14, ``.t()`` of an unevenly sharded fp8
    DTensor). Other modes and non-zero values dequantize."""
    import torch.nn.functional as F

    x = torch.randn(rows, 5)
    t = ScaledFp8Tensor.from_hp(x)
    before = _snapshot(t)
    for pad in ([0, 2], [0, 0, 0, 2], [0, 1, 0, 1]):
        with torch._C._AutoDispatchBelowAutograd():  # as inside DTensor's dispatch
            p = F.pad(t, pad)
        ref = torch.ops.aten.constant_pad_nd.default(t, pad)
        assert isinstance(p, ScaledFp8Tensor) and p.shape == ref.shape and p.scale.shape == ref.scale.shape
        assert torch.equal(p.to_hp(), ref.to_hp())
        want = torch.nn.functional.pad(t.to_hp(), pad)
        assert torch.equal(p.to_hp(), want)
    v = torch.ops.aten.pad.default(t, [0, 1], "constant", 2.0)
    assert not isinstance(v, ScaledFp8Tensor) and torch.equal(v, torch.nn.functional.pad(t.to_hp(), [0, 1], value=2.0))
    if rows:
        r = torch.ops.aten.pad.default(t.unsqueeze(0), [1, 1], "replicate")
        assert not isinstance(r, ScaledFp8Tensor)
        assert torch.equal(r, torch.nn.functional.pad(t.to_hp().unsqueeze(0), [1, 1], mode="replicate"))
    assert _unchanged(before, t)


@pytest.mark.parametrize("shape,chunks", [((6, 4), 3), ((5, 3), 2), ((1, 4), 3), ((0, 4), 2), ((4, 0), 3)])
def test_chunk_below_autograd_keeps_fp8(shape, chunks):
    """``torch.chunk`` and ``narrow`` reach the op table itself below autograd, where DTensor runs its local ops (a gather along
    dim 1 chunks and concatenates). It splits like ``torch.chunk`` on the dequantized tensor, along rows and columns,
    for row-scaled and column-scaled (``w.T``) tensors, and the pieces stay fp8."""
    for t in (ScaledFp8Tensor.from_hp(torch.randn(*shape)), ScaledFp8Tensor.from_hp(torch.randn(*shape[::-1])).t()):
        for dim in (0, 1):
            with torch._C._AutoDispatchBelowAutograd():  # as inside DTensor's dispatch
                got = torch.chunk(t, chunks, dim)
            want = torch.chunk(t.to_hp(), chunks, dim)
            assert len(got) == len(want), (shape, chunks, dim)
            for g, w in zip(got, want):
                assert isinstance(g, ScaledFp8Tensor) and torch.equal(g.to_hp(), w), (shape, chunks, dim)
            n = t.shape[dim]
            for start, length in ((0, n), (n // 2, n - n // 2), (-n, n // 2)):  # narrow (DTensor unpads with it)
                if n == 0 and start < 0:
                    continue
                with torch._C._AutoDispatchBelowAutograd():
                    g = t.narrow(dim, start, length)
                assert isinstance(g, ScaledFp8Tensor) and torch.equal(g.to_hp(), t.to_hp().narrow(dim, start, length))


# ============================================================================================ 2. zero tokens
def _fp64_linear(x, w, b):
    return x.double() @ w.double().t() + b.double()


@pytest.mark.parametrize("shape", [(0, 32), (3, 0, 32), (0, 0, 32)])
def test_quantize_weights_zero_tokens(shape):
    """Inference with no tokens: ``quantize_weights(nn.Linear(32, 16))`` returns an empty output of the right shape
    and dtype; one token still works and matches float64 within the fp8 GEMM bound."""
    lin = nn.Linear(32, 16)
    m = quantize_weights(copy.deepcopy(lin))
    y = m(torch.randn(shape))
    assert y.shape == (*shape[:-1], 16) and y.dtype == torch.float32
    # One token still works: per-token scaling makes each row of a batch independent of the others, so a single
    # token gives its row of a 64-token batch (up to the float32 summation order of the CPU GEMM), and that batch matches float64 within the fp8 GEMM bound
    # (one row of 16 outputs alone is too small a sample for a relative-error bound).
    xb = torch.randn(64, 32)
    yb = m(xb)
    torch.testing.assert_close(m(xb[5:6]), yb[5:6], rtol=1e-5, atol=1e-6)
    assert rel_err(yb, _fp64_linear(xb, lin.weight, lin.bias)) < E4M3_GEMM_BOUND


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape", [(0, 32), (4, 0, 32)])
def test_training_zero_tokens_zero_gradients(recipe, shape):
    """Training with an empty batch (packing, uneven data shards, MoE routing): output of the right shape, input
    gradient of the input's shape, weight and bias gradients exactly zero."""
    m = convert_to_fp8(nn.Linear(32, 16), recipe=recipe)
    x = torch.randn(shape, requires_grad=True)
    y = m(x)
    assert y.shape == (*shape[:-1], 16)
    y.backward(torch.randn(y.shape))
    assert x.grad.shape == x.shape
    assert m.weight.grad.shape == (16, 32) and not bool(m.weight.grad.any())
    assert m.bias.grad.shape == (16,) and not bool(m.bias.grad.any())
    # fp8_linear with a frozen fp8 weight, too
    w8 = ScaledFp8Tensor.from_hp(torch.randn(16, 32))
    x2 = torch.randn(shape, requires_grad=True)
    y2 = fp8_linear(x2, w8, recipe=recipe)
    y2.sum().backward()
    assert y2.shape == (*shape[:-1], 16) and x2.grad.shape == x2.shape


def test_gemm_with_empty_contraction_dim():
    """``[M, 0] @ [0, N]`` is all zeros (plus the bias), as in PyTorch."""
    a8 = ScaledFp8Tensor.from_hp(torch.randn(5, 0))
    b = torch.randn(0, 3)
    out = torch.mm(a8, b)
    assert out.shape == (5, 3) and not bool(out.any())
    bias = torch.randn(3)
    assert torch.equal(torch.addmm(bias, a8, b), bias.expand(5, 3))



@pytest.mark.parametrize("kind", ["convert", "quantize_weights"])
@pytest.mark.parametrize("K,N", [(0, 16), (32, 0), (0, 0)])
def test_linear_with_no_in_or_out_features(kind, K, N):
    """``nn.Linear(0, N)`` / ``nn.Linear(K, 0)`` converted, given 3-D inputs (batch, tokens, K), forward and backward
    (a training Linear) as ``nn.Linear``: the output is the bias broadcast (no in_features) or empty, the gradients
    have their tensors' shapes (zeros where nothing contracts). Before: ``reshape(-1, 0)`` raised torch's
    "cannot reshape tensor of 0 elements ... ambiguous"."""
    ref = nn.Linear(K, N)
    m = copy.deepcopy(ref)
    (convert_to_fp8 if kind == "convert" else quantize_weights)(nn.Sequential(m))
    x = torch.randn(2, 5, K, requires_grad=True)
    y = m(x)
    expected = _fp64_linear(x.detach(), ref.weight.detach(), ref.bias.detach())
    assert y.shape == (2, 5, N) and torch.equal(y.double(), expected)  # (K == 0: exactly the bias)
    y.backward(torch.randn(y.shape))
    assert x.grad.shape == x.shape and not bool(x.grad.any())  # (a zero-size x, or no outputs to come from)
    if kind == "convert":
        assert m.weight.grad.shape == (N, K) and m.bias.grad.shape == (N,)
    with torch.no_grad():
        assert m(torch.randn(2, 5, K)).shape == (2, 5, N)

# ============================================================================================ 3. inference mode
def test_views_under_inference_mode_of_tensor_created_outside():
    """``t``, slicing, ``detach``, ``view`` and the GEMM under ``torch.inference_mode()`` on a ScaledFp8Tensor created
    outside it: same values as outside; the original is untouched."""
    x = torch.randn(8, 16)
    w8 = ScaledFp8Tensor.from_hp(x)
    before = _snapshot(w8)
    want = w8.to_hp()
    a = torch.randn(64, 16)  # (enough rows that the relative error averages: 3 rows exceeded the bound at times)
    with torch.inference_mode():
        views = {
            "t": (w8.t(), want.t()),
            "rows": (w8[1:3], want[1:3]),
            "cols": (w8[:, 2:5], want[:, 2:5]),
            "detach": (w8.detach(), want),
            "view": (w8.view(2, 4, 16), want.view(2, 4, 16)),
            "select": (w8[2], want[2]),
        }
        y = a @ w8.t()
    for name, (v, ref) in views.items():
        assert isinstance(v, ScaledFp8Tensor), name
        assert torch.equal(v.to_hp(), ref), name
    assert rel_err(y, a.double() @ x.double().t()) < E4M3_GEMM_BOUND
    assert _unchanged(before, w8)
    # created inside inference mode: an inference tensor, its views too
    with torch.inference_mode():
        w_inf = ScaledFp8Tensor.from_hp(x)
        assert torch.equal(w_inf.t().to_hp(), want.t())


# ============================================================================================ 4. dynamic shapes
def test_compile_dynamic_chained_linears_backward():
    """``torch.compile(dynamic=True)`` of two chained converted Linears with a backward (no dynamo
    "lift_tracked_freevar_to_input" failure); equals eager, then runs other token counts without failing."""
    torch._dynamo.reset()
    base = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 16))
    eager = convert_to_fp8(copy.deepcopy(base))
    comp = convert_to_fp8(copy.deepcopy(base))
    f = torch.compile(comp, dynamic=True, backend="aot_eager")
    for n in (8, 5, 1):
        x = torch.randn(n, 32)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yc = eager(xe), f(xc)
        gy = torch.randn(ye.shape)
        ye.backward(gy)
        yc.backward(gy)
        assert same_bits(yc, ye), n
        assert rel_err(xc.grad, xe.grad) < 1e-6, n
        for (name, pe), pc in zip(eager.named_parameters(), comp.parameters()):
            assert rel_err(pc.grad, pe.grad) < 1e-6, (n, name)
            pe.grad = pc.grad = None


def test_compile_dynamic_row_sliced_fp8_tensor():
    """A row slice of an fp8 tensor (storage offset != 0, as every shard after the first) as an input of a function
    compiled with ``dynamic=True``: equals eager for several offsets and sizes. Passed as ``.detach()`` of the slice:
    a slice itself is an autograd view, and PyTorch's fake-ification of subclass views fails (see
    ``docs/pytorch_issues.md``)."""
    torch._dynamo.reset()
    f = torch.compile(lambda w, x: x @ w.t(), dynamic=True, backend="aot_eager")
    full = ScaledFp8Tensor.from_hp(torch.randn(301, 100))
    for start, n in ((1, 7), (3, 5), (100, 2)):
        w = full[start:].detach()
        assert w.storage_offset() == start * 100
        x = torch.randn(n, 100)
        assert same_bits(f(w, x), x @ w.t())


def test_compile_automatic_dynamic_varying_tokens():
    """Default ``torch.compile`` (automatic dynamic after the first recompile) of a converted model over varying
    token counts, forward and backward: equals eager at every size."""
    torch._dynamo.reset()
    base = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16))
    eager = convert_to_fp8(copy.deepcopy(base))
    comp = convert_to_fp8(copy.deepcopy(base))
    f = torch.compile(comp, backend="aot_eager")
    for n in (4, 6, 9, 3):
        x = torch.randn(2, n, 32)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yc = eager(xe), f(xc)
        ye.sum().backward()
        yc.sum().backward()
        assert same_bits(yc, ye), n
        assert rel_err(xc.grad, xe.grad) < 1e-6, n


# ============================================================================================ 5. LocalTensor
def test_from_hp_of_local_tensor_nests_like_dtensor_shards():
    """``from_hp`` of a ``LocalTensor`` (PyTorch's single-process SPMD simulator) gives a LocalTensor of
    ScaledFp8Tensors (the nesting of DTensor shards), each bit-equal to ``from_hp`` of that rank's tensor; a
    simulated Shard(0) -> Replicate then gives every rank the concatenation of the ranks' rows."""
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    n = 3
    if dist.is_initialized():
        pytest.fail("a process group is already initialized (left by an earlier test)")
    dist.init_process_group("fake", rank=0, world_size=n)
    try:
        mesh = init_device_mesh("cpu", (n,))
        shards = [torch.randn(r, 12) * 10.0**r for r in (2, 2, 1)]
        with LocalTensorMode(frozenset(range(n))):
            lt = LocalTensor({r: s for r, s in enumerate(shards)})
            q = ScaledFp8Tensor.from_hp(lt)
            assert isinstance(q, LocalTensor)
            for r in range(n):
                assert same_fp8(q._local_tensors[r], ScaledFp8Tensor.from_hp(shards[r]))
            d = DTensor.from_local(q, mesh, [Shard(0)], run_check=False, shape=(5, 12), stride=(12, 1))
            rep = d.redistribute(mesh, [Replicate()]).to_local()
        want = torch.cat([ScaledFp8Tensor.from_hp(s).to_hp() for s in shards])
        for r in range(n):
            assert torch.equal(rep._local_tensors[r].to_hp(), want), r
    finally:
        dist.destroy_process_group()


# ============================================================================================ 6. .to(fp8)
@pytest.mark.parametrize("f8", [E4M3, E5M2])
def test_to_float8_dtype_raises_instead_of_dropping_the_scale(f8):
    """``w8.to(torch.float8_*)`` would have to drop the scale (3394 became 448, 1e-4 became 0): it raises a
    ``TypeError`` naming the op and what to use instead; the tensor is unchanged. Other dtypes still convert."""
    w = torch.tensor([[3394.0, 1e-4, -7.0, 0.5]])
    w8 = ScaledFp8Tensor.from_hp(w)
    before = _snapshot(w8)
    for call in (lambda: w8.to(f8), lambda: w8.to("cpu", f8), lambda: w8.to(dtype=f8, copy=True), lambda: w8.type(f8)):
        with pytest.raises(TypeError, match=r"ScaledFp8Tensor.*float8.*scale.*(qdata|to_hp)"):
            call()
    assert _unchanged(before, w8)
    assert torch.equal(w8.to(torch.float64), w8.to_hp(torch.float64))


# ============================================================================================ 7. tiny rows
@pytest.mark.parametrize("f8", [E4M3, E5M2])
def test_tiny_rows_keep_relative_precision(f8):
    """Rows whose largest magnitude ranges from 1 down to ``finfo(float8).max * tiny(float32)`` (the smallest amax
    whose scale is a normal float32) keep fp8's relative precision: every element within half an fp8 ulp of its row
    amax (normal range) and the row amax itself maps to the format max; all-zero rows dequantize to exact zeros;
    every scale is finite and positive. Below that limit the scale stays at the smallest normal float32
    (documented): values are still never larger than the input and never NaN."""
    fmax = torch.finfo(f8).max
    mant, min_exp = (3, -6) if f8 == E4M3 else (2, -14)
    limit = fmax * TINY
    amaxes = [1.0, 1e-12, 1e-16, 1e-18, 1e-24, 1e-30, 1e-33, limit * 4, limit]
    x = torch.randn(len(amaxes) + 1, 64, dtype=torch.float64)
    x = x / x.abs().amax(-1, keepdim=True)
    x[:-1] *= torch.tensor(amaxes, dtype=torch.float64).unsqueeze(1)
    x[-1] = 0
    x = x.float()
    t = ScaledFp8Tensor.from_hp(x, f8)
    assert bool(torch.isfinite(t.scale).all()) and bool((t.scale >= TINY).all())
    deq = t.to_hp().double()
    assert not bool(deq[-1].any())
    for i, a in enumerate(amaxes):
        row, got = x[i].double(), deq[i]
        amax = row.abs().max()
        assert float(got.abs().max()) == pytest.approx(float(amax), rel=2.0 ** -(mant + 1)), (i, a)
        # each element: half an fp8 ulp, relative in the normal range, absolute (scale * half the subnormal step)
        # below it
        scale = float(t.scale[i])
        half_sub = scale * 2.0 ** (min_exp - mant - 1)
        err = (got - row).abs()
        assert bool((err <= torch.clamp(row.abs() * 2.0 ** -(mant + 1), min=half_sub) * 1.0001).all()), (i, a)
    below = torch.full((1, 8), limit / 64)
    tb = ScaledFp8Tensor.from_hp(below, f8)
    assert bool(torch.isfinite(tb.scale).all()) and float(tb.scale.min()) >= TINY
    assert bool((tb.to_hp().abs() <= below.abs() * 1.5).all()) and not bool(tb.to_hp().isnan().any())


def test_ordinary_rows_scale_is_amax_over_fp8_max():
    """Rows with amax >= 1e-12 get exactly ``amax / fp8_max`` in float32: the scale floor only touches rows far
    below that."""
    x = torch.randn(64, 48) * torch.logspace(-12, 4, 64).unsqueeze(1)
    for f8 in (E4M3, E5M2):
        t = ScaledFp8Tensor.from_hp(x, f8)
        want = x.abs().amax(-1, keepdim=True) / torch.finfo(f8).max
        assert torch.equal(t.scale, want)


# ============================================================================================ 8. constructor checks
@pytest.mark.parametrize("bad", [-1.0, 0.0, -0.0, float("nan"), float("inf"), float("-inf")])
def test_public_constructor_rejects_bad_scales(bad):
    """``ScaledFp8Tensor(qdata, scale, ...)`` refuses negative, zero, NaN and infinite scales with a ``ValueError``
    naming the op, the bad value and where it is; the tensors passed are unchanged."""
    q = torch.randn(3, 4).to(E4M3)
    s = torch.rand(3, 1) + 0.5
    s[1, 0] = bad
    qb, sb = q.view(torch.uint8).clone(), s.clone()
    with pytest.raises(ValueError, match=r"ScaledFp8Tensor: scale must be finite and positive.*index \(1, 0\)"):
        ScaledFp8Tensor(q, s, torch.float32)
    assert torch.equal(qb, q.view(torch.uint8)) and same_bits(sb, s)
    ok = ScaledFp8Tensor(q, torch.where(torch.isfinite(s) & (s > 0), s, 1.0), torch.float32)
    assert isinstance(ok, ScaledFp8Tensor)


def test_op_results_and_checkpoints_with_non_finite_rows_still_work():
    """Op results are not validated (that is the public constructor's job): a row holding inf gets a non-finite
    scale from the per-step quantization (``from_hp`` itself refuses it) and stays visibly non-finite through views,
    ``clone`` and a pickle round trip."""
    import io

    from fp8tensor import quantize_rowwise
    from fp8tensor.subclass.tensor import make_scaled, rowwise_dims

    x = torch.randn(3, 8)
    x[1, 2] = float("inf")
    q, s = quantize_rowwise(x, dim=-1)
    t = make_scaled(q, s, x.dtype, True, rowwise_dims(2, -1))
    assert not bool(torch.isfinite(t.scale[1]).all())
    for v in (t.t(), t[1:], t.clone(), t.detach()):
        assert isinstance(v, ScaledFp8Tensor)
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    u = torch.load(buf, weights_only=True)
    assert same_bits(u.scale, t.scale) and torch.equal(u.qdata.view(torch.uint8), t.qdata.view(torch.uint8))


# ============================================================================================ compiled
def test_compiled_zero_tokens_inference_views_empty_rows_and_to_fp8():
    """The eager cases above under ``torch.compile``: zero tokens (forward, backward: zero weight gradient), a slice
    in inference mode, ``from_hp`` of a ``[7, 0]`` tensor; ``.to(float8)`` still raises, naming the reason."""
    torch._dynamo.reset()
    m = convert_to_fp8(nn.Linear(32, 16))
    x = torch.randn(0, 32, requires_grad=True)
    y = torch.compile(m, backend="aot_eager")(x)
    y.sum().backward()
    assert y.shape == (0, 16) and x.grad.shape == (0, 32) and not bool(m.weight.grad.any())
    w8 = ScaledFp8Tensor.from_hp(torch.randn(4, 8))
    a = torch.randn(2, 8)
    with torch.inference_mode():
        got = torch.compile(lambda w, a: a @ w[1:3].t(), backend="aot_eager")(w8, a)
    assert same_bits(got, a @ w8[1:3].t())
    e = torch.compile(lambda t: ScaledFp8Tensor.from_hp(t).to_hp(), backend="aot_eager")(torch.randn(7, 0))
    assert e.shape == (7, 0)
    with pytest.raises(Exception, match=r"cannot hold the scale"):
        torch.compile(lambda w: w.to(torch.float8_e4m3fn), backend="aot_eager")(w8)


def test_view_as_under_inference_mode_keeps_fp8():
    """``view_as`` reaches the subclass undecomposed under ``torch.inference_mode`` (``DTensor.from_local`` calls it):
    the result must stay a ScaledFp8Tensor with the same data and scales, not the dequantized tensor."""
    w = torch.randn(32, 64)
    w8 = ScaledFp8Tensor.from_hp(w)
    with torch.inference_mode():
        v = w8.view_as(w8)
    assert type(v) is ScaledFp8Tensor
    assert torch.equal(v.qdata.view(torch.uint8), w8.qdata.view(torch.uint8)) and torch.equal(v.scale, w8.scale)
    assert rel_err(v.to_hp(), w) <= 2.0**-4  # e4m3 rounding: at most 2^-4 relative per element (3 mantissa bits)


# ==================================================================================== 9. one token, dtypes, modes
def test_compile_one_token_training_matches_eager_and_fp64():
    """``torch.compile`` (inductor) of converted Linears with one token: the grad_weight GEMM contracts over a
    single token, where inductor's ``_scaled_mm`` lowering checks the operands' strides ("mat_b must be
    col_major"). Equals eager; output within the fp8 GEMM bound of float64."""
    torch._dynamo.reset()
    base = nn.Sequential(nn.Linear(96, 64, bias=False), nn.Linear(64, 32, bias=False))
    eager = convert_to_fp8(copy.deepcopy(base))
    comp = convert_to_fp8(copy.deepcopy(base))
    f = torch.compile(comp)
    try:
        x = torch.randn(1, 96)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yc = eager(xe), f(xc)
        gy = torch.randn(ye.shape)
        ye.backward(gy)
        yc.backward(gy)
        ref = x.double() @ base[0].weight.double().t() @ base[1].weight.double().t()
        assert rel_err(yc, ref) < 2 * E4M3_GEMM_BOUND  # two chained fp8 GEMMs
        assert rel_err(yc, ye) < 1e-6 and rel_err(xc.grad, xe.grad) < 1e-6
        for pe, pc in zip(eager.parameters(), comp.parameters()):
            assert rel_err(pc.grad, pe.grad) < 1e-6
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)])
def test_mixed_input_and_weight_dtypes_train(recipe, x_dtype, w_dtype):
    """An input whose dtype differs from the weight's: the output has the promoted dtype, each gradient its
    tensor's dtype, and all are within the fp8 GEMM bound of float64 (also ``rowwise_gw_hp``'s high-precision
    grad_weight GEMM, which takes the mixed operands)."""
    x = torch.randn(16, 64, dtype=x_dtype, requires_grad=True)
    w = torch.randn(32, 64, dtype=w_dtype, requires_grad=True)
    y = fp8_linear(x, w, recipe=recipe)
    gy = torch.randn(y.shape, dtype=y.dtype)
    y.backward(gy)
    xd, wd, gd = x.detach().double(), w.detach().double(), gy.double()
    assert y.dtype == torch.promote_types(x_dtype, w_dtype)
    assert x.grad.dtype == x_dtype and w.grad.dtype == w_dtype
    assert rel_err(y, xd @ wd.t()) < E4M3_GEMM_BOUND
    assert rel_err(x.grad, gd @ wd) < E4M3_GEMM_BOUND
    assert rel_err(w.grad, gd.t() @ xd) < E4M3_GEMM_BOUND


def test_eager_gemms_visible_to_dispatch_modes():
    """A dispatch mode (selective activation checkpointing, FLOP counters) sees each of the fp8 Linear's three GEMMs
    as ``aten.mm``, also in eager mode where the Linear otherwise calls its GEMM engine directly."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMM(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.mm = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.mm += func is torch.ops.aten.mm.default
            return func(*args, **(kwargs or {}))

    lin = convert_to_fp8(nn.Linear(64, 32, bias=False))
    x = torch.randn(8, 64, requires_grad=True)
    with CountMM() as mode:
        lin(x).sum().backward()
    assert mode.mm == 3
    y_plain = lin(x)  # and the direct path outside the mode gives the same bits
    with CountMM():
        y_mode = lin(x)
    assert same_bits(y_plain, y_mode)
