"""Row-wise quantization (fp8tensor.quantize, ScaledFp8Tensor.from_hp / to_hp) against float64.

Error bound per element, for round-to-nearest into a format with ``m`` mantissa bits and smallest normal
exponent ``emin`` (e4m3fn: m=3, emin=-6; e5m2: m=2, emin=-14), applied to ``y = x / scale``:

    |round(y) − y| ≤ 2^-(m+1) · |y| + 2^(emin−m−1)        (normal range: half an ulp; subnormals: half a step)

so ``|dequant(x) − x| ≤ 2^-(m+1)|x| + 2^(emin−m−1)·scale``, plus a few float32 roundings (x/scale, q·scale)
of 2^-24 relative each. This is the tightest bound that holds for every element; violating it means wrong
scales, wrong rounding, or a wrong reduction dim.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp8tensor import E4M3, E5M2, ScaledFp8Tensor, quantize_rowwise
from fp8tensor.quantize import amax_to_scale, cast_to_fp8

from conftest import rel_err

FMT = {  # float8 dtype -> (mantissa bits, smallest normal exponent)
    E4M3: (3, -6),
    E5M2: (2, -14),
}
HP_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# log10 of the largest magnitude a random input may have, per dtype (fp16 overflows at 65504)
MAX_LOG10 = {torch.float32: 20.0, torch.bfloat16: 20.0, torch.float16: 3.0, torch.float64: 20.0}
MIN_LOG10 = {torch.float32: -20.0, torch.bfloat16: -20.0, torch.float16: -6.0, torch.float64: -20.0}


def _assert_within_fp8_bound(x: torch.Tensor, deq: torch.Tensor, scale: torch.Tensor, float8_dtype) -> None:
    """Element-wise bound of the module docstring (x, deq, scale broadcastable; compared in float64)."""
    m, emin = FMT[float8_dtype]
    x64, d64, s64 = x.to(torch.float64), deq.to(torch.float64), scale.to(torch.float64)
    bound = (2.0 ** -(m + 1) + 4 * 2.0**-24) * x64.abs() + 2.0 ** (emin - m - 1) * s64 * (1 + 2.0**-20)
    err = (d64 - x64).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"quantization error exceeds the {float8_dtype} bound by {worst:g} (max err {err.max().item():g})"


def _random_input(draw_seed: int, shape, dtype, log10_mag: float, row_spread: float) -> torch.Tensor:
    """Gaussian (clamped at 4σ) with magnitude 10^log10_mag and per-row factors 10^U(-row_spread, row_spread)."""
    g = torch.Generator().manual_seed(draw_seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64).clamp(-4, 4)
    rows = torch.empty(*shape[:-1], 1, dtype=torch.float64).uniform_(-row_spread, row_spread, generator=g)
    return (x * 10.0**log10_mag * 10.0**rows).to(dtype)


@st.composite
def quant_cases(draw):
    dtype = draw(st.sampled_from(HP_DTYPES))
    f8 = draw(st.sampled_from([E4M3, E5M2]))
    ndim = draw(st.integers(2, 3))
    shape = tuple(draw(st.integers(1, 33)) for _ in range(ndim))
    spread = draw(st.floats(0.0, 1.0))
    lo, hi = MIN_LOG10[dtype], MAX_LOG10[dtype] - 1.0 - spread  # headroom: 4σ clamp and row factors
    mag = draw(st.floats(lo, hi))
    seed = draw(st.integers(0, 2**31 - 1))
    dim = draw(st.integers(-ndim, ndim - 1))
    return _random_input(seed, shape, dtype, mag, spread), f8, dim


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(quant_cases())
def test_quantize_rowwise_error_bound_and_scale(case):
    """quantize_rowwise over any dim: dtypes, shapes, scale layout and value, element-wise error bound."""
    x, f8, dim = case
    x_before = x.clone()
    q, s = quantize_rowwise(x, dim=dim, float8_dtype=f8)
    assert torch.equal(x, x_before)
    assert q.dtype == f8 and q.shape == x.shape
    assert s.dtype == torch.float32 and s.ndim == x.ndim
    expect_shape = list(x.shape)
    expect_shape[dim] = 1
    assert list(s.shape) == expect_shape
    assert torch.isfinite(s).all() and (s > 0).all()

    # scale = max(amax / fp8_max, 2^-126) (float64 reference; float32 rounding of amax and of the division)
    amax = x.to(torch.float64).abs().amax(dim=dim, keepdim=True)
    tiny = torch.finfo(torch.float32).tiny
    ref_scale = (amax / torch.finfo(f8).max).clamp(min=tiny)
    assert ((s.double() - ref_scale).abs() <= 2.0**-22 * ref_scale).all()

    deq = q.to(torch.float64) * s.to(torch.float64)
    _assert_within_fp8_bound(x, deq, s, f8)

    # the largest element of every (non-floored) row lands on the top of the fp8 range
    qmax = q.to(torch.float32).abs().amax(dim=dim, keepdim=True)
    big = amax > torch.finfo(f8).max * tiny * 2
    assert torch.equal(qmax[big], torch.full_like(qmax[big], torch.finfo(f8).max))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(quant_cases())
def test_from_hp_to_hp_error_bound(case):
    """ScaledFp8Tensor.from_hp scales the last dim; to_hp(float32) is within the element-wise bound."""
    x, f8, _ = case
    t = ScaledFp8Tensor.from_hp(x, f8)
    assert type(t) is ScaledFp8Tensor and t.dtype == x.dtype and t.shape == x.shape
    assert t.qdata.dtype == f8 and t.float8_dtype == f8
    assert tuple(t.scale.shape) == (*x.shape[:-1], 1)
    assert not t.requires_grad
    _assert_within_fp8_bound(x, t.to_hp(torch.float32), t.scale, f8)
    # to_hp() returns the original dtype: the float32 value rounded once to it
    assert t.to_hp().dtype == x.dtype
    assert torch.equal(t.to_hp(), t.to_hp(torch.float32).to(x.dtype))


@pytest.mark.parametrize("f8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_gaussian_rms_error_matches_format_precision(f8):
    """On Gaussian rows the relative RMS error sits near the format's 2^-(m+1)/√3 level (not just under the max)."""
    m, _ = FMT[f8]
    x = torch.randn(256, 512)
    t = ScaledFp8Tensor.from_hp(x, f8)
    err = rel_err(t.to_hp(torch.float32), x)
    typical = 2.0 ** -(m + 1) / math.sqrt(3)
    assert 0.5 * typical < err < 1.5 * typical, (err, typical)


@pytest.mark.parametrize("f8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_zero_row_quantizes_to_zeros_with_finite_scale(f8, dtype):
    x = torch.randn(6, 40).to(dtype)
    x[2] = 0
    x[:, 0] = 0  # a zero column must not matter
    t = ScaledFp8Tensor.from_hp(x, f8)
    assert torch.isfinite(t.scale).all() and (t.scale > 0).all()
    assert t.qdata[2].to(torch.float32).eq(0).all()
    deq = t.to_hp()
    assert torch.equal(deq[2], torch.zeros_like(deq[2]))
    assert not torch.signbit(deq[2]).any()
    # the other rows do not see the zero row (row-wise scales)
    others = [0, 1, 3, 4, 5]
    alone = ScaledFp8Tensor.from_hp(x[others], f8)
    assert torch.equal(t.to_hp()[others], alone.to_hp())


@pytest.mark.parametrize("f8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_row_stays_non_finite_and_others_untouched(f8, bad):
    """The per-step quantization (no host check) poisons the row visibly; ``from_hp`` (conversion time) raises
    naming it."""
    x = torch.randn(5, 32)
    clean = x.clone()
    x[1, 7] = bad
    q, s = quantize_rowwise(x, dim=-1, float8_dtype=f8)
    deq = q.float() * s
    assert not torch.isfinite(deq[1]).any(), deq[1]  # the whole row is poisoned, visibly
    rows = [0, 2, 3, 4]
    ref = ScaledFp8Tensor.from_hp(clean, f8).to_hp()
    assert torch.equal(deq[rows], ref[rows])
    assert torch.isfinite(s[rows]).all()
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        ScaledFp8Tensor.from_hp(x, f8)


def test_fp16_tiny_input_gives_finite_scales_and_correct_values():
    """fp16 input with max|x| ~ 1e-6 (fp16 subnormals): the scale is computed in float32 and stays finite."""
    x = (torch.randn(16, 64) * 2.5e-7).clamp(-1e-6, 1e-6).half()
    x[3, 5] = 1e-6
    assert x.abs().max().item() < 2e-6
    t = ScaledFp8Tensor.from_hp(x)
    assert torch.isfinite(t.scale).all() and (t.scale > 0).all()
    assert t.scale.dtype == torch.float32
    deq = t.to_hp(torch.float32)
    assert torch.isfinite(deq).all()
    _assert_within_fp8_bound(x, deq, t.scale, E4M3)
    assert rel_err(deq, x) < 2.0**-4


@pytest.mark.parametrize("f8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_cast_saturates_instead_of_overflowing(f8):
    """Values beyond the fp8 range (scale too small for them) clamp to ±max, never become NaN/inf."""
    fmax = torch.finfo(f8).max
    x = torch.tensor([[3.0 * fmax, -5.0 * fmax, 0.5, float("nan")]])
    q = cast_to_fp8(x, torch.ones(1, 1), f8)
    v = q.to(torch.float32)
    assert v[0, 0].item() == fmax and v[0, 1].item() == -fmax and v[0, 2].item() == 0.5
    assert v[0, 3].isnan()


def test_amax_to_scale_floor_and_nan():
    """Floor at float32's smallest normal (zero rows, rows below 448 * 2^-126); tiny rows above it are not
    clamped (1e-30 gets 1e-30 / 448); NaN / inf propagate."""
    tiny = torch.finfo(torch.float32).tiny
    amax = torch.tensor([0.0, 1e-30, 448.0, float("nan"), float("inf"), 1e-40, 448 * tiny], dtype=torch.float64)
    s = amax_to_scale(amax, E4M3)
    assert s.dtype == torch.float32
    assert s[0].item() == tiny and s[5].item() == tiny
    assert s[1].item() == (torch.tensor(1e-30, dtype=torch.float32) / 448.0).item()
    assert s[2].item() == 1.0 and s[6].item() == tiny
    assert s[3].isnan() and s[4].isinf()


@pytest.mark.parametrize("f8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_exactly_representable_rows_round_trip_exactly(f8):
    """A row that is fp8 values times a power of two (and holds ±max) must come back bit-exact."""
    fmax = torch.finfo(f8).max
    vals = torch.randn(8, 48).to(f8).to(torch.float32)
    vals[:, 0] = fmax
    x = vals * (2.0 ** torch.randint(-20, 20, (8, 1)).float())  # amax = fmax·2^k, so scale = 2^k exactly
    t = ScaledFp8Tensor.from_hp(x, f8)
    assert torch.equal(t.to_hp(), x)


def test_token_layouts_op_off_cuda_is_the_two_quantizations():
    """``fp8tensor::quantize_both`` off CUDA (no kernels): ``quantize`` per row and ``quantize_dim0_t`` per column."""
    from fp8tensor.quantize import quantize, quantize_dim0_t, quantize_token_layouts

    x = torch.randn(3, 5, 24) * 10
    assert quantize_token_layouts(x) is None  # the Linear then quantizes as before
    q, s, qt, st = torch.ops.fp8tensor.quantize_both(x, torch.float8_e4m3fn)
    rq, rs = quantize(x.reshape(15, 24), -1)
    tq, ts = quantize_dim0_t(x, torch.float8_e4m3fn)
    for a, b in ((q, rq), (s, rs), (qt, tq), (st, ts)):
        assert a.shape == b.shape and torch.equal(a.float(), b.float())
    with pytest.raises(TypeError, match="quantize_token_layouts: unsupported float8 dtype"):
        quantize_token_layouts(x, torch.bfloat16)  # (on CUDA the kernels would write bf16 "fp8" values)


@pytest.mark.parametrize("shape", [(1, 65535 * 128), (1, 65535 * 128 + 1), (255, 8_421_504), (65535 * 128, 1),
                                   (65535 * 128 + 1, 1), (65535 * 256, 1), (65535 * 256 + 1, 1), (2, 3, 40)])
@pytest.mark.parametrize("family", ["dim0", "both"])
def test_dim0_and_two_layout_kernels_take_only_what_their_grids_can_launch(monkeypatch, shape, family):
    """For every x ``kernel_available`` (the dim-0 kernels) or ``both_kernels_available`` (the two-layout kernels)
    takes, that family's launches (amax, cast) stay within CUDA's grid (dim 0 below 2^31, dims 1 and 2 at most 65535):
    checked on a fake CUDA tensor (no GPU), the launches recorded instead of run on a meta tensor of its shape. Each
    family takes the rows its own grid allows (the dim-0 kernels 65535 x 256)."""
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp8tensor.numerics import kernels
    from fp8tensor.quantize import SCALE_FLOOR

    available, launch = {"dim0": (kernels.kernel_available, kernels.launch_dim0_t),
                         "both": (kernels.both_kernels_available, kernels.launch_both)}[family]
    grids = []
    monkeypatch.setattr(kernels, "_launch", lambda fn, grid, *a, **k: grids.append((fn.__name__, grid)))
    with FakeTensorMode():
        taken = available(torch.empty(shape, dtype=torch.bfloat16, device="cuda"))
    if family == "dim0" and shape == (65535 * 256, 1):
        assert taken  # (not limited by the two-layout kernels' grid)
    if not taken:
        return
    x = torch.empty(shape, dtype=torch.bfloat16, device="meta")  # (the launchers' shapes and slices, no data)
    launch(x, E4M3, SCALE_FLOOR)
    assert len(grids) == 2
    for name, grid in grids:
        assert grid[0] < 2**31 and all(g <= 65535 for g in grid[1:]), (name, grid)


def test_two_layout_op_adds_no_guard_on_a_symbolic_token_count(monkeypatch):
    """Traced with a symbolic token count (``torch.compile(dynamic=True)``), ``fp8tensor::quantize_both`` launches
    its amax kernel with the fixed rows per program (the size heuristic needs the concrete count) and installs no
    guard on the count, so a graph is not recompiled when the count changes; checked by ``make_fx`` on meta."""
    pytest.importorskip("triton")
    from torch.fx.experimental.proxy_tensor import make_fx

    import fp8tensor.quantize  # noqa: F401  (registers the op)
    from fp8tensor.numerics import kernels

    monkeypatch.setattr(kernels, "both_kernels_available", lambda x: True)
    launched = []
    launch = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda fn, grid, args, consts, *a, **k: (
        launched.append((fn.__name__, dict(consts))), launch(fn, grid, args, consts, *a, **k))[1])
    g = make_fx(lambda x: torch.ops.fp8tensor.quantize_both(x, E4M3), tracing_mode="symbolic")(
        torch.empty(5000, 4096, device="meta", dtype=torch.bfloat16))
    assert launched[0] == ("_amax_both_kernel", dict(CHUNK_M=kernels.BOTH_CONFIG["amax_chunk_m"],
                                                      BLOCK_M=kernels.BOTH_CONFIG["amax_block_m"],
                                                      BLOCK_K=kernels.BOTH_CONFIG["amax_block_k"]))
    x_val = next(n.meta["val"] for n in g.graph.nodes if n.op == "placeholder")
    assert not x_val.shape[0].node.shape_env.guards, [str(gd.expr) for gd in x_val.shape[0].node.shape_env.guards]


def test_dim0_kernels_decline_outputs_past_32bit_offsets():
    """A 2-D ``x`` whose rows overlap (stride 0: the ``grad_out`` of a sum over the tokens) spans few elements, but its
    fp8 outputs hold ``M * K``: at ``2^31`` or more the transposing cast's 32-bit store offsets would wrap, so
    ``kernel_available`` declines it (plain ops instead); checked on fake CUDA tensors (no GPU)."""
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp8tensor.numerics import kernels

    with FakeTensorMode():
        row = torch.empty(1, 2048, dtype=torch.bfloat16, device="cuda")
        assert kernels.kernel_available(row.expand(2**20 - 1, 2048))
        assert not kernels.kernel_available(row.expand(2**20 + 1, 2048))


def test_dim0_and_row_kernels_under_the_triton_interpreter():
    # The Triton kernels of the CUDA paths run by Triton's interpreter on CPU (tests/_kernels_interp.py): the dim-0
    # pair (column amax, transposing cast) and the row-wise kernel with folded column multipliers
    # give the plain ops' scales exactly and their fp8 values within the interpreter's cast.
    from conftest import run_under_triton_interpreter

    run_under_triton_interpreter("_kernels_interp.py")


def test_row_kernel_reads_rows_up_to_its_limit_once():
    """The row-wise kernel's plan per row width: whole rows in one tile (read once) up to ``one_tile_max_k``
    elements, ``one_tile_elems`` elements (or one row) and at most ``one_tile_rows`` rows per program; wider rows
    in ``block_k`` tiles read twice."""
    from fp8tensor import kernels

    c = kernels.ROW_CONFIG
    for K in (1, 70, 128, 1000, 1024, 2048, 5000, c["one_tile_max_k"]):
        bm, bk, warps, one_tile = kernels._row_plan(K)
        assert one_tile and bk >= K and bk == 1 << (bk.bit_length() - 1) and bk < 2 * max(K, 16), K
        assert 1 <= bm <= c["one_tile_rows"] and (bm == 1 or bm * bk <= c["one_tile_elems"]), K
        assert warps == c["one_tile_warps"], K
    assert kernels._row_plan(2048)[:2] == (c["one_tile_elems"] // 2048, 2048)
    assert kernels._row_plan(c["one_tile_max_k"] + 1) == (c["block_m"], c["block_k"], c["warps"], False)


def test_decode_op_traced_takes_every_shape_its_eager_launch_takes():
    """``torch.ops.fp8tensor.w8_mm`` traced (fake tensors: its body as AOTAutograd traces it, the K split summed in the
    graph) takes 0 rows and 0 output features as the eager launch does (empty outputs), and refuses more rows than
    the largest row block with the launch's error; split and unsplit products give ``(M, N)`` in ``x``'s dtype."""
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp8tensor import kernels

    with FakeTensorMode():
        for M, N, K, dtype in ((0, 64, 4096, torch.bfloat16), (1, 0, 4096, torch.bfloat16),
                               (1, 16, 4096, torch.bfloat16), (2, 64, 4096, torch.bfloat16),
                               (3, 33, 1000, torch.float16), (2, 5, 16, torch.bfloat16)):
            x = torch.empty(M, K, dtype=dtype)
            w8 = torch.empty(N, K, dtype=torch.float8_e4m3fn)
            out = torch.ops.fp8tensor.w8_mm(x, w8, torch.empty(N, 1), None)
            assert out.shape == (M, N) and out.dtype == dtype, (M, N, K)
        assert kernels.w8_mm_split(1, 16, 4096, torch.device("cpu")) > 1  # (the partials path was taken above)
        assert kernels.w8_mm_split(2, 64, 4096, torch.device("cpu")) > 1
        assert kernels.w8_mm_split(2, 5, 16, torch.device("cpu")) == 1
        with pytest.raises(ValueError, match="tiles for at most"):
            torch.ops.fp8tensor.w8_mm(torch.empty(kernels.W8_MAX_M + 1, 64, dtype=torch.bfloat16),
                                      torch.empty(8, 64, dtype=torch.float8_e4m3fn), torch.empty(8, 1), None)


def test_decode_gemm_under_the_triton_interpreter():
    # The small-M fp8-weight GEMM (decode) run by Triton's interpreter on CPU (tests/_w8_mm_interp.py): within the
    # float64 reference's bound from the output's one rounding; M = 0 to 100 (every row block), odd N and K, bias,
    # bf16 / fp16, 1 to 8 slices of K; more rows than the largest row block refused.
    from conftest import run_under_triton_interpreter

    run_under_triton_interpreter("_w8_mm_interp.py")


@pytest.mark.parametrize("x_fp8", [False, True])
@pytest.mark.parametrize("split", [1, 3])
def test_traced_decode_gemm_launches_name_every_kernel_parameter(monkeypatch, x_fp8, split):
    # Under torch.compile the decode GEMM's launches go through wrap_triton, and inductor (torch 2.11) launches a user
    # kernel with exactly the arguments it was given: a parameter left to its default (X_FP8, say) made the
    # compiled call fail ("launcher() missing 2 required positional arguments"). Every traced launch names all of
    # its kernel's parameters; the eager launcher fills defaults itself.
    pytest.importorskip("triton")
    from fp8tensor import kernels

    if not kernels._HAS_TRITON:
        pytest.skip("needs Triton")
    launches = []
    monkeypatch.setattr(kernels, "_launch", lambda fn, grid, args, consts, *a, **k: launches.append(
        (fn, len(args), dict(consts), args, k.get("traced"))))
    from fp8tensor.quantize import quantize

    M, N, K = 5, 48, 384
    w8, s = quantize(torch.randn(N, K), -1)
    if x_fp8:
        x, xs = quantize(torch.randn(M, K), -1)
    else:
        x, xs = torch.randn(M, K, dtype=torch.bfloat16), None
    tiles = dict(kernels.W8_MM_CONFIG["tiles"][16], min_k_tiles=1)
    tiles["programs_per_sm"] = 10**6 if split > 1 else 1  # (the CPU plan sees one SM)
    kernels.launch_w8_mm(x, w8, s, torch.randn(N, dtype=torch.bfloat16), traced=True, tiles=tiles, x_scale=xs)
    assert [t for *_, t in launches] == [True] * len(launches) and len(launches) == (1 if split == 1 else 2)
    for fn, n_args, consts, _, _ in launches:
        names = [p.name for p in fn.params]
        assert set(names[:n_args]).isdisjoint(consts) and set(names[n_args:]) == set(consts), (names, consts)
    if x_fp8:  # (x's row scales: a positional argument of the GEMM and of the reduce kernel)
        assert launches[0][2]["X_FP8"] is True
        for fn, _, _, args, _ in launches:
            assert args[[p.name for p in fn.params].index("xs_ptr")] is xs


@pytest.mark.parametrize("shape", [(5, 3), (0, 4), (3, 7, 2), (2, 0, 5), (4, 1, 1)])
def test_transpose_after_is_the_transposed_copy(shape):
    # grad_input's fp8 weight layout, one weight (N, K) or expert weights (E, N, K): eager, the op, and traced
    # (plain ops reading a dependency on `after`, NaN there included) give the transposed bytes in a fresh buffer
    from fp8tensor.quantize import transpose_after

    q = (torch.randn(*shape) * 30).to(E4M3)
    after = torch.tensor([[float("nan"), 1.0]])
    ref = q.transpose(-2, -1).contiguous().view(torch.uint8)
    compiled = torch.compile(transpose_after, backend="aot_eager", fullgraph=True)
    for got in (transpose_after(q, after), torch.ops.fp8tensor.transpose_after(q, after), compiled(q, after)):
        assert got.shape == ref.shape and got.dtype == E4M3 and got.is_contiguous()
        assert torch.equal(got.view(torch.uint8), ref)
        assert got.numel() == 0 or got.data_ptr() != q.data_ptr()
