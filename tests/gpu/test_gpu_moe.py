"""fp8 grouped GEMMs of expert weights on CUDA (skipped without a GPU): the fused ``torch._scaled_grouped_mm`` path
against the per-group ``torch._scaled_mm`` path (same quantized operands), the Triton per-group column kernel
against the plain ops, and forward / grad_input / grad_weight against float64 (bounds: U = 2^-4 / sqrt(3) per
rounded fp8 operand, sqrt(2) U for a GEMM of two; bf16 output adds 2^-8 / sqrt(3))."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8tensor import Fp8MasterWeight, ScaledFp8Tensor, kernels
from fp8tensor import grouped as G

from conftest import set_knobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda"
U = 2.0**-4 / math.sqrt(3)
BOUND = math.sqrt(2 * U**2 + (2.0**-8 / math.sqrt(3)) ** 2)

# uneven groups, empty groups, totals that are not multiples of 16; the last: many experts (Qwen3-like)
SIZES = [[130, 0, 77, 301, 16, 1, 0, 211], [0, 0, 0, 64, 0, 0, 0, 0], [5] * 8 + [0] * 8 + [33] * 8]


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _offs(sizes):
    return torch.cumsum(torch.tensor(sizes, device=DEV), 0).to(torch.int32)


def _ref(x, w, offs):
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64, device=DEV)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end].double() @ w[e].double().t()
        start = end
    return out


def _step(x, wp, offs, g, recipe):
    xr = x.clone().requires_grad_()
    y = G.fp8_grouped_mm(xr, wp.transpose(-2, -1), offs, recipe=recipe)
    y.backward(g)
    return y, xr.grad, wp.grad


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp"])
def test_fused_matches_per_group_and_float64(sizes, recipe, monkeypatch):
    E = len(sizes)
    K, N = 256, 384
    offs = _offs(sizes)
    M = int(offs[-1])
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device=DEV, dtype=torch.bfloat16)
    g = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
    outs = {}
    for fused in (True, False):
        set_knobs(monkeypatch, grouped_gemm_kernel=fused)
        wp = nn.Parameter(Fp8MasterWeight(w.clone(), recipe))
        outs[fused] = _step(x, wp, offs, g, recipe)
    for a, b in zip(outs[True], outs[False]):
        assert rel(a, b) <= 2.0**-7  # same operands: only the accumulation order and the bf16 output differ
    y, gx, gw = outs[True]
    assert rel(y, _ref(x, w, offs)) <= BOUND
    assert rel(gx, _ref(g, w.transpose(-2, -1), offs)) <= BOUND
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end == start:
            assert torch.count_nonzero(gw[e]) == 0
        else:
            ref = g[start:end].double().t() @ x[start:end].double()
            assert rel(gw[e], ref) <= (BOUND if recipe == "rowwise" else 2.0**-7)
        start = end


def test_fp8_weights_fold_scales_on_cuda():
    sizes = [40, 0, 25, 63]
    offs = _offs(sizes)
    M, K, N = int(offs[-1]), 128, 256
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, N, K, device=DEV, dtype=torch.bfloat16)
    g = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
    y = G.fp8_grouped_mm(x, ScaledFp8Tensor.from_hp(w).transpose(-2, -1), offs)
    y.backward(g)
    assert rel(y, _ref(x, w, offs)) <= BOUND
    assert rel(x.grad, _ref(g, w.transpose(-2, -1), offs)) <= BOUND


@pytest.mark.skipif(not kernels.HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_group_col_kernel_matches_plain_ops(dtype, monkeypatch):
    sizes = [13, 0, 100, 1, 64, 0, 7]
    offs = _offs(sizes)
    M = int(offs[-1]) + 3  # rows past the last group
    x = torch.randn(M, 96, device=DEV, dtype=dtype) * torch.logspace(-3, 3, 96, device=DEV).to(dtype)
    M_pad, pad_ends, pad_starts = G.padded_offsets(offs, M)
    qk, sk = G.quantize_group_cols(x, offs, M_pad, pad_starts)
    monkeypatch.setattr(kernels, "group_col_kernel_available", lambda t: False)
    qp, sp = G.quantize_group_cols(x, offs, M_pad, pad_starts)
    assert torch.equal(sk, sp)
    end = int(pad_ends[-1])
    assert torch.equal(qk[:, :end].view(torch.uint8), qp[:, :end].view(torch.uint8))
    w = torch.randn(5, 48, 80, device=DEV, dtype=dtype)
    monkeypatch.undo()
    qk, sk = G.quantize_expert_cols(w)
    monkeypatch.setattr(kernels, "group_col_kernel_available", lambda t: False)
    qp, sp = G.quantize_expert_cols(w)
    assert torch.equal(sk, sp) and torch.equal(qk.view(torch.uint8), qp.view(torch.uint8))


@pytest.mark.skipif(not kernels.HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("mode", ["one_kernel", "split", "auto"])
def test_group_col_kernel_forms_agree_at_moe_shapes(mode, monkeypatch):
    # The one-launch kernel and the split form (amax launch, then cast launch over chunks of each group's rows) write
    # the bits of the plain ops at a DeepSeek-V3-like token count (groups of ~2000 rows: "auto" splits them), uneven
    # groups with an empty one, tokens and expert weights; with NaN and inf in the tokens, the bits of the one launch.
    table = kernels.GROUP_COL_CONFIG
    monkeypatch.setattr(kernels, "GROUP_COL_CONFIG", kernels._frozen({**table, "mode": mode}))
    torch.manual_seed(0)
    sizes = [3000, 0, 2048, 1, 4500, 17, 2600, 4200]
    offs = _offs(sizes)
    M = int(offs[-1]) + 5
    x = torch.randn(M, 1040, device=DEV, dtype=torch.bfloat16) * torch.logspace(-3, 3, 1040, device=DEV).bfloat16()
    M_pad, pad_ends, pad_starts = G.padded_offsets(offs, M)
    end = int(pad_ends[-1])
    assert kernels.group_col_chunks(M, len(sizes)) == {"one_kernel": 1, "split": 3, "auto": 3}[mode]
    qk, sk = G.quantize_group_cols(x, offs, M_pad, pad_starts)
    w = torch.randn(4, 2048, 272, device=DEV, dtype=torch.bfloat16)
    qwk, swk = G.quantize_expert_cols(w)
    xs = x.clone()
    xs[5, 7], xs[3100, 9], xs[9000, 1039] = float("nan"), float("inf"), -float("inf")
    qsk, ssk = G.quantize_group_cols(xs, offs, M_pad, pad_starts)
    with monkeypatch.context() as m:
        m.setattr(kernels, "group_col_kernel_available", lambda t: False)
        qp, sp = G.quantize_group_cols(x, offs, M_pad, pad_starts)
        qwp, swp = G.quantize_expert_cols(w)
    assert torch.equal(sk, sp)
    assert torch.equal(qk[:, :end].view(torch.uint8), qp[:, :end].view(torch.uint8))
    assert torch.equal(swk, swp) and torch.equal(qwk.view(torch.uint8), qwp.view(torch.uint8))
    monkeypatch.setattr(kernels, "GROUP_COL_CONFIG", kernels._frozen({**table, "mode": "one_kernel"}))
    qs1, ss1 = G.quantize_group_cols(xs, offs, M_pad, pad_starts)
    assert torch.equal(ssk, ss1) and ssk[0, 7] == float("inf") and ssk[2, 9] == float("inf")
    assert torch.equal(qsk[:, :end].view(torch.uint8), qs1[:, :end].view(torch.uint8))


@pytest.mark.skipif(not kernels.HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cast_rows_t_kernel_is_the_row_kernel_transposed(dtype):
    # The backward's re-cast of a master weight with the forward's row scales: the row kernel's bits, transposed,
    # at expert shapes and ragged tiles; a weight changed after its scales saturates.
    from fp8tensor.numerics.quantize import cast_rows_t_after, quantize

    torch.manual_seed(0)
    for shape in ((8, 2048, 7168), (128, 768, 2048), (3, 70, 200), (1000, 17)):
        w = torch.randn(shape, device=DEV, dtype=dtype) * torch.logspace(-3, 3, shape[-1], device=DEV).to(dtype)
        q, s = quantize(w, -1)
        assert kernels.cast_rows_t_available(w, s.squeeze(-1))
        qt = cast_rows_t_after(w, s.squeeze(-1), w)
        assert torch.equal(qt.view(torch.uint8), q.transpose(-2, -1).contiguous().view(torch.uint8)), shape
    qt = cast_rows_t_after(w * 4, s.squeeze(-1), w)
    assert torch.isfinite(qt.float()).all() and qt.float().abs().max() == 448.0


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp"])
def test_grad_input_of_a_master_weight_is_the_stored_fp8_weights_on_cuda(recipe):
    # eager and compiled: a bf16 master's grad_input equals a stored fp8 weight's of the same values (the forward's
    # fp8 weight, its row scales folded into gy), within the fp8 bound of float64
    sizes = [1500, 0, 700, 3, 1900]
    offs = _offs(sizes)
    M, K, N = int(offs[-1]), 512, 768
    torch.manual_seed(1)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(len(sizes), N, K, device=DEV, dtype=torch.bfloat16) * 0.05
    g = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)

    def grad(b, compiled):
        xr = x.clone().requires_grad_()
        f = (lambda a, bb: G.fp8_grouped_mm(a, bb, offs, recipe=recipe))
        if compiled:
            torch._dynamo.reset()
            f = torch.compile(f, fullgraph=True)
        f(xr, b.transpose(-2, -1)).backward(g)
        return xr.grad

    stored = grad(ScaledFp8Tensor.from_hp(w), False)
    for compiled in (False, True):
        gx = grad(nn.Parameter(Fp8MasterWeight(w.clone(), recipe)), compiled)
        if not compiled:
            assert torch.equal(gx, stored)
        assert rel(gx, _ref(g, w.transpose(-2, -1), offs)) <= BOUND, compiled
    torch._dynamo.reset()


class _Experts(nn.Module):
    """Two-GEMM grouped experts with torchtitan's casts (bf16 operands, output cast back)."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 512, 256, device=DEV) * 0.05)
        self.w2 = nn.Parameter(torch.randn(8, 256, 512, device=DEV) * 0.05)

    def forward(self, x, counts):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        # silu, not relu: a relu mask flipped by the forward's fp8 rounding would carry a full gradient element
        # into w1's gradient (an error no operand-rounding bound covers)
        h = F.silu(torch._grouped_mm(x.bfloat16(), self.w1.bfloat16().transpose(-2, -1), offs=offs))
        return torch._grouped_mm(h, self.w2.bfloat16().transpose(-2, -1), offs=offs).type_as(x)


def test_converted_grouped_experts_train_on_cuda():
    from fp8tensor import convert_to_fp8

    m = _Experts()
    ref = _Experts()
    ref.load_state_dict(m.state_dict())
    convert_to_fp8(m)
    counts = torch.tensor([100, 0, 37, 300, 5, 64, 0, 17], device=DEV)
    x = torch.randn(int(counts.sum()), 256, device=DEV)
    y, y_ref = m(x, counts), ref(x, counts)
    y.sum().backward()
    y_ref.sum().backward()
    assert rel(y, y_ref) <= math.sqrt(2) * BOUND + 2.0**-7
    assert rel(m.w1.grad, ref.w1.grad) <= 2 * BOUND
    assert rel(m.w2.grad, ref.w2.grad) <= 2 * BOUND


class _Block(nn.Module):
    """A MoE block's shape: a Linear, then the grouped experts on the tokens sorted by expert, and a residual."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(256, 256, bias=False, device=DEV)
        self.experts = _Experts()

    def forward(self, x, counts):
        return x + self.experts(self.proj(x), counts)


def test_compiled_moe_block_matches_eager_on_cuda():
    """``torch.compile(block, fullgraph=True)`` (inductor) of a block with converted grouped experts, as torchtitan
    compiles MoE blocks: output, input gradient and every weight's gradient as eager's within the fp8 GEMM bound
    (the same fp8 GEMMs; inductor fuses the quantizations, so a rounding may flip), and the compiled GEMMs are fp8
    (the experts' output differs from the high-precision block's). Offsets stay on the device; uneven groups, empty
    ones, unaligned totals, then a second size (a recompile with a dynamic token count)."""
    import copy

    from fp8tensor import convert_to_fp8

    hp = _Block()
    block = copy.deepcopy(hp)
    convert_to_fp8(block)
    assert isinstance(block.experts.w1, Fp8MasterWeight) and isinstance(block.proj.weight, Fp8MasterWeight)
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(block), fullgraph=True)
    for sizes in ([100, 0, 37, 300, 5, 64, 0, 17], [1, 250, 0, 0, 90, 3, 33, 7]):
        counts = torch.tensor(sizes, device=DEV)
        x = torch.randn(sum(sizes), 256, device=DEV)
        g = torch.randn(sum(sizes), 256, device=DEV)
        runs = []
        for m in (block, compiled, hp):
            xr = x.clone().requires_grad_()
            y = m(xr, counts)
            y.backward(g)
            base = getattr(m, "_orig_mod", m)
            runs.append((y.detach(), xr.grad, {n: p.grad.clone() for n, p in base.named_parameters()}))
            base.zero_grad(set_to_none=True)
        (y_e, gx_e, gw_e), (y_c, gx_c, gw_c), (y_hp, _, _) = runs
        assert rel(y_c, y_e) <= BOUND and rel(gx_c, gx_e) <= BOUND, sizes
        # A weight gradient ends the longest chain of fp8 GEMMs (proj's grad_weight reads grad_out through both
        # grouped GEMMs' backward): eager and compiled each lie within BOUND of the exact gradient, so within 2 * BOUND
        # of each other (seed 291762073 gave 1.006 * BOUND for proj.weight).
        for n, g_e in gw_e.items():
            assert rel(gw_c[n], g_e) <= 2 * BOUND, (sizes, n)
        assert rel(y_c - x, y_hp - x) > 1e-3, sizes  # the compiled GEMMs ran in fp8


@pytest.mark.parametrize("recipe,fused", [("rowwise", True), ("rowwise_gw_hp", True), ("rowwise", False)])
def test_compiled_grouped_backward_quantizes_per_group_column_with_the_kernel(recipe, fused):
    """Compiled (inductor), the grouped GEMM's backward quantizes the tokens and grad_out per group and column (fp8
    grad_weight) with the Triton kernel (through its ``triton_op``), not the plain ops' scatter-amax (5-10x slower);
    a master's expert weights (grad_input's operand) are re-cast per row from the forward's scales, so with grad_weight
    in high precision no per-group column quantization runs; input and weight gradients as eager's within the fp8
    GEMM bound. Without the fused
    grouped GEMM (``grouped_gemm_kernel=False``: the traced masked GEMMs read every token column) the weight gradient
    stays finite: the columns the kernel leaves unspecified are masked out."""
    import fp8tensor
    from torch._inductor.utils import run_and_get_code

    offs = _offs(SIZES[0])
    M = int(offs[-1]) + 3  # rows past the last group
    x = torch.randn(M, 256, device=DEV, dtype=torch.bfloat16)
    w = (torch.randn(8, 128, 256, device=DEV) / 16).to(torch.bfloat16)
    g = torch.randn(M, 128, device=DEV, dtype=torch.bfloat16)
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        xr, wp = x.clone().requires_grad_(), nn.Parameter(w.clone())

        def fn(a, b):
            return G.fp8_grouped_mm(a, b.transpose(-2, -1), offs, recipe=recipe)

        f = torch.compile(fn, fullgraph=True) if compiled else fn

        def step():
            with fp8tensor.config(grouped_gemm_kernel=fused):
                y = f(xr, wp)
                y.backward(g)
            return y

        if compiled:
            y, codes = run_and_get_code(step)
            code = "\n".join(codes)
            runs_kernel = any(k in code for k in ("_group_col_quant_t_kernel", "_group_col_cast_t_kernel"))
            assert runs_kernel == (recipe == "rowwise"), "the compiled backward's per-group column quantization"
            assert "scatter" not in code.lower()
        else:
            y = step()
        runs.append((y.detach(), xr.grad, wp.grad))
    (y_e, gx_e, gw_e), (y_c, gx_c, gw_c) = runs
    T = int(offs[-1])  # (rows past the last group: unspecified, as torch._grouped_mm's)
    assert rel(y_c[:T], y_e[:T]) <= BOUND and rel(gx_c[:T], gx_e[:T]) <= BOUND
    assert gw_c.isfinite().all() and rel(gw_c, gw_e) <= BOUND


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp"])
def test_experts_mode_shares_the_tokens_quantization_with_the_same_bits_on_cuda(recipe):
    # On CUDA (the row and per-group column kernels): SwiGLU experts under Fp8GroupedMMMode, w1 and w3 sharing the
    # tokens' quantization, give the bits of the unshared calls, and the fp8 bound against float64.
    from fp8tensor.training.grouped import Fp8GroupedMMMode

    torch.manual_seed(1)
    sizes = [300, 0, 517, 45, 1, 700, 0, 64]
    offs = _offs(sizes)
    M, D, H = int(offs[-1]) + 3, 512, 256
    x = torch.randn(M, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    ws = [nn.Parameter(Fp8MasterWeight((torch.randn(*s, device=DEV) * s[-1] ** -0.5).bfloat16(), recipe))
          for s in ((8, H, D), (8, D, H), (8, H, D))]
    gy = torch.randn(M, D, device=DEV, dtype=torch.bfloat16)

    def run(mode):
        for t in (x, *ws):
            t.grad = None
        with Fp8GroupedMMMode(share_inputs=True) if mode else torch.enable_grad():
            w1, w2, w3 = ws
            h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)) * torch._grouped_mm(
                x, w3.transpose(-2, -1), offs=offs)
            y = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
        y.backward(gy)
        return [y.detach()] + [t.grad.clone() for t in (x, *ws)]

    a, b = run(False), run(True)
    end = int(offs[-1])
    for p, q in zip(a[:2], b[:2]):  # (rows past offs[-1]: unspecified on CUDA)
        assert torch.equal(p[:end], q[:end])
    for p, q in zip(a[2:], b[2:]):
        assert torch.equal(p, q)
    w1 = ws[0]._data.double()
    ref = _ref(x.detach(), w1, offs)
    # (the GEMM of w1 alone: its output against float64, by the two-operand bound)
    y1 = torch._grouped_mm(x.detach(), ws[0].transpose(-2, -1), offs=offs)
    assert rel(y1[:end], ref[:end]) <= BOUND
