"""fp8 grouped experts: cases found by a new-user review (tests/test_moe.py has the rest), against float64.

Bounds (as in tests/test_moe.py): one e4m3 rounding has a relative RMS error of at most U = 2^-4 / sqrt(3), a GEMM of
two rounded operands at most sqrt(2) U (``TWO``). A compiled fp8 grouped GEMM multiplies the same quantized operands
as the eager one: only the float32 accumulation order differs (``EMULATION_BOUND``).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fp8tensor
from fp8tensor import Fp8MasterWeight, ScaledFp8Tensor
from fp8tensor.grouped import fp8_grouped_mm
from fp8tensor.master import GatheredExperts
from fp8tensor.recipes import get_recipe

from conftest import EMULATION_BOUND

from test_moe import E, K, N, TWO, _offs, _ref, _rel  # the shared bound and reference


def _weight(kind, w, recipe):
    if kind == "plain":
        return nn.Parameter(w.clone())
    if kind == "master":
        return nn.Parameter(Fp8MasterWeight(w.clone(), recipe))
    # FSDP2's fp8 all-gather of a master: the weight used as stored, its row scales folded into grad_out
    return nn.Parameter(GatheredExperts.of(ScaledFp8Tensor.from_hp(w), get_recipe(recipe)))


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp"])
@pytest.mark.parametrize("call,kind", [("fp8_grouped_mm", "plain"), ("fp8_grouped_mm", "master"),
                                       ("torch._grouped_mm", "master"), ("torch._grouped_mm", "gathered")])
def test_compiled_backward_under_autocast_is_the_eager_one(call, kind, recipe):
    """A compiled call under ``torch.autocast`` (the usual AMP step: forward in the block, ``backward()`` after it):
    torch.compile traces the backward under the autocast state around the compiled call, where autocast cast the
    traced fp8 GEMMs' dequantized float32 operands (and rowwise_gw_hp's float32 grad_weight GEMM) to bf16: gradients
    ~3e-3 off the eager ones. Now the eager gradients up to float32 summation order, within fp8's bound of float64;
    every way the grouped GEMM is reached (the function, a master's and an fp8-gathered weight's ``torch._grouped_mm``)."""
    offs = _offs([13, 0, 29, 20])
    M = 62 + 3  # rows past the last group too
    x, w, g = torch.randn(M, K), torch.randn(E, N, K) / K**0.5, torch.randn(M, N)

    def f(a, b):
        if call == "fp8_grouped_mm":
            return fp8_grouped_mm(a, b.transpose(-2, -1), offs, recipe=recipe)
        return torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)

    results = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        torch._dynamo.reset()
        wp = _weight(kind, w, recipe)
        xx = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(xx, wp)
        y.backward(g)
        results.append((y.detach(), xx.grad, wp.grad))
    (y, gx, gw), compiled = results
    for name, c, e in zip(("output", "grad_input", "grad_weight"), compiled, (y, gx, gw)):
        assert c.dtype == e.dtype and _rel(c, e) <= EMULATION_BOUND, f"{name}: compiled is {_rel(c, e):.3g} off eager"
    assert _rel(y, _ref(x, w, offs)) <= TWO
    assert _rel(gx, _ref(g, w.transpose(-2, -1), offs)) <= TWO
    ends = offs.tolist()
    for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
        if end == start:
            assert not gw[e].any()
        else:
            ref = g[start:end].double().t() @ x[start:end].double()
            assert _rel(gw[e], ref) <= (TWO if recipe == "rowwise" else 1e-6)


def test_integer_weights_are_refused():
    """Integer expert weights are not quantized silently (torch._grouped_mm refuses them too): a TypeError naming the
    op and the dtype."""
    x = torch.randn(8, K)
    w = torch.randint(-3, 4, (E, N, K), dtype=torch.int32)
    with pytest.raises(TypeError, match="fp8_grouped_mm: expected a high-precision input and weights.*torch.int32"):
        fp8_grouped_mm(x, w.transpose(-2, -1), _offs([2, 2, 2, 2]))


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp"])
def test_no_experts(recipe):
    """A weight of 0 experts (offs empty: every token in no group): the output and grad_input are zeros and the
    weight's gradient is empty, for both recipes (rowwise's grad_weight quantization raised an IndexError)."""
    x = torch.randn(5, K, requires_grad=True)
    wp = nn.Parameter(Fp8MasterWeight(torch.randn(0, N, K), recipe))
    y = fp8_grouped_mm(x, wp.transpose(-2, -1), torch.zeros(0, dtype=torch.int32), recipe=recipe)
    y.backward(torch.randn(5, N))
    assert torch.equal(y, torch.zeros(5, N)) and torch.equal(x.grad, torch.zeros(5, K))
    assert wp.grad.shape == (0, N, K)


class _UserFp8Experts(nn.Module):
    """SwiGLU-less experts whose first weight the user stores in plain float8 with a per-expert scale of their own
    (``w1`` ``(E, H, D)`` float8_e4m3fn, ``w1_scale`` ``(E, 1, 1)``), the second in high precision."""

    def __init__(self, D=32, H=64):
        super().__init__()
        w1 = torch.randn(E, H, D) / D**0.5
        s = w1.abs().amax((1, 2), keepdim=True) / 448.0
        self.w1 = nn.Parameter((w1 / s).to(torch.float8_e4m3fn), requires_grad=False)
        self.register_buffer("w1_scale", s)
        self.w2 = nn.Parameter(torch.randn(E, D, H) / H**0.5)

    def forward(self, x, offs):
        w1 = self.w1.float() * self.w1_scale
        h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))
        return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32, bias=False)
        self.experts = _UserFp8Experts()


@pytest.mark.parametrize("conversion", ["convert_to_fp8", "quantize_weights"])
def test_plain_float8_expert_weight_is_left_as_it_is(conversion):
    """A grouped-experts module's 3-D plain float8 parameter (no scales fp8tensor could read it by) is left as it
    is, with a warning and listed in ``fp8_skipped``, as a Linear's plain float8 weight: the module's other weights and
    the model's Linears are converted. (convert_to_fp8 raised ``Fp8MasterWeight: expected a high-precision ...`` after
    converting the Linears; quantize_weights a NotImplementedError of ``isfinite``.) The converted experts compute
    their GEMMs against float64 within fp8's bound (w1 dequantized by the module itself, w2 in fp8)."""
    m = _Block()
    w1, w1_bytes = m.experts.w1, m.experts.w1.detach().view(torch.uint8).clone()
    w1_hp = (w1.float() * m.experts.w1_scale).double()
    w2 = m.experts.w2.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        getattr(fp8tensor, conversion)(m)
    msg = "experts.w1 (a torch.float8_e4m3fn weight, not a high-precision floating-point one)"
    assert msg in m.fp8_skipped and any(msg in str(c.message) for c in caught)
    assert m.experts.w1 is w1 and torch.equal(w1.detach().view(torch.uint8), w1_bytes)
    assert m.experts.fp8_expert_params == ("w2",)
    assert isinstance(m.experts.w2, Fp8MasterWeight if conversion == "convert_to_fp8" else ScaledFp8Tensor)
    assert isinstance(m.proj.weight, Fp8MasterWeight if conversion == "convert_to_fp8" else ScaledFp8Tensor)
    offs = _offs([7, 0, 19, 4])
    x = torch.randn(30, 32)
    h = F.silu(_ref(x, w1_hp, offs))
    y = m.experts(x, offs)
    assert _rel(y, _ref(h, w2, offs)) <= TWO
