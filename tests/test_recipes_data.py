"""Recipes are data: a :class:`fp8tensor.Recipe` names, for each of the Linear's three GEMMs, each operand's scaling
and fp8 format and the accumulation; the one Linear path honours every combination, with no function per recipe.

Each recipe below runs a converted Linear's forward and backward in float32; every GEMM is checked against float64:
an fp8 GEMM within the fp8 bound (e4m3 activations; e4m3 or e5m2 weight side), a high-precision one within float32
rounding. The number of ``torch._scaled_mm`` calls equals the number of fp8 GEMMs the recipe names.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fp8tensor
from fp8tensor.recipes import Gemm, Operand, Recipe, weight_format

from conftest import E4M3_GEMM_BOUND, E5M2_GEMM_BOUND, count_scaled_mm, rel_err

HP = Operand("hp")
HP_BOUND = 1e-5  # float32 GEMM against float64 (sqrt(K) * 2^-24 with margin)

RECIPES = {
    "rowwise": fp8tensor.RECIPES["rowwise"],
    "rowwise_gw_hp": fp8tensor.RECIPES["rowwise_gw_hp"],
    "grad_input_hp": Recipe("grad_input_hp", grad_input=Gemm(HP, HP)),
    "forward_only": Recipe("forward_only", grad_input=Gemm(HP, HP), grad_weight=Gemm(HP, HP)),
    "backward_only": Recipe("backward_only", output=Gemm(HP, HP)),
    "all_hp": Recipe("all_hp", output=Gemm(HP, HP), grad_input=Gemm(HP, HP), grad_weight=Gemm(HP, HP)),
    "e5m2_weights": weight_format(fp8tensor.RECIPES["rowwise"], torch.float8_e5m2),
    "fast_everywhere": Recipe("fast", grad_input=Gemm(fast_accum=True), grad_weight=Gemm(fast_accum=True)),
}


def _bound(g: Gemm) -> float:
    if not g.fp8:
        return HP_BOUND
    return E5M2_GEMM_BOUND if g.b.float8_dtype == torch.float8_e5m2 else E4M3_GEMM_BOUND


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_gemm_follows_the_recipe(name):
    r = RECIPES[name]
    M, K, N = 96, 64, 48
    lin = fp8tensor.convert_to_fp8(nn.Linear(K, N, bias=False), recipe=r)
    assert lin.fp8_recipe == r
    x = torch.randn(M, K, requires_grad=True)
    gy = torch.randn(M, N)
    lin(x).backward(gy)  # (the CPU backend probes torch._scaled_mm once per format pair: not counted below)
    x.grad = lin.weight.grad = None
    with count_scaled_mm() as n:
        y = lin(x)
        y.backward(gy)
    w = lin.weight._data.double()
    xd, gyd = x.detach().double(), gy.double()
    assert rel_err(y, xd @ w.t()) <= _bound(r.output)
    assert rel_err(x.grad, gyd @ w) <= _bound(r.grad_input)
    assert rel_err(lin.weight.grad, gyd.t() @ xd) <= _bound(r.grad_weight)
    assert n[0] == sum(g.fp8 for g in (r.output, r.grad_input, r.grad_weight))


def test_a_recipe_is_a_frozen_value_stored_at_conversion():
    r = RECIPES["grad_input_hp"]
    with pytest.raises(Exception):
        r.name = "other"  # frozen
    assert r == Recipe("grad_input_hp", grad_input=Gemm(HP, HP)) and hash(r) == hash(
        Recipe("grad_input_hp", grad_input=Gemm(HP, HP)))
    lin = fp8tensor.convert_to_fp8(nn.Linear(32, 16), recipe=r)
    assert lin.fp8_recipe is r and lin.weight.recipe is r


def test_construction_errors_name_the_field():
    """Wrong types raise a TypeError naming the field (not an AttributeError from inside the dataclass); a scaling
    given as a string is read as its Operand; weight_format takes a recipe name too."""
    from fp8tensor.recipes import Gemm, Operand, Recipe, weight_format

    assert Gemm("hp", "hp") == Gemm(Operand("hp"), Operand("hp")) and not Gemm("hp", "hp").fp8
    with pytest.raises(TypeError, match="Gemm: a must be an Operand"):
        Gemm(a=3)
    with pytest.raises(ValueError, match="tensor-wise scaling is not offered"):
        Gemm("tensorwise", "tensorwise")
    with pytest.raises(TypeError, match="Recipe 'x': grad_weight must be a Gemm"):
        Recipe("x", grad_weight="hp")
    with pytest.raises(TypeError, match="Recipe: name must be a string"):
        Recipe(None)
    r = weight_format("rowwise", torch.float8_e5m2)
    assert r.output.b.float8_dtype == r.grad_input.b.float8_dtype == torch.float8_e5m2
    assert r.output.a.float8_dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="unknown recipe"):
        weight_format("no_such_recipe", torch.float8_e5m2)
    all_hp = Recipe("all_hp", output=Gemm("hp", "hp"), grad_input=Gemm("hp", "hp"), grad_weight=Gemm("hp", "hp"))
    with pytest.raises(ValueError, match="float8_dtype must be"):
        weight_format(all_hp, torch.float32)
    with pytest.raises(TypeError, match="a recipe is a name"):
        fp8tensor.convert_to_fp8(nn.Linear(16, 16), recipe=["rowwise"])


def test_grouped_backward_accumulation_follows_grouped_fast_accum(monkeypatch):
    """``fp8_grouped_mm``'s backward GEMMs accumulate fast by default (``Recipe.grouped_fast_accum``); with it off
    they follow ``grad_input`` / ``grad_weight`` as the Linear's do. The forward follows ``output``. A Recipe
    unpickled from before the field reads its default; a non-bool raises."""
    import fp8tensor.training.grouped as grouped

    calls = []
    for name in ("grouped_2d3d", "grouped_2d2d"):
        orig = getattr(grouped, name)
        monkeypatch.setattr(grouped, name, lambda *a, _o=orig, _n=name, **k: (calls.append((_n, k["fast_accum"])),
                                                                              _o(*a, **k))[1])
    g = torch.Generator().manual_seed(0)
    a = torch.randn(40, 32, generator=g, requires_grad=True)
    b = torch.randn(3, 32, 16, generator=g, requires_grad=True)
    offs = torch.tensor([16, 16, 40], dtype=torch.int32)  # (an empty group too)
    cases = {
        "default": (fp8tensor.RECIPES["rowwise"], [True, True]),
        "off": (Recipe("off", grouped_fast_accum=False), [False, False]),
        "off, fast grad_weight": (Recipe("gw", grouped_fast_accum=False, grad_weight=Gemm(fast_accum=True)),
                                  [False, True]),
        "slow forward": (Recipe("slow_fwd", output=Gemm()), [True, True]),
    }
    for what, (recipe, (want_gi, want_gw)) in cases.items():
        calls.clear()
        fp8tensor.fp8_grouped_mm(a, b, offs, recipe=recipe).sum().backward()
        assert calls == [("grouped_2d3d", recipe.output.fast_accum), ("grouped_2d3d", want_gi),
                         ("grouped_2d2d", want_gw)], (what, calls)
    old = object.__new__(Recipe)  # a Recipe pickled before the field: its __dict__ lacks it
    old.__dict__.update({k: v for k, v in fp8tensor.RECIPES["rowwise"].__dict__.items() if k != "grouped_fast_accum"})
    assert old.grouped_fast_accum is True
    with pytest.raises(ValueError, match="grouped_fast_accum must be True or False"):
        Recipe("x", grouped_fast_accum=1)
