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
