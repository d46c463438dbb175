"""Run the small-M fp8-weight GEMM (decode) under Triton's interpreter (CPU) against float64.

Invoked by tests/test_quantize.py in a subprocess with TRITON_INTERPRET=1 (read when the kernels are defined), a seed
as its argument. Through ``launch_w8_mm`` itself: M = 0, 1 and up to the 128-row block, odd N, K not a multiple of
the tiles, bias or not, bf16 / fp16, splits of K (summed by the second launch) forced through ``tiles=`` (the CPU
plan sees one SM), the same bits run after run, and more rows than the largest row block refused; a contiguous
``(..., K)`` ``x`` as its rows; also an fp8 ``x``
with row scales (``x_scale``: the dot fp8 x fp8) and its argument checks.

Bound: ``out`` is the float32 sum of exact products (an fp8 value times a bf16 / fp16 value fits in float32),
times the row scale, plus the bias, rounded once to the output dtype: elementwise
``|out - ref| <= u |ref| + (1 + u) gamma (|x| |w8 * s|^T + |b|)`` with ``u`` the output's unit roundoff (2^-11
fp16; bf16 2^-7, not 2^-8: the interpreter's float32 -> bf16 cast truncates where the GPU's rounds to nearest) and
``gamma = n eps / (1 - n eps)``, ``eps = 2^-24``, ``n = K + 2`` (K additions, the scale, the bias); checked in
Frobenius norm relative to ``‖ref‖``, and the error also within ``1.05 u`` (the float32 sums are far more accurate
than their worst case: the one output rounding dominates). The interpreter's ``tl.dot`` of bf16 operands is wrong (it
multiplies numpy's stand-in integers), so bf16 inputs run their dot in float32 here: the same exact products as the
GPU's bf16 MMA, accumulated in float32.
"""
import sys

import torch
import triton.language as tl

import fp8tensor.numerics.quantize as quantize_mod
from fp8tensor import kernels
from fp8tensor.quantize import quantize

_launch = kernels._launch


def _launch_bf16_dot_in_fp32(fn, grid, args, consts, *a, **k):
    if consts.get("X_TY") is tl.bfloat16:
        consts = dict(consts, X_TY=tl.float32)
    return _launch(fn, grid, args, consts, *a, **k)


kernels._launch = _launch_bf16_dot_in_fp32


def _bound(x, wd, b, dtype):
    K = x.shape[1]
    u = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-11  # (the interpreter's float32 -> bf16 cast truncates)
    n_eps = (K + 2) * 2.0**-24
    gamma = n_eps / (1 - n_eps)
    ref = x.double() @ wd.t() + (0 if b is None else b.double())
    mag = x.double().abs() @ wd.abs().t() + (0 if b is None else b.double().abs())
    return ref, (u * ref.norm() + (1 + u) * gamma * mag.norm()) / ref.norm(), u


def _check(seed, M, N, K, dtype, bias, tiles=None):
    x = torch.randn(M, K).to(dtype)
    w = torch.randn(N, K) * torch.logspace(-2, 1, N)[:, None]
    q, s = quantize(w, -1)
    b = (torch.randn(N) * 4).to(dtype) if bias else None
    plan = kernels._w8_mm_plan(M, N, K, x.device, tiles)
    out = kernels.launch_w8_mm(x, q, s, b, tiles=tiles)
    case = (seed, M, N, K, dtype, bias, "split", plan[3])
    assert out.shape == (M, N) and out.dtype == dtype, case
    assert torch.equal(kernels.launch_w8_mm(x, q, s, b, tiles=tiles), out), case  # fixed summation order
    # eager outside capture: one launch adding the slices itself; the split's two launches give the same bits
    assert torch.equal(kernels.launch_w8_mm(x, q, s, b, tiles=tiles, one_launch=False), out), case
    if M == 0:
        return plan[3]
    ref, bound, u = _bound(x, q.double() * s.double(), b, dtype)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err <= bound, (case, err, bound)
    # the worst-case float32 term is loose at large K; in fact the one output rounding dominates (a kernel
    # rounding its partial sums to the output dtype, or dropping a slice, fails this)
    assert err <= 1.05 * u, (case, err, u)
    return plan[3]


def _check_fp8_x(seed, M, N, K, dtype, bias, tiles=None):
    """An fp8 ``x`` with row scales: the dot fp8 x fp8, each row's partial sums times its scale (the products of
    two e4m3 values are exact in float32, so the bound of :func:`_bound` holds for the dequantized operands)."""
    xq, xs = quantize(torch.randn(M, K) * torch.logspace(-1, 1, M)[:, None], -1)
    w = torch.randn(N, K) * torch.logspace(-2, 1, N)[:, None]
    q, s = quantize(w, -1)
    b = (torch.randn(N) * 4).to(dtype) if bias else None
    plan = kernels._w8_mm_plan(M, N, K, xq.device, tiles)
    out = kernels.launch_w8_mm(xq, q, s, b, tiles=tiles, x_scale=xs, out_dtype=dtype)
    case = (seed, M, N, K, dtype, bias, "fp8 x", "split", plan[3])
    assert out.shape == (M, N) and out.dtype == dtype, case
    assert torch.equal(kernels.launch_w8_mm(xq, q, s, b, tiles=tiles, x_scale=xs, out_dtype=dtype), out), case
    assert torch.equal(kernels.launch_w8_mm(xq, q, s, b, tiles=tiles, x_scale=xs, out_dtype=dtype,
                                            one_launch=False), out), case
    if plan[3] > 1:  # the partial sums alone (unscaled): summed, scaled and biased as the reduce does
        parts = kernels.launch_w8_mm_partials(xq, q, tiles=tiles)
        assert parts.shape == (plan[3], M, N) and parts.dtype == torch.float32, case
        acc = parts[0]
        for p in parts[1:]:
            acc = acc + p
        acc = acc * xs * s.reshape(1, -1) + (0 if b is None else b.float())
        if dtype == torch.float16:  # (bf16: the interpreter's cast truncates, torch's rounds)
            assert torch.equal(acc.to(dtype), out), case
        else:
            assert ((acc.to(dtype).double() - out.double()).abs() <= out.double().abs() * 2.0**-7).all(), case
    ref, bound, u = _bound(xq.double() * xs.double(), q.double() * s.double(), b, dtype)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err <= bound and err <= 1.05 * u, (case, err, bound, u)
    return plan[3]


def main():
    seed = int(sys.argv[1])
    torch.manual_seed(seed)
    splits = set()
    many = dict(kernels.W8_MM_CONFIG["tiles"][16], programs_per_sm=64, min_k_tiles=1)  # as many slices as K tiles
    gemv_many = dict(block_n=16, block_k=128, warps=4, stages=1, programs_per_sm=64, min_k_tiles=1, gemv=True)
    for dtype in (torch.bfloat16, torch.float16):
        for M, N, K, bias, tiles in [
            (1, 5, 1000, True, many),       # one column tile, 8 slices, the last one short
            (1, 70, 4096, False, None),     # the table's plan
            (3, 33, 300, True, many),       # 2 full slices and a partial one, uneven N
            (17, 5, 130, False, many),      # two slices, the second of 2 columns
            (32, 65, 517, True, None),
            (40, 9, 260, True, dict(kernels.W8_MM_CONFIG["tiles"][64], programs_per_sm=8, min_k_tiles=1)),
            (100, 7, 200, False, dict(kernels.W8_MM_CONFIG["tiles"][128], programs_per_sm=8, min_k_tiles=1)),
            (0, 5, 64, True, many),         # no rows: an empty output, nothing launched
            (2, 3, 16, True, many),         # one slice (K within one tile): the direct store
            (5, 70, 700, True, dict(many, swap_ab=True)),   # the weight tile on the MMA's row side
            (40, 9, 260, False, dict(kernels.W8_MM_CONFIG["tiles"][64], programs_per_sm=8, min_k_tiles=1,
                                     swap_ab=True)),
            (3, 20, 16, False, dict(many, swap_ab=True)),
            (1, 37, 1000, True, dict(gemv_many)),     # no MMA (gemv): one row, K split, the last slice short
            (1, 9, 40, True, dict(gemv_many, block_k=64)),  # one slice: the direct store
            (1, 70, 4096, True, dict(kernels.W8_MM_CONFIG["tiles"][1], programs_per_sm=64)),  # the table's gemv tile
        ]:
            splits.add(_check(seed, M, N, K, dtype, bias, tiles))
    assert {1, 2, 3, 8} <= splits, splits
    try:  # a gemv tile takes one row
        kernels.launch_w8_mm(torch.randn(2, 64, dtype=torch.bfloat16), *quantize(torch.randn(8, 64), -1), None,
                             tiles=gemv_many)
    except ValueError as e:
        assert "takes one row" in str(e), e
    else:
        raise AssertionError("a gemv tile took two rows")
    splits = set()
    for dtype in (torch.bfloat16, torch.float16):
        for M, N, K, bias, tiles in [
            (1, 5, 1000, True, many),
            (3, 33, 300, False, many),
            (40, 9, 260, True, dict(kernels.W8_MM_CONFIG["tiles"][64], programs_per_sm=8, min_k_tiles=1)),
            (64, 70, 4096, False, None),
            (100, 7, 200, True, dict(kernels.W8_MM_CONFIG["tiles"][128], programs_per_sm=8, min_k_tiles=1)),
            (40, 9, 260, False, dict(kernels.W8_MM_CONFIG["tiles"][64], programs_per_sm=8, min_k_tiles=1,
                                     swap_ab=True)),
            (33, 70, 300, True, dict(many, swap_ab=True)),
            (1, 21, 700, True, dict(gemv_many)),
        ]:
            splits.add(_check_fp8_x(seed, M, N, K, dtype, bias, tiles))
    assert len(splits) >= 2, splits
    xq, xs = quantize(torch.randn(2, 256), -1)
    wq, ws = quantize(torch.randn(6, 256), -1)
    for bad in (dict(), dict(x_scale=xs.t()), dict(x_scale=xs, out_dtype=torch.float32),
                dict(x_scale=xs.double())):
        try:
            kernels.launch_w8_mm(xq, wq, ws, None, **bad)
        except ValueError as e:
            assert "an fp8 x" in str(e), e
        else:
            raise AssertionError(f"launch_w8_mm took an fp8 x with {bad}")
    try:
        kernels.launch_w8_mm(torch.randn(2, 256, dtype=torch.bfloat16), wq, ws, None, x_scale=xs)
    except ValueError as e:
        assert "x_scale is for an fp8 x" in str(e), e
    else:
        raise AssertionError("launch_w8_mm took x_scale with a bf16 x")
    x = torch.randn(2, 256, dtype=torch.float16)
    q, s = quantize(torch.randn(6, 256), -1)
    b = torch.randn(6, dtype=torch.float16)
    try:
        kernels.launch_w8_mm(torch.randn(129, 256, dtype=torch.float16), q, s, b)
    except ValueError as e:
        assert "tiles for at most 128" in str(e)
    else:
        raise AssertionError("129 rows were accepted")
    assert quantize_mod.weight_only_mm(x, q, s, b) is None  # CPU: the Linear's dispatch does not take the kernel
    # a contiguous (..., K) x: its rows as they are (no reshape), the output (..., N), bits of the 2-D call
    x3 = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    many = dict(kernels.W8_MM_CONFIG["tiles"][16], programs_per_sm=64, min_k_tiles=1)
    out3 = kernels.launch_w8_mm(x3, q, s, b.to(torch.bfloat16), tiles=many)
    assert out3.shape == (2, 3, 6), out3.shape
    assert torch.equal(out3, kernels.launch_w8_mm(x3.reshape(6, 256), q, s, b.to(torch.bfloat16), tiles=many).view(2, 3, 6))
    try:
        kernels.launch_w8_mm(x3.transpose(0, 1), q, s, None)
    except ValueError as e:
        assert "contiguous" in str(e), e
    else:
        raise AssertionError("a non-contiguous 3-D x was accepted")
    # the eager plan memo (by x's shape): a hit gives the first call's bits, reads a 2-D x's row stride per call
    # and still refuses a non-contiguous (..., K) x of the memoized shape
    bb = b.to(torch.bfloat16)
    first = kernels.launch_w8_mm(x3, q, s, bb)
    assert torch.equal(kernels.launch_w8_mm(x3, q, s, bb), first)
    try:
        kernels.launch_w8_mm(torch.randn(3, 2, 256, dtype=torch.bfloat16).transpose(0, 1), q, s, bb)
    except ValueError as e:
        assert "contiguous" in str(e), e
    else:
        raise AssertionError("a non-contiguous 3-D x of a memoized shape was accepted")
    wide = torch.randn(2, 512, dtype=torch.bfloat16)
    dense = kernels.launch_w8_mm(wide[:, :256].contiguous(), q, s, bb)
    assert torch.equal(kernels.launch_w8_mm(wide[:, :256], q, s, bb), dense)
    _check_partials(seed)
    print("ok")


def _check_partials(seed):
    """The K split's float32 partial sums (``launch_w8_mm_partials``; the traced decode GEMM sums them in the graph):
    one slice per K slice of the plan, each the product over its slice (exact products, float32 sums: within
    ``gamma`` of float64), and their epilogue (``_w8_mm_epilogue``) within the bound of :func:`_bound`; an unsplit
    product and a 3-D ``x`` refused."""
    from fp8tensor.numerics.quantize import _w8_mm_epilogue

    cpu = torch.device("cpu")
    for M, N, K, dtype, bias in [(1, 5, 4096, torch.bfloat16, True), (3, 33, 4096, torch.float16, False),
                                 (2, 40, 1100, torch.bfloat16, False), (2, 40, 1100, torch.float16, True)]:
        x = torch.randn(M, K).to(dtype)
        q, s = quantize(torch.randn(N, K) * torch.logspace(-2, 1, N)[:, None], -1)
        b = (torch.randn(N) * 4).to(dtype) if bias else None
        split = kernels.w8_mm_split(M, N, K, cpu)
        k_per = kernels._w8_mm_plan(M, N, K, cpu)[4]
        case = (seed, M, N, K, dtype, bias, "split", split)
        assert split > 1, case
        p = kernels.launch_w8_mm_partials(x, q)
        assert p.shape == (split, M, N) and p.dtype == torch.float32, (case, p.shape)
        n_eps = k_per * 2.0**-24
        for i in range(split):
            ks = slice(i * k_per, min(K, (i + 1) * k_per))
            ref = x[:, ks].double() @ q[:, ks].double().t()
            mag = x[:, ks].double().abs() @ q[:, ks].double().abs().t()
            assert ((p[i].double() - ref).abs() <= n_eps / (1 - n_eps) * mag + 1e-300).all(), (case, i)
        out = _w8_mm_epilogue(p, s, b, dtype)
        assert out.shape == (M, N) and out.dtype == dtype, case
        if dtype == torch.float16:  # the reduce launch's operations in its order (bf16: the interpreter's cast truncates)
            assert torch.equal(out, kernels.launch_w8_mm(x, q, s, b)), case
        ref, bound, u = _bound(x, q.double() * s.double(), b, dtype)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err <= bound and err <= 1.05 * u, (case, err, bound, u)
    for bad, match in ((torch.randn(2, 16, dtype=torch.bfloat16), "not split over K"),
                       (torch.randn(1, 2, 1000, dtype=torch.bfloat16), "must be \\(M, K\\)")):
        q, s = quantize(torch.randn(5, bad.shape[-1]), -1)
        try:
            kernels.launch_w8_mm_partials(bad, q)
        except ValueError as e:
            assert __import__("re").search(match, str(e)), e
        else:
            raise AssertionError(f"launch_w8_mm_partials took x of shape {tuple(bad.shape)}")


if __name__ == "__main__":
    main()
