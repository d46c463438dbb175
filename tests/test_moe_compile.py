"""Converted grouped experts under ``torch.compile(block, fullgraph=True)``, one compile per MoE block as torchtitan
compiles them, on the CPU: forward, grad_input and every expert's grad_weight against float64 and against eager.

Bounds (as in tests/test_moe.py): one e4m3 rounding has a relative RMS error of at most U = 2^-4 / sqrt(3), a GEMM of
two rounded operands at most sqrt(2) U (``TWO``); bf16 operands and outputs (torchtitan's casts) add at most 2^-8.
A compiled fp8 GEMM multiplies the same quantized operands as the eager one (per-group ``torch._scaled_mm``) in
another formulation (docs/moe.md, "Compiled"): only the float32 accumulation order differs, which a later fp8 or bf16
rounding can turn into one rounding step on a few elements; compiled and eager must agree to a fifth of the fp8 GEMM
bound (``E4M3_GEMM_BOUND / 5`` = 1e-2, as for the compiled example model of tests/test_moe.py); ``pytest -s``
prints the measured differences.
"""
from __future__ import annotations

import copy
import math
import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import fp8tensor
from fp8tensor import Fp8MasterWeight, ScaledFp8Tensor

from conftest import E4M3_GEMM_BOUND

U = 2.0**-4 / math.sqrt(3)
TWO = math.sqrt(2) * U
BF16 = 2.0**-8
VS_EAGER = E4M3_GEMM_BOUND / 5

E, K, N = 4, 32, 48
# uneven groups with an empty one and a total that is not a multiple of 16; a group of 1 token; an aligned batch
SIZES = [[13, 0, 29, 5], [1, 7, 0, 19], [16, 16, 32, 16]]


class RoutedExperts(nn.Module):
    """A minimal MoE block: tokens sorted by their expert (group sizes and offsets computed on the device, inside
    the compiled graph), one grouped GEMM over the experts' weights ``w`` ``(E, N, K)``, outputs put back in token
    order. ``cast``: bf16 operands and the output cast back, as torchtitan's ``GroupedExperts`` does."""

    def __init__(self, cast: bool):
        super().__init__()
        self.w = nn.Parameter(torch.randn(E, N, K) / K**0.5)
        self.cast = cast

    def forward(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros(E, dtype=torch.long).index_add_(0, expert, torch.ones_like(expert))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        order = torch.argsort(expert, stable=True)
        xs, w = x[order], self.w
        if self.cast:
            xs, w = xs.bfloat16(), w.bfloat16()
        y = torch._grouped_mm(xs, w.transpose(-2, -1), offs=offs).type_as(x)
        return torch.empty_like(y).index_copy_(0, order, y)


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _inputs(sizes):
    """Tokens ``x`` ``(M, K)`` in random order, each token's expert, and an upstream gradient ``(M, N)``."""
    expert = torch.repeat_interleave(torch.arange(E), torch.tensor(sizes))
    expert = expert[torch.randperm(expert.numel())]
    return torch.randn(expert.numel(), K), expert, torch.randn(expert.numel(), N)


def _step(block, x, expert, g):
    x = x.clone().requires_grad_()
    y = block(x, expert)
    y.backward(g)
    w = getattr(block, "_orig_mod", block).w
    grads = w.grad.clone()
    w.grad = None
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("cast", [False, True], ids=["float32", "bf16"])
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp"])
def test_compiled_block_matches_float64_and_eager(recipe, cast):
    block = RoutedExperts(cast)
    fp8tensor.convert_to_fp8(block, recipe=recipe)
    assert isinstance(block.w, Fp8MasterWeight) and type(block).__name__ == "Fp8RoutedExperts"
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(block), fullgraph=True, backend="aot_eager")
    extra = BF16 if cast else 0.0  # bf16 operands: reference on the rounded values, bf16 outputs
    for sizes in SIZES:  # the second size recompiles with a dynamic token count
        x, expert, g = _inputs(sizes)
        y, gx, gw = _step(compiled, x, expert, g)
        w = block.w._data
        xr, wr, gr = (t.bfloat16() if cast else t for t in (x, w, g))
        wt = wr.double()[expert]  # (M, N, K): each token's expert weight
        y_ref = torch.einsum("mk,mnk->mn", xr.double(), wt)
        assert _rel(y, y_ref) <= TWO + extra, sizes
        assert _rel(y, y_ref) > 1e-3  # the GEMM ran in fp8
        assert _rel(gx, torch.einsum("mn,mnk->mk", gr.double(), wt)) <= TWO + extra, sizes
        for e in range(E):
            rows = expert == e
            if not rows.any():
                assert torch.count_nonzero(gw[e]) == 0  # an expert without tokens: an exact zero gradient
                continue
            ref = gr[rows].double().t() @ xr[rows].double()
            bound = TWO + extra if recipe == "rowwise" else (extra or 1e-6)  # rowwise_gw_hp: high precision
            assert _rel(gw[e], ref) <= bound, (sizes, e)
        eager = _step(block, x, expert, g)
        diffs = [_rel(c, r) for c, r in zip((y, gx, gw), eager)]
        print(f"{recipe} {'bf16' if cast else 'float32'} {sizes}: compiled vs eager (out, grad_input, grad_weight) "
              + " ".join(f"{d:.1e}" for d in diffs))
        assert max(diffs) <= VS_EAGER, (sizes, diffs)


def test_compiled_functional_fp8_grouped_mm_matches_float64():
    """``fp8tensor.fp8_grouped_mm`` called in compiled code (dynamo traces its autograd Function itself, unlike a
    module's ``torch._grouped_mm``, which it records as one call): output and both gradients against float64 (no
    eager run, so this also checks torch 2.11, whose CPU ``torch._scaled_mm`` takes no row-wise scales; there a
    no-op cast returned by the Function zeroed the gradients: docs/pytorch_issues.md)."""
    from fp8tensor.grouped import fp8_grouped_mm

    sizes = SIZES[0]
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    expert = torch.repeat_interleave(torch.arange(E), torch.tensor(sizes))
    x, w, g = torch.randn(len(expert), K), torch.randn(E, N, K), torch.randn(len(expert), N)
    wp = nn.Parameter(Fp8MasterWeight(w.clone()))
    xr = x.clone().requires_grad_()
    torch._dynamo.reset()
    y = torch.compile(lambda a, o: fp8_grouped_mm(a, wp.transpose(-2, -1), o), fullgraph=True,
                      backend="aot_eager")(xr, offs)
    y.backward(g)
    wt = w.double()[expert]
    assert _rel(y, torch.einsum("mk,mnk->mn", x.double(), wt)) <= TWO
    assert _rel(xr.grad, torch.einsum("mn,mnk->mk", g.double(), wt)) <= TWO
    for e in range(E):
        rows = expert == e
        if rows.any():
            assert _rel(wp.grad[e], g[rows].double().t() @ x[rows].double()) <= TWO, e
        else:
            assert torch.count_nonzero(wp.grad[e]) == 0


@pytest.mark.parametrize("bad", [[5, 3, 7, 10], [2, 4, 6, 12], [-3, 4, 6, 10]],
                         ids=["decreasing", "past_M", "negative"])
def test_compiled_grouped_mm_checks_offsets_on_cpu(bad):
    """Bad offsets in a compiled graph on CPU raise when the graph runs (the check eager mode makes, as
    ``torch._assert_async`` in the graph), instead of summing overlapping groups; good ones run as before."""
    from fp8tensor.grouped import fp8_grouped_mm

    w = Fp8MasterWeight(torch.randn(4, N, K))
    f = torch.compile(lambda a, o: fp8_grouped_mm(a, w.transpose(-2, -1), o), fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    x = torch.randn(10, K)
    good = torch.tensor([2, 2, 7, 10], dtype=torch.int32)
    assert f(x, good).shape == (10, N)
    with pytest.raises(RuntimeError, match="fp8_grouped_mm: offs must be non-decreasing"):
        f(x, torch.tensor(bad, dtype=torch.int32))
    with pytest.raises(ValueError, match="fp8_grouped_mm: offs must be non-decreasing"):
        fp8_grouped_mm(x, w.transpose(-2, -1), torch.tensor(bad, dtype=torch.int32))
    torch._dynamo.reset()


def test_compiled_fp8_stored_experts_inference():
    """``quantize_weights``: fp8-stored experts (``ScaledFp8Tensor``), compiled for inference under no_grad."""
    block = RoutedExperts(cast=False)
    w = block.w.detach().clone()
    fp8tensor.quantize_weights(block)
    assert isinstance(block.w, ScaledFp8Tensor)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    for sizes in SIZES:
        x, expert, _ = _inputs(sizes)
        with torch.no_grad():
            y, y_eager = compiled(x, expert), block(x, expert)
        y_ref = torch.einsum("mk,mnk->mn", x.double(), w.double()[expert])
        print(f"fp8-stored experts {sizes}: compiled vs eager {_rel(y, y_eager):.1e}")
        assert _rel(y, y_ref) <= TWO, sizes
        assert _rel(y, y_eager) <= VS_EAGER, sizes


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_example_moe_block_matches_eager(backend):
    """The example model's MoE block (router, top-k dispatch, SwiGLU grouped experts) compiled as torchtitan compiles
    blocks: output, input gradient and every parameter's gradient as eager's (to ``VS_EAGER``)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from examples.llama import Llama, ModelArgs

    model = Llama(ModelArgs(dim=128, n_layers=1, moe=True, n_experts=4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the 128 -> 4 router stays in high precision
        fp8tensor.convert_to_fp8(model)
    block = model.layers[0]
    assert all(isinstance(getattr(block.feed_forward.experts, n), Fp8MasterWeight) for n in ("w1", "w2", "w3"))
    x = torch.randn(2, 12, 128)

    def run(b):
        xr = x.clone().requires_grad_()
        out = b(xr, model.rope)
        out.float().pow(2).mean().backward()
        b = getattr(b, "_orig_mod", b)
        return out.detach(), xr.grad, {n: p.grad.clone() for n, p in b.named_parameters()}

    eager = run(copy.deepcopy(block))
    torch._dynamo.reset()
    compiled = run(torch.compile(copy.deepcopy(block), fullgraph=True, backend=backend))
    worst = max(_rel(compiled[2][n], g) for n, g in eager[2].items())
    print(f"example MoE block, {backend}: output {_rel(compiled[0], eager[0]):.1e}, input gradient "
          f"{_rel(compiled[1], eager[1]):.1e}, worst parameter gradient {worst:.1e}")
    assert _rel(compiled[0], eager[0]) <= VS_EAGER and _rel(compiled[1], eager[1]) <= VS_EAGER
    for name, g in eager[2].items():
        assert _rel(compiled[2][name], g) <= VS_EAGER, name
    assert all(eager[2][f"feed_forward.experts.{n}"].abs().sum() > 0 for n in ("w1", "w2", "w3"))


def test_compiled_torchtitan_grouped_experts_match_eager():
    """torchtitan's ``GroupedExperts`` converted by ``fp8tensor.torchtitan`` (bf16 casts inside its forward), compiled
    with ``fullgraph=True`` as ``--compile.enable`` compiles MoE blocks: output and gradients as eager's."""
    pytest.importorskip("torchtitan")
    from torchtitan.models.common.moe import GroupedExperts

    from fp8tensor.torchtitan import convert_model_config

    m = convert_model_config(GroupedExperts.Config(dim=K, hidden_dim=2 * K, num_experts=E), recipe="rowwise").build()
    for p in m.parameters():
        nn.init.normal_(p, std=0.1)
    counts, x = torch.tensor([5, 0, 10, 7]), torch.randn(22, K)

    def run(mod):
        xr = x.clone().requires_grad_()
        out = mod(xr, counts)
        out.pow(2).sum().backward()
        return [out.detach(), xr.grad] + [p.grad for p in getattr(mod, "_orig_mod", mod).parameters()]

    eager = run(copy.deepcopy(m))
    torch._dynamo.reset()
    compiled = run(torch.compile(copy.deepcopy(m), fullgraph=True, backend="aot_eager"))
    for c, e in zip(compiled, eager):
        assert _rel(c, e) <= VS_EAGER


@pytest.fixture
def one_rank_gloo():
    import torch.distributed as dist

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if own:
            dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, None], ids=["bf16_mp", "float32"])
def test_compiled_fsdp2_experts_match_eager_fsdp2(one_rank_gloo, param_dtype, backend):
    """Grouped experts under FSDP2 (1 gloo rank, fp8 all-gather of the masters) compiled with ``fullgraph=True``, as
    torchtitan runs MoE blocks: output and gradients as the same FSDP2 model's eager step (``VS_EAGER``), whose
    grad_weight is an fp8 GEMM (its error against float64 is fp8's, ~3e-2, not bf16's ~3e-3). The block sees the
    all-gathered weight (``GatheredExperts``), whose ``torch._grouped_mm`` runs ``fp8_grouped_mm`` in the compiled
    graph too (the recipe's fp8 forward and backward GEMMs, not PyTorch's derivative of ``_grouped_mm``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    block = RoutedExperts(cast=False)
    fp8tensor.convert_to_fp8(block)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    eager, compiled = copy.deepcopy(block), copy.deepcopy(block)
    fully_shard(eager, mp_policy=mp)
    fully_shard(compiled, mp_policy=mp)
    torch._dynamo.reset()
    run = torch.compile(compiled, fullgraph=True, backend=backend)
    x, expert, g = _inputs(SIZES[0])
    res = []
    for mod, params in ((eager, eager), (run, compiled)):
        xr = x.clone().requires_grad_()
        y = mod(xr, expert)
        y.backward(g.to(y.dtype))
        res.append((y.detach(), xr.grad, params.w.grad.to_local().clone()))
    diffs = [_rel(c, e) for c, e in zip(res[1], res[0])]
    print(f"FSDP2 experts {param_dtype}, {backend}: compiled vs eager (out, grad_input, grad_weight) "
          + " ".join(f"{d:.1e}" for d in diffs))
    assert max(diffs) <= VS_EAGER, diffs
    extra = BF16 if param_dtype is not None else 0.0  # bf16 operands (FSDP2 casts the inputs)
    for e in range(E):  # the compiled grad_weight against float64: an fp8 GEMM's error (bf16's is ~3e-3)
        rows = expert == e
        if rows.any():
            assert 1e-2 < _rel(res[1][2][e], g[rows].double().t() @ x[rows].double()) <= TWO + extra, e


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, None], ids=["bf16_mp", "float32"])
def test_compiled_fsdp2_torchtitan_grouped_experts_match_eager_fsdp2(one_rank_gloo, param_dtype):
    """torchtitan's ``GroupedExperts`` converted by ``fp8tensor.torchtitan`` under FSDP2 (1 gloo rank), compiled with
    ``fullgraph=True``: output and gradients as the same FSDP2 model's eager step."""
    pytest.importorskip("torchtitan")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchtitan.models.common.moe import GroupedExperts

    from fp8tensor.torchtitan import convert_model_config

    m = convert_model_config(GroupedExperts.Config(dim=K, hidden_dim=2 * K, num_experts=E), recipe="rowwise").build()
    for p in m.parameters():
        nn.init.normal_(p, std=0.1)
    counts, x = torch.tensor([5, 0, 10, 7]), torch.randn(22, K)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    eager, compiled = copy.deepcopy(m), copy.deepcopy(m)
    fully_shard(eager, mp_policy=mp)
    fully_shard(compiled, mp_policy=mp)
    torch._dynamo.reset()
    run = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    res = []
    for mod, params in ((eager, eager), (run, compiled)):
        xr = x.clone().requires_grad_()
        out = mod(xr, counts)
        out.float().pow(2).sum().backward()
        res.append([out.detach(), xr.grad] + [p.grad.to_local().clone() for p in params.parameters()])
    for c, e in zip(res[1], res[0]):
        assert _rel(c, e) <= VS_EAGER


@pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdp2"])
def test_compiled_inductor_gw_hp_bf16_experts_match_float64(one_rank_gloo, fsdp):
    """``recipe="rowwise_gw_hp"`` experts with bf16 operands, compiled with inductor (a token count, 47, whose bf16
    rows are not 16-byte multiples): the high-precision grad_weight GEMM (``torch._grouped_mm(gy.t(), x)``) must get
    operands in the row-major layouts eager gives it; inductor laid ``gy.t()`` out as a fresh ``(N, M)`` buffer
    ("strides should be multiple of 16 bytes"). Under FSDP2 (bf16 mixed precision) this runs since the gathered
    weight became a ``GatheredExperts`` (before, PyTorch's own derivative of ``_grouped_mm`` ran)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    seed = 1234
    print("seed", seed)
    torch.manual_seed(seed)
    block = RoutedExperts(cast=not fsdp)
    fp8tensor.convert_to_fp8(block, recipe="rowwise_gw_hp")
    w = block.w._data.detach().clone()
    if fsdp:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    torch._dynamo.reset()
    run = torch.compile(block, fullgraph=True, backend="inductor")
    x, expert, g = _inputs(SIZES[0])
    xr = x.clone().requires_grad_()
    # (an AOTAutograd cache entry compiled before a change of fp8tensor's backward would be reused: compile afresh)
    with torch._inductor.config.patch(force_disable_caches=True):
        y = run(xr, expert)
        y.backward(g.to(y.dtype))
    gw = block.w.grad.full_tensor() if fsdp else block.w.grad
    xb, wb, gb = (t.bfloat16().double() for t in (x, w, g))
    wt = wb[expert]
    assert _rel(y, torch.einsum("mk,mnk->mn", xb, wt)) <= TWO + BF16
    assert _rel(xr.grad, torch.einsum("mn,mnk->mk", gb, wt)) <= TWO + BF16
    for e in range(E):
        rows = expert == e
        if rows.any():  # high-precision grad_weight: bf16 rounding only
            assert _rel(gw[e], gb[rows].t() @ xb[rows]) <= 2 * BF16, e
        else:
            assert torch.count_nonzero(gw[e]) == 0
