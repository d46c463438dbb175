"""fp8 grouped GEMMs of expert weights (fp8tensor.grouped) against float64 references.

Bounds: e4m3 keeps 3 mantissa bits, so one rounding has a relative error of at most 2^-4 and, spread uniformly, an
RMS of at most U = 2^-4 / sqrt(3). A GEMM of two independently rounded operands has a relative RMS error of at most
sqrt(2) * U (the two errors add in quadrature); every check compares ``||out - ref|| / ||ref||`` with that bound.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fp8tensor
from fp8tensor import Fp8MasterWeight, ScaledFp8Tensor, convert_to_fp8
from fp8tensor.grouped import fp8_grouped_mm, padded_offsets, quantize_expert_cols, quantize_group_cols
from fp8tensor.quantize import quantize_rowwise

from conftest import E4M3_GEMM_BOUND

U = 2.0**-4 / math.sqrt(3)
TWO = math.sqrt(2) * U  # two rounded operands

E, K, N = 4, 32, 48


def _offs(sizes):
    return torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)


def _ref(x, w, offs):
    """float64 reference: out[rows of e] = x[rows of e] @ w[e]^T."""
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end].double() @ w[e].double().t()
        start = end
    return out


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _run(x, w_param, offs, recipe, g):
    x = x.clone().requires_grad_()
    y = torch._grouped_mm(x, w_param.transpose(-2, -1), offs=offs)
    y.backward(g)
    return y, x.grad, w_param.grad


# uneven groups, an empty group, totals that are not a multiple of 16 (and groups of 1 token)
SIZES = [[13, 0, 29, 5], [0, 0, 40, 1], [16, 16, 32, 16], [1, 7, 0, 19]]


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp"])
@pytest.mark.parametrize("sizes", SIZES)
def test_master_forward_and_gradients_match_float64(recipe, sizes):
    offs = _offs(sizes)
    M = int(offs[-1])
    x = torch.randn(M, K)
    w = torch.randn(E, N, K)
    g = torch.randn(M, N)
    wp = nn.Parameter(Fp8MasterWeight(w.clone(), recipe))
    y, gx, gw = _run(x, wp, offs, recipe, g)
    assert y.grad_fn.name() == "_Fp8GroupedMMBackward"
    assert _rel(y, _ref(x, w, offs)) <= TWO
    assert 1e-3 < _rel(y, _ref(x, w, offs))  # fp8 rounding is there (not a high-precision GEMM)
    # grad_input: gy[e] @ w[e]
    gx_ref = _ref(g, w.transpose(-2, -1), offs)
    assert _rel(gx, gx_ref) <= TWO
    # grad_weight per expert: gy[e]^T @ x[e]; experts with no tokens get exact zeros
    start = 0
    for e, end in enumerate(offs.tolist()):
        ref = g[start:end].double().t() @ x[start:end].double()
        if end == start:
            assert torch.equal(gw[e], torch.zeros_like(gw[e]))
        elif recipe == "rowwise":
            assert _rel(gw[e], ref) <= TWO
        else:
            assert _rel(gw[e], ref) <= 1e-6  # high precision (float32)
        start = end


def test_cpu_path_is_the_quantized_operands_product():
    # The per-group emulation computes exactly the GEMM of the quantized operands (float32 accumulation).
    offs = _offs([9, 0, 22, 3])
    x, w = torch.randn(34, K), torch.randn(E, N, K)
    y = fp8_grouped_mm(x, w.transpose(-2, -1), offs)
    xq, xs = quantize_rowwise(x, -1)
    wq, ws = quantize_rowwise(w, -1)
    ref = _ref(xq.double() * xs.double(), wq.double() * ws.double(), offs)
    assert _rel(y, ref) <= 1e-6


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp"])
def test_cpu_groups_take_the_gemm_backend_where_row_scales_do_not_run(monkeypatch, recipe):
    """torch 2.11's CPU ``torch._scaled_mm`` takes tensor-wise scales only (an INTERNAL ASSERT for row-wise ones):
    the per-group GEMMs go through the GEMM engine's backend choice, as the Linear's do, and stay within fp8
    bounds (forward, grad_input, grad_weight). Simulated here on any torch by a ``_scaled_mm`` refusing row scales."""
    from fp8tensor import gemm

    orig = torch._scaled_mm

    def tensorwise_only(a, b, scale_a, scale_b, *args, **kwargs):
        if a.device.type == "cpu" and (scale_a.numel() != 1 or scale_b.numel() != 1):
            raise RuntimeError("(scale_a.numel() == 1 && scale_b.numel() == 1) INTERNAL ASSERT FAILED")
        return orig(a, b, scale_a, scale_b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", tensorwise_only)
    gemm._cpu_scaled_mm_works.cache_clear()  # the backend is probed with the patched op (and again after)
    gemm.choose_backend.cache_clear()
    try:
        offs = _offs([13, 0, 29, 5])
        M = int(offs[-1])
        x, w, g = torch.randn(M, K), torch.randn(E, N, K), torch.randn(M, N)
        wp = nn.Parameter(Fp8MasterWeight(w.clone(), recipe))
        y, gx, gw = _run(x, wp, offs, recipe, g)
        assert _rel(y, _ref(x, w, offs)) <= TWO
        assert _rel(gx, _ref(g, w.transpose(-2, -1), offs)) <= TWO
        start = 0
        for e, end in enumerate(offs.tolist()):
            if end > start:
                assert _rel(gw[e], g[start:end].double().t() @ x[start:end].double()) <= TWO
            start = end
        ws = ScaledFp8Tensor.from_hp(w)  # an fp8-stored weight (quantize_weights), its grouped GEMM in the op table
        assert _rel(torch._grouped_mm(x, ws.transpose(-2, -1), offs=offs), _ref(x, w, offs)) <= TWO
    finally:
        gemm._cpu_scaled_mm_works.cache_clear()
        gemm.choose_backend.cache_clear()


def test_group_cols_layout_and_scales():
    offs = _offs([5, 0, 18, 1])
    M = 30  # two rows past the last group
    x = torch.randn(M, 24)
    M_pad, pad_ends, pad_starts = padded_offsets(offs, M)
    assert pad_ends.tolist() == [16, 32, 64, 80] and pad_starts.tolist() == [0, 16, 32, 64]  # empty group: 16 zeros
    assert M_pad % 16 == 0 and M_pad >= int(pad_ends[-1]) + 16
    q, s = quantize_group_cols(x, offs, M_pad, pad_starts)
    assert q.shape == (24, M_pad) and s.shape == (E, 24)
    start = 0
    for e, end in enumerate(offs.tolist()):
        ps, pe = int(pad_starts[e]), int(pad_ends[e])
        block = q[:, ps:pe].float()
        assert torch.equal(block[:, end - start:], torch.zeros_like(block[:, end - start:]))  # padding
        if end > start:
            amax = x[start:end].abs().amax(0)
            torch.testing.assert_close(s[e], amax / 448.0, rtol=0, atol=0)
            deq = block[:, : end - start] * s[e][:, None]
            assert _rel(deq.t(), x[start:end]) <= U
        start = end
    assert torch.equal(q[:, int(pad_ends[-1]):].float(), torch.zeros(24, M_pad - int(pad_ends[-1])))


def test_expert_cols():
    w = torch.randn(3, 40, 16)
    q, s = quantize_expert_cols(w)
    assert q.shape == (3, 16, 40) and s.shape == (3, 16)
    torch.testing.assert_close(s, w.abs().amax(1) / 448.0, rtol=0, atol=0)
    assert _rel(q.float() * s[:, :, None], w.transpose(-2, -1)) <= U


@pytest.mark.parametrize("sizes", SIZES)
def test_grad_input_of_a_master_weight_uses_the_forwards_fp8_weight(sizes):
    # A high-precision weight's grad_input GEMM takes the forward's fp8 weight (its rows re-cast with the forward's
    # row scales, those scales folded into gy): the gradient of a stored fp8 weight of the same values, bit for bit,
    # within the two-operand bound of float64.
    seed = int(torch.randint(0, 2**31, ()))
    torch.manual_seed(seed)
    offs = _offs(sizes)
    M = int(offs[-1])
    x, w, g = torch.randn(M, K), torch.randn(E, N, K) * torch.logspace(-3, 3, K), torch.randn(M, N)
    grads = []
    for b in (nn.Parameter(Fp8MasterWeight(w.clone(), "rowwise")), ScaledFp8Tensor.from_hp(w)):
        xr = x.clone().requires_grad_()
        fp8_grouped_mm(xr, b.transpose(-2, -1), offs).backward(g)
        grads.append(xr.grad)
    assert torch.equal(grads[0], grads[1]), seed
    assert _rel(grads[0], _ref(g, w.transpose(-2, -1), offs)) <= TWO, seed


def test_cast_rows_t_after():
    from fp8tensor.numerics.quantize import cast_rows_t_after, quantize

    seed = int(torch.randint(0, 2**31, ()))
    torch.manual_seed(seed)
    for shape in ((3, 40, 16), (40, 16), (2, 0, 5)):
        w = torch.randn(shape, dtype=torch.bfloat16)
        q, s = quantize(w, -1)
        qt = cast_rows_t_after(w, s.squeeze(-1), w)
        assert qt.shape == (*shape[:-2], shape[-1], shape[-2]) and qt.is_contiguous(), seed
        assert torch.equal(qt.view(torch.uint8), q.transpose(-2, -1).contiguous().view(torch.uint8)), seed
    w = torch.randn(3, 4)
    qt = cast_rows_t_after(w * 4, torch.full((3,), w.abs().max().item() / 448.0), w)  # changed after its scales
    assert torch.isfinite(qt.float()).all() and qt.float().abs().max() == 448.0
    with pytest.raises(ValueError, match="cast_rows_t_after"):
        cast_rows_t_after(w, torch.ones(4), w)
    with pytest.raises(TypeError, match="cast_rows_t_after"):
        cast_rows_t_after(w, torch.ones(3), w, torch.bfloat16)


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp"])
def test_scaled_fp8_weights(recipe):
    # from_hp of (E, N, K): scales (E, N, 1); forward uses them as stored, grad_input folds them into gy.
    offs = _offs([7, 20, 0, 11])
    M = int(offs[-1])
    x, w, g = torch.randn(M, K), torch.randn(E, N, K), torch.randn(M, N)
    w8 = ScaledFp8Tensor.from_hp(w)
    assert w8.scale.shape == (E, N, 1)
    xr = x.clone().requires_grad_()
    y = fp8_grouped_mm(xr, w8.transpose(-2, -1), offs, recipe=recipe)
    y.backward(g)
    assert _rel(y, _ref(x, w, offs)) <= TWO
    assert _rel(xr.grad, _ref(g, w.transpose(-2, -1), offs)) <= TWO
    # a module that was not converted: aten._grouped_mm on the ScaledFp8Tensor runs the fp8 forward (op table)
    y2 = torch._grouped_mm(x, w8.transpose(-2, -1), offs=offs)
    assert torch.equal(y2, y.detach())


def test_bf16_and_functional_grouped_mm():
    offs = _offs([3, 17, 12, 0])
    x, w = torch.randn(32, K), torch.randn(E, N, K)
    wp = nn.Parameter(Fp8MasterWeight(w.bfloat16()))
    xb = x.bfloat16().requires_grad_()
    y = F.grouped_mm(xb, wp.transpose(-2, -1), offs=offs)
    assert y.dtype == torch.bfloat16 and y.grad_fn.name() == "_Fp8GroupedMMBackward"
    y.float().sum().backward()
    assert wp.grad.dtype == torch.bfloat16 and xb.grad.dtype == torch.bfloat16
    assert _rel(y, _ref(x.bfloat16(), w.bfloat16(), offs)) <= TWO + 2.0**-8


@pytest.mark.parametrize("M,sizes", [(0, [0, 0, 0, 0]), (1, [0, 1, 0, 0]), (5, [0, 0, 0, 0])])
def test_empty_and_tiny_inputs(M, sizes):
    offs = _offs(sizes)
    x, w = torch.randn(M, K), torch.randn(E, N, K)
    wp = nn.Parameter(Fp8MasterWeight(w))
    xr = x.clone().requires_grad_()
    y = torch._grouped_mm(xr, wp.transpose(-2, -1), offs=offs)
    assert y.shape == (M, N)
    y.sum().backward()
    assert wp.grad.shape == w.shape and xr.grad.shape == x.shape
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end == start:
            assert torch.equal(wp.grad[e], torch.zeros(N, K))
        start = end
    if int(offs[-1]) > 0:  # one row: TWO bounds the expected RMS error; the sample RMS of one row's 48 outputs
        # spreads around it (0.67 x TWO on average, at most 1.15 x over 1500 seeds), hence 1.5 x
        assert _rel(y[: int(offs[-1])], _ref(x, w, offs)[: int(offs[-1])]) <= 1.5 * TWO
    assert torch.equal(y[int(offs[-1]):], torch.zeros(M - int(offs[-1]), N))  # rows of no group (CPU: zeros)


def test_errors_name_the_op_and_the_reason():
    x, w = torch.randn(8, K), torch.randn(E, N, K)
    b = w.transpose(-2, -1)
    with pytest.raises(TypeError, match="fp8_grouped_mm: offs must be a 1-D int32"):
        fp8_grouped_mm(x, b, torch.tensor([2, 4, 6, 8]))
    with pytest.raises(ValueError, match=r"fp8_grouped_mm: offs must be a 1-D int32 .* got shape \(4, 1\)"):
        fp8_grouped_mm(x, b, torch.tensor([[2], [4], [6], [8]], dtype=torch.int32))  # (int32, wrong rank)
    with pytest.raises(ValueError, match="offs has 3 groups but the weights have 4 experts"):
        fp8_grouped_mm(x, b, _offs([2, 2, 4]))
    with pytest.raises(ValueError, match="non-decreasing"):
        fp8_grouped_mm(x, b, torch.tensor([4, 2, 6, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"within \[0, 8\]"):
        fp8_grouped_mm(x, b, _offs([4, 2, 2, 2]))
    with pytest.raises(ValueError, match="contraction dims differ"):
        fp8_grouped_mm(torch.randn(8, K + 16), b, _offs([2, 2, 2, 2]))
    with pytest.raises(ValueError, match="2-D input"):
        fp8_grouped_mm(x, w[0], _offs([2, 2, 2, 2]))
    with pytest.raises(ValueError, match="unknown recipe"):
        fp8_grouped_mm(x, b, _offs([2, 2, 2, 2]), recipe="tensorwise")


class GroupedExperts(nn.Module):
    """A grouped-experts module as torchtitan writes it: SwiGLU experts through torch._grouped_mm."""

    def __init__(self, num_experts, dim, hidden):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden, dim) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden) / hidden**0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden, dim) / dim**0.5)

    def forward(self, x, num_tokens_per_expert):
        offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(x.bfloat16(), self.w1.bfloat16().transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(x.bfloat16(), self.w3.bfloat16().transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, self.w2.bfloat16().transpose(-2, -1), offs=offs).type_as(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32, bias=False)
        self.experts = GroupedExperts(E, 32, 64)


def test_convert_to_fp8_converts_grouped_experts_and_the_filter_excludes_them():
    m = Block()
    ref = {k: v.clone() for k, v in m.state_dict().items()}
    convert_to_fp8(m)
    assert all(isinstance(getattr(m.experts, n), Fp8MasterWeight) for n in ("w1", "w2", "w3"))
    assert type(m.experts).__name__ == "Fp8GroupedExperts" and isinstance(m.experts, GroupedExperts)
    assert isinstance(m.proj.weight, Fp8MasterWeight)  # Linears as before
    sd = m.state_dict()
    assert all(type(v) is torch.Tensor and torch.equal(v, ref[k]) for k, v in sd.items())
    counts = torch.tensor([5, 0, 21, 6])
    x = torch.randn(32, 32, requires_grad=True)
    y = m.experts(x, counts)
    y.sum().backward()
    assert all(getattr(m.experts, n).grad is not None for n in ("w1", "w2", "w3"))
    # same computation in float64 from the master weights
    offs = _offs(counts.tolist())
    w1, w2, w3 = (getattr(m.experts, n)._data.bfloat16().double() for n in ("w1", "w2", "w3"))
    xd = x.detach().bfloat16().double()
    h = F.silu(_ref(xd, w1, offs)) * _ref(xd, w3, offs)
    ref_y = _ref(h, w2, offs)
    # three chained fp8 GEMMs (and bf16 activations): each adds at most TWO in quadrature
    assert _rel(y, ref_y) <= math.sqrt(3) * TWO + 3 * 2.0**-8

    m2 = Block()
    convert_to_fp8(m2, module_filter_fn=lambda mod, fqn: fqn != "experts")
    assert type(m2.experts.w1) is nn.Parameter and type(m2.experts) is GroupedExperts
    assert isinstance(m2.proj.weight, Fp8MasterWeight)


def test_grouped_mm_on_a_plain_tensor_is_unchanged():
    offs = _offs([3, 17, 12, 0])
    x, w = torch.randn(32, K), torch.randn(E, N, K)
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    assert _rel(y, _ref(x, w, offs)) <= 1e-6


def _graph_names(t):
    seen, stack, names = set(), [t.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(fn.name())
        stack.extend(f for f, _ in fn.next_functions)
    return names


def test_torchtitan_grouped_experts_converter():
    pytest.importorskip("torchtitan")
    from torchtitan.models.common.moe import GroupedExperts

    from fp8tensor.torchtitan import Fp8TensorGroupedExperts, convert_model_config

    cfg = convert_model_config(GroupedExperts.Config(dim=32, hidden_dim=64, num_experts=E), recipe="rowwise")
    assert type(cfg) is Fp8TensorGroupedExperts.Config
    assert type(convert_model_config(GroupedExperts.Config(dim=32, hidden_dim=64, num_experts=E),
                                     filter_fqns=[""])) is GroupedExperts.Config  # filtered out
    m = cfg.build()
    assert all(isinstance(p, Fp8MasterWeight) for p in m.parameters())
    for p in m.parameters():
        nn.init.normal_(p, std=0.1)
    counts = torch.tensor([5, 0, 10, 7])
    x = torch.randn(22, 32, requires_grad=True)
    y = m(x, counts)  # torchtitan: torch._grouped_mm(x.bfloat16(), w.bfloat16().transpose(-2, -1), offs=offs)
    assert "_Fp8GroupedMMBackward" in _graph_names(y)
    y.sum().backward()
    assert m.w1_EFD.grad.shape == (E, 64, 32) and m.w2_EDF.grad.shape == (E, 32, 64)
    plain = GroupedExperts.Config(dim=32, hidden_dim=64, num_experts=E).build()
    plain.load_state_dict(m.state_dict())
    y_ref = plain(x.detach().double().float(), counts).double()
    assert _rel(y, y_ref) <= math.sqrt(3) * TWO + 3 * 2.0**-8


def test_group_col_kernel_under_the_triton_interpreter():
    # The Triton kernel of the per-group column quantization (CUDA path), run by Triton's interpreter on CPU:
    # scales, transposed padded layout and zero padding as the plain ops (tests/_group_cols_interp.py).
    from conftest import run_under_triton_interpreter

    run_under_triton_interpreter("_group_cols_interp.py")


def test_tokens_refilled_between_grouped_gemms_are_quantized_again():
    # Nothing quantized is kept between bare calls (outside Fp8GroupedMMMode(share_inputs=True)): each quantizes the
    # tokens it reads, so a refill of the token buffer through .data (no version bump) between two calls is seen by
    # the second.
    offs = _offs([3, 0, 20, 9])
    buf = torch.randn(32, K)
    w1 = nn.Parameter(Fp8MasterWeight(torch.randn(E, N, K)))
    ref_w = w1._data.double()
    ends = offs.tolist()
    for _ in range(2):
        with torch.no_grad():
            y = torch._grouped_mm(buf, w1.transpose(-2, -1), offs=offs)
        starts = [0] + ends[:-1]
        ref = torch.cat([buf[s:e].double() @ ref_w[g].t() for g, (s, e) in enumerate(zip(starts, ends))])
        assert _rel(y[:ends[-1]], ref) <= E4M3_GEMM_BOUND
        buf.data.copy_(torch.randn(32, K) * 5)


def _swiglu_experts(x, ws, offs):
    w1, w2, w3 = ws
    h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)) * torch._grouped_mm(x, w3.transpose(-2, -1),
                                                                                        offs=offs)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp"])
def test_experts_mode_quantizes_each_input_once_with_the_same_bits(recipe, monkeypatch):
    # Under Fp8GroupedMMMode (a converted experts module's forward) w1 and w3 share the tokens' quantization: the
    # row-wise fp8 in the forward, the per-group column fp8 in the backward, computed once; the outputs and every
    # gradient are the bits of the unshared calls, also over two backwards of one graph (retain_graph).
    from fp8tensor.training import grouped as GR

    seed = 3
    torch.manual_seed(seed)
    offs = _offs([13, 0, 29, 5])
    x = torch.randn(50, K, requires_grad=True)
    ws = [nn.Parameter(Fp8MasterWeight(torch.randn(*shape) * shape[-1] ** -0.5, recipe))
          for shape in ((E, N, K), (E, K, N), (E, N, K))]
    gy = torch.randn(50, K)
    calls = {"rows": [], "cols": []}
    rows_fn, cols_fn = GR._quantize_rows, GR.quantize_group_cols
    monkeypatch.setattr(GR, "_quantize_rows", lambda t, *a, **k: calls["rows"].append(t.shape) or rows_fn(t, *a, **k))
    monkeypatch.setattr(GR, "quantize_group_cols",
                        lambda t, *a, **k: calls["cols"].append(t.shape) or cols_fn(t, *a, **k))

    def run(mode):
        for t in (x, *ws):
            t.grad = None
        calls["rows"].clear(), calls["cols"].clear()
        with GR.Fp8GroupedMMMode(share_inputs=True) if mode else torch.enable_grad():
            y = _swiglu_experts(x, ws, offs)
        y.backward(gy, retain_graph=True)
        once = [t.grad.clone() for t in (x, *ws)]
        y.backward(gy)
        return y.detach(), once, [t.grad.clone() for t in (x, *ws)], dict(rows=list(calls["rows"]),
                                                                          cols=list(calls["cols"]))

    y0, g0, gg0, c0 = run(False)
    y1, g1, gg1, c1 = run(True)
    assert torch.equal(y0, y1), seed
    for a, b in zip(g0 + gg0, g1 + gg1):
        assert torch.equal(a, b), seed
    for a, b in zip(g0, gg0):
        assert torch.equal(2 * a, b), seed
    fwd0 = [c for c in c0["rows"] if len(c) == 2]  # (the tokens' row quantizations; the weights' are 3-D)
    fwd1 = [c for c in c1["rows"] if len(c) == 2]
    assert len(fwd0) == 3 and len(fwd1) == 2, (c0, c1)  # x for w1 and w3, h; shared: x once, h
    if recipe == "rowwise":  # (fp8 grad_weight: the column quantizations)
        # per backward: gy of each GEMM, and the tokens (x twice, h) unshared; x once shared (two backwards)
        assert len(c0["cols"]) == 2 * 6 and len(c1["cols"]) == 2 * 6 - 1, (c0["cols"], c1["cols"])


def test_experts_mode_quantizes_a_changed_input_again():
    # The shared quantization is found by the input's identity, version and storage, and forgotten on any .data
    # access: an in-place change of the tokens between two GEMMs of one block (a version bump), a refill through
    # .data (no version bump) or a .data assignment (new storage) is quantized anew.
    offs = _offs([3, 0, 20, 9])
    w1 = nn.Parameter(Fp8MasterWeight(torch.randn(E, N, K)))
    buf = torch.randn(32, K)
    from fp8tensor.training.grouped import Fp8GroupedMMMode

    with torch.no_grad(), Fp8GroupedMMMode(share_inputs=True):
        y1 = torch._grouped_mm(buf, w1.transpose(-2, -1), offs=offs)
        buf.mul_(2.0)  # (a power of two: the fp8 values are the same, the scales double)
        y2 = torch._grouped_mm(buf, w1.transpose(-2, -1), offs=offs)
        buf.data.mul_(2.0)
        y3 = torch._grouped_mm(buf, w1.transpose(-2, -1), offs=offs)
        buf.data = torch.randn(32, K)
        y4 = torch._grouped_mm(buf, w1.transpose(-2, -1), offs=offs)
    assert torch.equal(y2, 2 * y1) and torch.equal(y3, 4 * y1)
    assert _rel(y4[:32], _ref(buf, w1._data, offs)[:32]) <= E4M3_GEMM_BOUND


def test_experts_mode_under_inference_mode_and_no_grad():
    # Inference tensors (no version counter): the GEMMs run unshared, as before; without grad mode the forward's
    # sharing gives the same bits.
    from fp8tensor.training import grouped as GR

    torch.manual_seed(5)
    offs = _offs([5, 0, 21, 6])
    ws = [nn.Parameter(Fp8MasterWeight(torch.randn(*shape) * shape[-1] ** -0.5))
          for shape in ((E, N, K), (E, K, N), (E, N, K))]
    x = torch.randn(32, K)
    with torch.no_grad():
        ref = _swiglu_experts(x, ws, offs)
    with torch.inference_mode():
        with GR.Fp8GroupedMMMode(share_inputs=True):
            y = _swiglu_experts(torch.randn(32, K) * 0 + x, ws, offs)
    with torch.no_grad(), GR.Fp8GroupedMMMode(share_inputs=True):
        y2 = _swiglu_experts(x, ws, offs)
    assert torch.equal(y, ref) and torch.equal(y2, ref)


def test_master_views_and_copies_under_inference_mode_are_as_plain_tensors():
    # Under inference mode a view of a normal master is a normal tensor (its grouped GEMM runs), a copy an inference
    # tensor, and views and copies of an inference master inference tensors, as for plain tensors.
    w = Fp8MasterWeight(torch.randn(E, N, K))
    with torch.inference_mode():
        wi = Fp8MasterWeight(torch.randn(E, N, K))
        v, c, vi, ci = w.transpose(-2, -1), w.clone(), wi.transpose(-2, -1), wi.clone()
        y = torch._grouped_mm(torch.randn(40, K), v, offs=_offs([10, 0, 20, 10]))
    assert not v.is_inference() and c.is_inference() and vi.is_inference() and ci.is_inference()
    assert y.shape == (40, N)
    with pytest.raises(RuntimeError, match="nference"):
        vi.add_(1)


def test_experts_mode_with_a_graph_break_under_compile():
    # dynamo supports a graph break inside a torch function mode only with TorchFunctionMode's own __enter__ /
    # __exit__: a compiled function that enters the mode and breaks its graph inside keeps the eager gradients.
    from fp8tensor.training.grouped import Fp8GroupedMMMode

    torch.manual_seed(7)
    offs = _offs([13, 0, 29, 5])
    w1, w3 = (nn.Parameter(Fp8MasterWeight(torch.randn(E, N, K) * K**-0.5)) for _ in range(2))
    x = torch.randn(47, K)

    def f(x):
        with Fp8GroupedMMMode(share_inputs=not torch.compiler.is_compiling()):
            a = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
            torch._dynamo.graph_break()
            return a * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)

    grads = []
    for fn in (f, torch.compile(f, backend="aot_eager")):
        torch._dynamo.reset()
        w1.grad = w3.grad = None
        xx = x.clone().requires_grad_()
        fn(xx).sum().backward()
        grads.append((xx.grad, w1.grad, w3.grad))
    for a, b in zip(*grads):
        assert _rel(b, a) <= 1e-5


def test_quantize_weights_stores_expert_weights_in_fp8():
    m = Block()
    w = {n: getattr(m.experts, n).detach().clone() for n in ("w1", "w2", "w3")}
    fp8tensor.quantize_weights(m)
    for n in ("w1", "w2", "w3"):
        p = getattr(m.experts, n)
        assert isinstance(p, ScaledFp8Tensor) and p.scale.shape == (E, p.shape[1], 1) and not p.requires_grad
        assert _rel(p.to_hp(), w[n]) <= U
    counts = torch.tensor([5, 0, 21, 6])
    x = torch.randn(32, 32, requires_grad=True)
    y = m.experts(x, counts)
    assert "_Fp8GroupedMMBackward" in _graph_names(y)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_out_dtype_must_be_high_precision_float():
    from fp8tensor.grouped import fp8_grouped_mm

    x = torch.randn(8, 32)
    w = torch.randn(2, 16, 32).transpose(-2, -1)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    for bad in (torch.int32, torch.float8_e4m3fn, "float32"):
        with pytest.raises(TypeError, match="fp8_grouped_mm: out_dtype must be a high-precision floating-point"):
            fp8_grouped_mm(x, w, offs, out_dtype=bad)


def test_compiled_moe_blocks_with_eager_experts_match_eager():
    """The example's way to compile a MoE model whose experts are fp8 (examples/llama.py,
    ``exclude_experts_from_compile``): each block compiles, the experts run eagerly. With ``aot_eager`` (the same
    forward ops) the output is bit-identical to the eager fp8 model. Its gradients, and everything with inductor
    (fused, reordered float32 ops), differ from eager only by float32 reordering, which an fp8 re-rounding
    downstream can amplify to one e4m3 step on a few elements; the bound asks that compiling changes the result by
    far less than fp8 itself does: a fifth of the fp8 GEMM bound (``E4M3_GEMM_BOUND / 5`` = 1e-2). ``pytest -s``
    prints the measured differences. The blocks did compile, and the experts' weights got gradients through the fp8
    grouped GEMMs. A deep copy runs its own experts and a pickled model keeps the switch."""
    import copy
    import io
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from llama import Llama, ModelArgs, exclude_experts_from_compile

    from torch._dynamo.utils import counters

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, moe=True, n_experts=4, top_k=2,
                     shared_expert=True)
    base = Llama(args)
    with pytest.warns(UserWarning, match="left in high precision"):  # the 64 -> 4 routers
        convert_to_fp8(base)
    tokens = torch.randint(0, 128, (2, 24))

    def run(model):
        out = model(tokens)
        out.float().pow(2).mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    eager = run(copy.deepcopy(base))
    for backend in ("aot_eager", "inductor"):
        model = copy.deepcopy(base)
        torch._dynamo.reset()
        counters.clear()
        for block in model.layers:
            exclude_experts_from_compile(block.feed_forward)
            block.compile(backend=backend)
        compiled = run(model)
        assert counters["stats"]["unique_graphs"] >= 2 * len(model.layers)  # graphs before and after the experts
        assert compiled[1].keys() == eager[1].keys()
        worst = max(_rel(compiled[1][name], g) for name, g in eager[1].items())
        print(f"compiled MoE blocks, {backend}: output {_rel(compiled[0], eager[0]):.2e}, worst gradient {worst:.2e}")
        assert torch.equal(compiled[0], eager[0]) if backend == "aot_eager" else \
            _rel(compiled[0], eager[0]) <= E4M3_GEMM_BOUND / 5
        for name, g in eager[1].items():
            assert _rel(compiled[1][name], g) <= E4M3_GEMM_BOUND / 5, name
    assert all(isinstance(getattr(b.feed_forward.experts, w), Fp8MasterWeight)
               for b in model.layers for w in ("w1", "w2", "w3"))
    assert all(eager[1][f"layers.{i}.feed_forward.experts.w1"].abs().sum() > 0 for i in range(args.n_layers))

    # the switch is data: a deep copy runs its own experts, a pickled model keeps it
    model = copy.deepcopy(base)
    for block in model.layers:
        exclude_experts_from_compile(block.feed_forward)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.layers[0].feed_forward.experts.w2._data.zero_()
        assert not torch.equal(twin(tokens), model(tokens))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert all(b.feed_forward.eager_experts for b in loaded.layers)


def test_whole_model_pickle_then_convert_again_is_bit_identical():
    """docs/moe.md: after ``torch.load`` of a pickled model (not its state_dict), ``convert_to_fp8`` again gives the
    saved model's fp8 experts back, bit for bit."""
    import io
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from llama import Llama, ModelArgs

    model = Llama(ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=128, moe=True, n_experts=4))
    with pytest.warns(UserWarning, match="left in high precision"):
        convert_to_fp8(model)
    tokens = torch.randint(0, 128, (2, 12))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with pytest.warns(UserWarning, match="left in high precision"):
        convert_to_fp8(loaded)
    assert isinstance(loaded.layers[0].feed_forward.experts.w1, Fp8MasterWeight)
    assert torch.equal(loaded(tokens), model(tokens))


def test_torchtitan_filter_keeps_routed_experts_in_high_precision():
    """docs/torchtitan.md's advice for fast MoE jobs: ``filter_fqns=["routed_experts"]`` leaves torchtitan's
    grouped experts in high precision and still converts the shared experts' Linears."""
    pytest.importorskip("torchtitan")
    import torchtitan.models.deepseek_v3 as ds
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts

    from fp8tensor.torchtitan import Fp8TensorGroupedExperts, Fp8TensorLinear, convert_model_config

    def fresh():
        return ds.deepseekv3_configs["debugmodel"](attn_backend="flex", moe_comm_backend="standard")

    everything = convert_model_config(fresh(), recipe="rowwise")
    assert any(type(c) is Fp8TensorGroupedExperts.Config for _, c, *_ in everything.traverse(GroupedExperts.Config))
    cfg = convert_model_config(fresh(), recipe="rowwise", filter_fqns=["routed_experts"])
    experts = list(cfg.traverse(GroupedExperts.Config))
    assert experts and all(type(c) is GroupedExperts.Config for _, c, *_ in experts)
    shared = [c for fqn, c, *_ in cfg.traverse(Linear.Config) if "shared_experts" in fqn]
    assert shared and all(type(c) is Fp8TensorLinear.Config for c in shared)


def _hf_experts(impl: str):
    """A tiny Hugging Face Qwen3-MoE model (from a config, no download) with ``impl`` as its experts implementation,
    and a float64 copy; transformers' experts classes dispatch through ``config._experts_implementation``."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3MoeConfig"):
        pytest.skip("this transformers has no Qwen3-MoE")
    cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=4, num_experts_per_tok=2)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    experts = model.model.layers[0].mlp.experts
    if not hasattr(experts.config, "_experts_implementation"):
        pytest.skip("this transformers has no experts implementations")
    experts.config._experts_implementation = impl
    with torch.no_grad():
        for p in (experts.gate_up_proj, experts.down_proj):
            p.normal_(0, p.shape[-1] ** -0.5)
    return model, experts


def _hf_experts_f64(gate_up, down, x, idx, wts):
    """float64 reference of a SwiGLU experts module with concatenated ``[gate; up]`` weights."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            gate, up = (x[t].double() @ gate_up[e].double().t()).chunk(2)
            out[t] += wts[t, j].double() * ((F.silu(gate) * up) @ down[e].double().t())
    return out


@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
@pytest.mark.parametrize("conversion", ["quantize_weights", "convert_to_fp8"])
def test_hugging_face_experts_are_converted(conversion, impl):
    """transformers' MoE experts (``@use_experts_implementation`` classes: their forward dispatches to
    ``grouped_mm_experts_forward`` and friends) are grouped-experts modules: both conversions select them, and their
    output and gradients are fp8's, against float64 (uneven routing with an expert left without tokens)."""
    model, experts = _hf_experts(impl)
    gate_up, down = experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()
    getattr(fp8tensor, conversion)(model)
    assert type(experts).__name__ == "Fp8Qwen3MoeExperts", type(experts)
    assert type(experts.gate_up_proj) is (ScaledFp8Tensor if conversion == "quantize_weights" else Fp8MasterWeight)
    assert not model.fp8_skipped if hasattr(model, "fp8_skipped") else True
    T = 9
    x = torch.randn(T, 64, requires_grad=True)
    idx = torch.tensor([[0, 1], [1, 3], [3, 0], [0, 3], [1, 0], [3, 1], [0, 1], [1, 3], [3, 0]])  # expert 2: none
    wts = torch.softmax(torch.randn(T, 2), -1)
    y = experts(x, idx, wts)
    ref = _hf_experts_f64(gate_up, down, x.detach(), idx, wts)
    assert _rel(y, ref) < 2 * TWO, _rel(y, ref)
    if conversion == "convert_to_fp8":
        g = torch.randn_like(ref)
        y.backward(g.float())
        x64 = x.detach().double().requires_grad_()
        gu64, d64 = gate_up.double().requires_grad_(), down.double().requires_grad_()
        _hf_experts_f64(gu64, d64, x64, idx, wts).backward(g)
        assert _rel(x.grad, x64.grad) < 2 * TWO
        # an expert's weight gradient: the GEMM's two rounded operands, and its token-side operand carries the
        # forward's fp8 error too (h = silu(gate) * up from two fp8 GEMMs of two rounded operands each; the gradient
        # of gate / up from the fp8 grad_input GEMM of down): about six roundings of relative size U, 2x for the few
        # tokens (3 to 6) each expert sums here
        grad_w_bound = 2 * math.sqrt(6) * U
        for e in (0, 1, 3):
            assert _rel(experts.gate_up_proj.grad[e], gu64.grad[e]) < grad_w_bound, e
            assert _rel(experts.down_proj.grad[e], d64.grad[e]) < grad_w_bound, e
        assert not experts.gate_up_proj.grad[2].any()


@pytest.mark.parametrize("conversion", ["quantize_weights", "convert_to_fp8"])
def test_hugging_face_experts_in_another_implementation_warn(conversion):
    """A converted Hugging Face experts module set to an implementation whose GEMMs fp8tensor does not see
    (``batched_mm``: ``torch.bmm`` over indexed weights) warns that it runs in high precision, and still computes the
    right result (within the fp8 bound of float64: quantize_weights' weights are fp8-rounded)."""
    model, experts = _hf_experts("grouped_mm")
    gate_up, down = experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()
    getattr(fp8tensor, conversion)(model)
    try:
        experts.config._experts_implementation = "batched_mm"
        x = torch.randn(5, 64)
        idx = torch.tensor([[0, 1], [1, 3], [3, 0], [0, 3], [1, 0]])
        wts = torch.softmax(torch.randn(5, 2), -1)
        with pytest.warns(UserWarning, match="batched_mm.*high precision"):
            y = experts(x, idx, wts)
    except (KeyError, ValueError, AttributeError, NotImplementedError) as e:  # (a transformers without batched_mm)
        pytest.skip(f"this transformers has no batched_mm experts: {e}")
    assert _rel(y, _hf_experts_f64(gate_up, down, x, idx, wts)) < 2 * TWO



@pytest.mark.parametrize("backward_inside", [False, True])
def test_autocast_leaves_the_fp8_grouped_gemms_alone(backward_inside):
    """Under ``torch.autocast`` (CPU, bf16), forward and backward (called inside the block or after it) give the bits
    they give outside it: autocast would cast the GEMMs' float32 scales to bf16 (3e-3 off). Also against float64."""
    w = (torch.randn(E, N, K) / math.sqrt(K)).bfloat16()
    x = torch.randn(45, K).bfloat16()
    offs = _offs([13, 0, 29, 3])
    g = torch.randn(45, N).bfloat16()

    def run(autocast):
        wp = nn.Parameter(w.clone())
        xx = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = fp8_grouped_mm(xx, wp.transpose(-2, -1), offs)
            if backward_inside:
                y.backward(g)
        if not backward_inside:
            y.backward(g)
        return y.detach(), xx.grad, wp.grad

    plain, auto = run(False), run(True)
    for name, p, a in zip(("output", "grad_input", "grad_weight"), plain, auto):
        assert a.dtype == p.dtype and torch.equal(a, p), f"{name}: {_rel(a, p):.3g} off the same call outside autocast"
    ref = _ref(x, w, offs)
    assert _rel(auto[0][:45], ref) < E4M3_GEMM_BOUND


def test_masked_grad_weight_gemm_ignores_unspecified_columns(monkeypatch):
    # On CUDA the per-group column kernel leaves the columns past the last group's padding unspecified (its traced op
    # allocates them with torch.empty): the traced (masked) 2-D x 2-D GEMM must not read them into the result, NaN
    # bytes included (NaN * 0 is NaN). Same values as the per-group GEMMs on clean operands.
    from fp8tensor.training import grouped as Gm

    offs = _offs([5, 0, 15])
    M = 23  # rows past the last group too
    gy, x = torch.randn(M, 32), torch.randn(M, 48)
    M_pad, pad_ends, pad_starts = padded_offsets(offs, M)
    gq, gs = quantize_group_cols(gy, offs, M_pad, pad_starts)
    xq, xs = quantize_group_cols(x, offs, M_pad, pad_starts)
    ref = Gm.grouped_2d2d(gq, gs, xq, xs, pad_ends, torch.float32, fast_accum=False)
    end = int(pad_ends[-1])
    assert end < M_pad
    for t in (gq, xq):
        t.view(torch.uint8)[:, end:] = 0x7F  # e4m3 NaN
    monkeypatch.setattr(Gm, "_traced", lambda o: True)
    out = Gm.grouped_2d2d(gq, gs, xq, xs, pad_ends, torch.float32, fast_accum=False)
    assert out.isfinite().all()
    assert _rel(out, ref) <= 1e-6


def test_a_plain_fp8_checkpoint_of_experts_loads_into_training_experts_as_its_values():
    """A ``quantize_weights`` experts checkpoint in the plain layout (fp8 data + ``_scale``) loaded into a
    ``convert_to_fp8`` model: each master weight holds the dequantized values (as a Linear's does), not the e4m3 codes
    (the experts had no hook to merge the pair), and the next forward runs on them."""
    from fp8tensor.checkpoint import plain_state_dict

    torch.manual_seed(0)
    src = fp8tensor.quantize_weights(Block())
    sd = plain_state_dict(src.state_dict())
    assert "experts.w1_scale" in sd and sd["experts.w1"].dtype == torch.float8_e4m3fn
    model = convert_to_fp8(Block())
    model.load_state_dict(sd)
    for n in ("w1", "w2", "w3"):
        w = getattr(model.experts, n)
        assert isinstance(w, Fp8MasterWeight) and w.requires_grad
        assert torch.equal(w._data, fp8tensor.dequantize(getattr(src.experts, n)).to(w.dtype)), n
