"""The size-aware choice of :func:`fp8tensor.convert_to_fp8` (``size_rule``, :func:`fp8tensor.convert.fp8_size_rule`):
Linears too small for fp8 to pay for its quantizations stay in high precision when asked, and only then."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fp8tensor
from fp8tensor.convert import fp8_size_rule
from fp8tensor.master import Fp8MasterWeight

from conftest import set_knobs


@pytest.mark.parametrize("k, n, fp8", [
    (2048, 2048, True), (2048, 5632, True), (5632, 2048, True), (4096, 4096, True), (1024, 4096, True),
    (4096, 1024, True), (8192, 28672, True),
    (1024, 1024, False), (768, 3072, False), (4096, 16, False), (16, 16, False), (0, 64, False),
])
def test_rule_values(k, n, fp8):
    assert fp8_size_rule(k, n) is fp8
    assert fp8_size_rule(n, k) is fp8  # symmetric in K and N


def test_rule_threshold_is_exact(monkeypatch):
    set_knobs(monkeypatch, size_rule_min=1024)
    assert fp8_size_rule(2048, 2048)  # 2048 * 2048 / 4096 == 1024
    assert not fp8_size_rule(2048, 2032)


def _model():
    return nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 2048), nn.Linear(2048, 2048, bias=False))


def test_convert_with_size_rule_keeps_small_linears():
    model = _model()
    w0 = model[0].weight
    fp8tensor.convert_to_fp8(model, size_rule=True)
    assert model.fp8_skipped == ["0 (64->32, size rule)", "1 (32->2048, size rule)"]
    assert type(model[0]) is nn.Linear and model[0].weight is w0 and not isinstance(w0, Fp8MasterWeight)
    assert isinstance(model[2].weight, Fp8MasterWeight) and isinstance(model[2], fp8tensor.convert.Fp8LinearMixin)
    x = torch.randn(4, 64)
    ref = nn.functional.linear(nn.functional.linear(x, model[0].weight, model[0].bias), model[1].weight,
                               model[1].bias)
    assert torch.equal(model[1](model[0](x)), ref)  # the high-precision Linears run as before


def test_convert_default_converts_everything_selected(monkeypatch):
    model = _model()
    fp8tensor.convert_to_fp8(model)  # size_rule None: the configured default (False)
    assert model.fp8_skipped == [] and all(isinstance(m.weight, Fp8MasterWeight) for m in model)
    set_knobs(monkeypatch, size_rule=True)
    model = _model()
    with pytest.warns(UserWarning, match="size rule"):
        fp8tensor.convert_to_fp8(model)
    assert len(model.fp8_skipped) == 2
    model = _model()
    fp8tensor.convert_to_fp8(model, size_rule=False)  # the argument wins over the default
    assert model.fp8_skipped == []


def test_size_rule_after_module_filter():
    model = _model()
    fp8tensor.convert_to_fp8(model, size_rule=True, module_filter_fn=lambda m, fqn: fqn != "2")
    assert type(model[2]) is nn.Linear  # left out by the filter: not listed
    assert model.fp8_skipped == ["0 (64->32, size rule)", "1 (32->2048, size rule)"]


def test_size_rule_argument_must_be_a_bool():
    import torch.nn as nn

    import fp8tensor

    model = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(TypeError, match="convert_to_fp8: size_rule must be None, True or False, got 'yes'"):
        fp8tensor.convert_to_fp8(model, size_rule="yes")
    assert type(model[0]) is nn.Linear  # unchanged


@pytest.mark.parametrize("k, n, expect", [
    (1024, 1024, None), (1024, 256, None), (768, 3072, None),          # K·N/(K+N) 512, 205, 614: high precision
    (1024, 2752, "rowwise_gw_hp"), (2048, 1024, "rowwise_gw_hp"),       # 746, 683: fp8 with grad_weight in hp
    (1024, 4096, "rowwise_gw_hp"),                                     # 819
    (2048, 2048, "rowwise"), (2048, 8192, "rowwise"), (4096, 14336, "rowwise"),  # 1024 (exact), 1638, 3186
])
def test_size_choice_tiers(k, n, expect):
    from fp8tensor.convert import fp8_size_choice

    for a, b in ((k, n), (n, k)):
        got = fp8_size_choice(a, b, "rowwise")
        assert (got.name if got is not None else None) == expect, (a, b)
        hp = fp8_size_choice(a, b, "rowwise_gw_hp")  # the rowwise_gw_hp recipe is never changed, only dropped
        assert (hp.name if hp is not None else None) == (None if expect is None else "rowwise_gw_hp")


def test_size_choice_middle_tier_off_and_errors(monkeypatch):
    from fp8tensor.convert import fp8_size_choice

    set_knobs(monkeypatch, size_rule_fp8_grad_weight_min=640)  # at most size_rule_min: no middle tier
    assert fp8_size_choice(1024, 2752, "rowwise").name == "rowwise"
    with pytest.raises(ValueError, match="recipe"):
        fp8_size_choice(1024, 2752, "no_such_recipe")
    for bad in (0, -1.0, float("inf"), "1024", True):
        with pytest.raises(ValueError, match="size_rule_fp8_grad_weight_min"):
            fp8tensor.set_config(size_rule_fp8_grad_weight_min=bad)


def test_convert_middle_tier_trains_as_rowwise_gw_hp():
    """A mid-sized Linear converted under the size rule computes what the rowwise_gw_hp recipe computes (same bits),
    is listed in ``fp8_grad_weight_hp``, and its grad_weight is the high-precision product (float64 bound)."""
    torch.manual_seed(0)
    big = nn.Sequential(nn.Linear(1024, 2752, bias=False))  # K·N/(K+N) = 746
    ref = nn.Sequential(nn.Linear(1024, 2752, bias=False))
    ref.load_state_dict(big.state_dict())
    fp8tensor.convert_to_fp8(big, size_rule=True)
    fp8tensor.convert_to_fp8(ref, recipe="rowwise_gw_hp")
    assert big.fp8_grad_weight_hp == ["0 (1024->2752)"] and big.fp8_skipped == []
    assert big[0].fp8_recipe.name == "rowwise_gw_hp" and big[0].weight.recipe.name == "rowwise_gw_hp"
    x = torch.randn(64, 1024, dtype=torch.float64).float()
    g = torch.randn(64, 2752)
    outs = []
    for m in (big, ref):
        xx = x.clone().requires_grad_()
        y = m(xx)
        y.backward(g)
        outs.append((y.detach(), xx.grad, m[0].weight.grad.clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    gw64 = g.double().t() @ x.double()
    err = (outs[0][2].double() - gw64).norm() / gw64.norm()
    assert err < 1e-5  # grad_weight in high precision (float32 here): no fp8 rounding in it
    fp8tensor.convert_to_fp8(big, size_rule=False)  # converting again without the rule: the requested recipe
    assert big[0].fp8_recipe.name == "rowwise" and big.fp8_grad_weight_hp == []


def test_size_choice_keeps_a_custom_recipe_fields():
    from fp8tensor.convert import fp8_size_choice
    from fp8tensor.recipes import Gemm, Recipe, weight_format

    fast = Recipe("rowwise", grad_input=Gemm(fast_accum=True), grad_weight=Gemm(fast_accum=True))
    got = fp8_size_choice(1280, 1280, fast)  # K·N/(K+N) = 640: the middle tier
    assert got.name == "rowwise_gw_hp" and got.grad_weight_fp8 is False and got.fast_accum_backward is True
    e5 = weight_format(fp8tensor.RECIPES["rowwise"], torch.float8_e5m2)
    got = fp8_size_choice(1280, 1280, e5)
    assert got.grad_weight_fp8 is False and got.float8_dtype == torch.float8_e5m2
    assert fp8_size_choice(2048, 2048, e5) is e5  # above both thresholds: the recipe itself
    assert fp8_size_choice(1280, 1280, "rowwise") is fp8tensor.RECIPES["rowwise_gw_hp"]  # the stock one


def test_size_rule_on_a_converted_model_warns_for_what_it_cannot_undo():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(1280, 1280))
    fp8tensor.convert_to_fp8(model)
    with pytest.warns(UserWarning, match=r"already converted.*0 \(64->64\)"):
        fp8tensor.convert_to_fp8(model, size_rule=True)
    assert model[0].fp8_recipe.name == "rowwise" and model[1].fp8_recipe.name == "rowwise_gw_hp"
    assert model.fp8_grad_weight_hp == ["1 (1280->1280)"]
