"""convert_to_fp8 / quantize_weights on Linears whose ``forward`` a framework wrapped on the instance.

torchtitan's TP (``Module.parallelize``) sets ``lin.forward = wrapper``, where the wrapper redistributes its inputs
and calls the *bound* ``nn.Linear.forward`` it captured. Converting after that must still give the recipe's three
fp8 GEMMs (the captured bound forward is pointed at the fp8 forward); a user's own forward that never calls the
Linear's forward is skipped with a warning; a captured forward fp8tensor cannot reach raises before any change.
"""
from __future__ import annotations

import collections
import copy
import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import E4M3_GEMM_BOUND, count_scaled_mm, dequant_rowwise, rel_err, same_bits
from fp8tensor import Fp8MasterWeight, ScaledFp8Tensor, convert_to_fp8, quantize_weights
from fp8tensor.convert import Fp8LinearMixin



def _warm():
    """Run one fp8 GEMM outside any count (fp8tensor probes the CPU ``_scaled_mm`` once per process)."""
    convert_to_fp8(nn.Linear(16, 16))(torch.randn(2, 16))


# Wrappers a framework may set on the instance; each ends in the bound forward it captured.
def _lambda(lin):
    inner = lin.forward  # the smallest such wrapper
    lin.forward = lambda *a, **k: inner(*a, **k)


def _local_map_like(lin):
    inner = lin.forward  # torch's local_map returns functools.partial(_wrapped, func, ...)
    fn = functools.partial(lambda f, *a: f(*a), inner)

    def forward_with_redistribution(*args, **kwargs):  # torchtitan's Module.parallelize shape
        return fn(*args, **kwargs)

    lin.forward = forward_with_redistribution


def _default_arg(lin):
    lin.forward = lambda x, _f=lin.forward: _f(x)


def _wrapper_object(lin):
    class Wrapper:
        def __init__(self, f):
            self.f = f

        def __call__(self, x):
            return self.f(x)

    lin.forward = Wrapper(lin.forward)


def _partial_on_instance(lin):
    lin.forward = functools.partial(lambda f, x: f(x), lin.forward)


WRAPPERS = [_lambda, _local_map_like, _default_arg, _wrapper_object, _partial_on_instance]


def _reference(x64, w, dim_x=-1):
    """float64 fp8 reference of ``x @ w.T`` with both operands quantized row-wise along K (as the recipe does)."""
    return dequant_rowwise(x64, dim_x) @ dequant_rowwise(w, 1).t()


@pytest.mark.parametrize("wrap", WRAPPERS, ids=lambda f: f.__name__.strip("_"))
def test_wrapped_forward_gets_three_fp8_gemms(wrap):
    """A wrapped forward (a lambda, and the other shapes a framework uses): converted (class, master weight), no
    warning, 3 fp8 GEMMs per forward+backward, and bit-identical to converting the unwrapped Linear; values vs float64 within fp8 bounds."""
    _warm()
    model = nn.Sequential(nn.Linear(64, 48))
    plain = copy.deepcopy(model)
    wrap(model[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_to_fp8(model)
    convert_to_fp8(plain)
    lin = model[0]
    assert isinstance(lin, Fp8LinearMixin) and isinstance(lin.weight, Fp8MasterWeight)
    assert model.fp8_skipped == []
    x = torch.randn(32, 64, requires_grad=True)
    xp = x.detach().clone().requires_grad_()
    with count_scaled_mm() as n:
        y = model(x)
        y.backward(torch.ones_like(y))
    assert n[0] == 3
    yp = plain(xp)
    yp.backward(torch.ones_like(yp))
    assert same_bits(y, yp) and same_bits(x.grad, xp.grad) and same_bits(lin.weight.grad, plain[0].weight.grad)
    ref = _reference(x.detach().double(), lin.weight._data.detach()) + lin.bias.detach().double()
    assert rel_err(y, ref) < E4M3_GEMM_BOUND
    # grad_weight = gy^T x in fp8: against the float64 product it stays within the fp8 GEMM bound
    gw_ref = torch.ones(32, 48, dtype=torch.float64).t() @ x.detach().double()
    assert rel_err(lin.weight.grad, gw_ref) < E4M3_GEMM_BOUND


def test_wrapper_keeps_its_own_work():
    """A wrapper that adds to the captured forward (e.g. a LoRA path around the base Linear) keeps doing so: only
    the base Linear becomes fp8."""
    lin = nn.Linear(64, 64)
    a, b = torch.randn(4, 64) / 8, torch.randn(64, 4) / 8
    inner = lin.forward
    lin.forward = lambda x: inner(x) + x @ a.t() @ b.t()
    convert_to_fp8(lin)
    assert isinstance(lin, Fp8LinearMixin)
    x = torch.randn(8, 64)
    base = F.linear(x, Fp8MasterWeight(lin.weight._data), lin.bias)  # fp8_linear with the same recipe
    assert same_bits(lin(x), base + x @ a.t() @ b.t())


def test_quantize_weights_through_a_wrapper():
    """quantize_weights redirects the wrapper too: the forward runs the fp8 weight (one fp8 GEMM, no grad)."""
    _warm()
    lin = nn.Linear(64, 32)
    w = lin.weight.detach().clone()
    _local_map_like(lin)
    quantize_weights(lin)
    assert isinstance(lin.weight, ScaledFp8Tensor)
    x = torch.randn(8, 64)
    with count_scaled_mm() as n:
        y = lin(x)
    assert n[0] == 1
    assert rel_err(y - lin.bias, _reference(x.double(), w)) < 1e-5


def test_converting_a_wrapped_model_again_switches_the_recipe():
    """The redirected wrapper reads the module's recipe at call time: converting again with another recipe runs it
    (``rowwise_gw_hp``: forward and grad_input in fp8, grad_weight in high precision)."""
    _warm()
    lin = nn.Linear(64, 64)
    _lambda(lin)
    convert_to_fp8(lin)
    convert_to_fp8(lin, recipe="rowwise_gw_hp")
    x = torch.randn(8, 64, requires_grad=True)
    with count_scaled_mm() as n:
        lin(x).sum().backward()
    assert n[0] == 2 and lin.fp8_recipe.name == "rowwise_gw_hp"


def test_custom_forward_without_the_linear_forward_is_skipped():
    """A forward that never calls the Linear's own forward is the user's computation: left alone, with a warning."""
    lin = nn.Linear(64, 64)
    lin.forward = lambda x: F.linear(x, lin.weight) * 2
    with pytest.warns(UserWarning, match=r"a forward set on the instance"):
        convert_to_fp8(lin)
    assert type(lin) is nn.Linear and type(lin.weight) is nn.Parameter


def test_unreachable_captured_forward_raises_before_any_change():
    """A wrapper holding the bound forward where fp8tensor cannot redirect it (an immutable container such as a
    namedtuple): RuntimeError naming the Linear and what to do; nothing in the model changed."""
    Holder = collections.namedtuple("Holder", "f")
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    held = Holder(model[1].forward)
    wrapper = lambda x: held.f(x)  # noqa: E731
    model[1].forward = wrapper
    w0, w1 = model[0].weight, model[1].weight
    with pytest.raises(RuntimeError, match=r"convert_to_fp8: .*'1'.*Convert before parallelizing"):
        convert_to_fp8(model)
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.Linear
    assert model[0].weight is w0 and model[1].weight is w1 and type(w0) is nn.Parameter
    assert model[1].__dict__["forward"] is wrapper and held.f.__func__ is nn.Linear.forward
    with pytest.raises(RuntimeError, match=r"quantize_weights: .*'1'"):
        quantize_weights(model)
    assert model[0].weight is w0 and type(model[0]) is nn.Linear


def test_plain_master_weight_swap_runs_three_fp8_gemms():
    """A direct swap ``lin.weight = Parameter(Fp8MasterWeight(w))`` on a plain Linear: ``F.linear`` reaches the
    master's ``__torch_function__`` and runs fp8_linear (three fp8 GEMMs)."""
    _warm()
    lin = nn.Linear(64, 64)
    lin.weight = nn.Parameter(Fp8MasterWeight(lin.weight.detach().clone()))
    x = torch.randn(8, 64, requires_grad=True)
    with count_scaled_mm() as n:
        lin(x).sum().backward()
    assert n[0] == 3


def test_torchtitan_module_imports_without_torchtitan():
    """fp8tensor.torchtitan imports without torchtitan; using its classes raises an ImportError saying what to
    install (a fresh interpreter with ``torchtitan`` made unimportable)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torchtitan'] = None\n"
        "import fp8tensor.torchtitan as t\n"
        "try:\n    t.Fp8TensorConverter\nexcept ImportError as e:\n    print('IMPORTERROR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "IMPORTERROR fp8tensor.torchtitan.Fp8TensorConverter needs torchtitan 0.3.0" in out.stdout
    assert "pip install torchtitan==0.3.0" in out.stdout
