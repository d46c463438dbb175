"""Module conversion (fp8tensor/conversion/convert.py): convert_to_fp8 and quantize_weights on plain (non-distributed) modules."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pickle
from pathlib import Path

from fp8tensor.convert import Fp8Linear, Fp8LinearMixin
from fp8tensor import E5M2, Fp8MasterWeight, ScaledFp8Tensor, convert_to_fp8, fp8_linear, quantize_weights

from conftest import E4M3_BLOCK_BOUND, E4M3_GEMM_BOUND, E5M2_BLOCK_BOUND, dequant, rel_err, same_bits


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 64)
        self.norm = nn.LayerNorm(64)
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64, bias=False))
        self.head = nn.Linear(64, 32)

    def forward(self, idx):
        h = self.emb(idx)
        return self.head(h + self.mlp(self.norm(h)))


LINEARS = ["mlp.0", "mlp.2", "head"]


def _snapshot(model):
    """Everything conversion may touch: state dict values, parameter objects and types, instance attributes."""
    return (
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        {n: (p, type(p), p.requires_grad) for n, p in model.named_parameters()},
        {n: set(vars(m)) - {"_forward_pre_hooks"} for n, m in model.named_modules()},
        {n: type(m) for n, m in model.named_modules()},
    )


def _assert_unchanged(model, snap):
    sd, params, attrs, classes = snap
    now = model.state_dict()
    assert now.keys() == sd.keys()
    for k, v in sd.items():
        assert type(now[k]) is type(v) and same_bits(now[k].detach(), v), k
    for n, p in model.named_parameters():
        assert params[n][0] is p and type(p) is params[n][1] and p.requires_grad == params[n][2], n
    for n, m in model.named_modules():
        assert set(vars(m)) - {"_forward_pre_hooks"} == attrs[n], n
        assert "forward" not in vars(m) and not hasattr(m, "fp8_recipe"), n
        assert type(m) is classes[n], n


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp"])
def test_convert_to_fp8_swaps_linears_only(recipe):
    model = Block()
    ref = copy.deepcopy(model)
    out = convert_to_fp8(model, recipe=recipe)
    assert out is model and model.fp8_skipped == []
    mods = dict(model.named_modules())
    for name in LINEARS:
        lin = mods[name]
        assert type(lin.weight) is Fp8MasterWeight and isinstance(lin.weight, nn.Parameter)
        assert lin.weight.requires_grad and lin.weight.recipe.name == recipe and lin.fp8_recipe.name == recipe
        assert torch.equal(lin.weight._data, dict(ref.named_modules())[name].weight)
        assert type(lin) is Fp8Linear and isinstance(lin, nn.Linear) and "forward" not in vars(lin)
    assert type(model.emb) is nn.Embedding and type(model.norm) is nn.LayerNorm
    assert type(model.emb.weight) is nn.Parameter and type(model.norm.weight) is nn.Parameter
    idx = torch.randint(0, 10, (3, 5))
    y, y_ref = model(idx), ref(idx)
    assert 1e-3 < rel_err(y, y_ref) <= E4M3_BLOCK_BOUND
    x = torch.randn(4, 64)
    assert torch.equal(model.head(x), fp8_linear(x, model.head.weight, model.head.bias, recipe=recipe))
    # converting again is a no-op (no double wrapping)
    w = model.head.weight
    convert_to_fp8(model, recipe=recipe)
    assert model.head.weight is w and type(w._data) is torch.Tensor


def test_module_filter_fn_is_respected():
    model = Block()
    seen = []

    def only_mlp(mod, fqn):
        seen.append((type(mod).__name__, fqn))
        return fqn.startswith("mlp.")

    convert_to_fp8(model, module_filter_fn=only_mlp)
    assert sorted(seen) == sorted(("Linear", n) for n in LINEARS)  # called once per Linear, with its fqn
    assert type(model.mlp[0].weight) is Fp8MasterWeight and type(model.mlp[2].weight) is Fp8MasterWeight
    assert type(model.head.weight) is nn.Parameter and "forward" not in vars(model.head)
    x = torch.randn(4, 64)
    assert torch.equal(model.head(x), F.linear(x, model.head.weight, model.head.bias))

    q = Block()
    quantize_weights(q, module_filter_fn=lambda mod, fqn: fqn == "head")
    assert type(q.head.weight) is ScaledFp8Tensor
    assert type(q.mlp[0].weight) is nn.Parameter and type(q.mlp[2].weight) is nn.Parameter


def test_layers_not_multiple_of_16_stay_high_precision_and_are_reported():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 10), nn.Linear(10, 64), nn.Linear(24, 32))
    with pytest.warns(UserWarning, match=r"left in high precision.*1 \(64->10\), 2 \(10->64\), 3 \(24->32\)"):
        convert_to_fp8(model)
    assert model.fp8_skipped == ["1 (64->10)", "2 (10->64)", "3 (24->32)"]
    assert type(model[0].weight) is Fp8MasterWeight
    for i in (1, 2, 3):
        assert type(model[i].weight) is nn.Parameter and "forward" not in vars(model[i])
    # a model with nothing to skip does not warn
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_to_fp8(nn.Linear(32, 48))


def test_converted_state_dict_loads_into_unconverted_and_back():
    conv = Block()
    convert_to_fp8(conv)
    plain = Block()
    sd = conv.state_dict()
    assert sd.keys() == plain.state_dict().keys()
    assert all(type(v) is torch.Tensor for v in sd.values())
    plain.load_state_dict(sd)  # strict
    assert all(type(p) is nn.Parameter for p in plain.parameters())
    for k, v in plain.state_dict().items():
        assert torch.equal(v, sd[k]), k

    # unconverted -> converted, copying into the existing master weights
    src = Block()
    target = Block()
    convert_to_fp8(target)
    w = target.head.weight
    target.load_state_dict(src.state_dict())
    assert target.head.weight is w and type(w) is Fp8MasterWeight
    for name in LINEARS:
        assert torch.equal(dict(target.named_modules())[name].weight._data, dict(src.named_modules())[name].weight)

    # unconverted -> converted with assign=True: the loaded tensors are wrapped again
    target2 = Block()
    convert_to_fp8(target2)
    target2.load_state_dict(src.state_dict(), assign=True)
    for name in LINEARS:
        lw = dict(target2.named_modules())[name].weight
        assert type(lw) is Fp8MasterWeight and isinstance(lw, nn.Parameter) and lw.requires_grad
        assert torch.equal(lw._data, dict(src.named_modules())[name].weight)
    idx = torch.randint(0, 10, (2, 3))
    target2(idx).sum().backward()
    assert type(target2.head.weight.grad) is torch.Tensor
    assert rel_err(target2(idx), src(idx)) <= E4M3_BLOCK_BOUND


@pytest.mark.parametrize("f8", [torch.float8_e4m3fn, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_weights(f8):
    model = Block()
    ref = copy.deepcopy(model)
    assert quantize_weights(model, float8_dtype=f8) is model
    for name in LINEARS:
        w = dict(model.named_modules())[name].weight
        assert type(w) is ScaledFp8Tensor and isinstance(w, nn.Parameter) and not w.requires_grad
        assert w.qdata.dtype == f8 and tuple(w.scale.shape) == (w.shape[0], 1)
        assert torch.equal(w.to_hp(), ScaledFp8Tensor.from_hp(dict(ref.named_modules())[name].weight.detach(), f8).to_hp())
    idx = torch.randint(0, 10, (3, 5))
    bound = E4M3_BLOCK_BOUND if f8 == torch.float8_e4m3fn else E5M2_BLOCK_BOUND
    assert rel_err(model(idx), ref(idx)) <= bound


def test_quantize_weights_after_convert_to_fp8_uses_master_values():
    model = Block()
    convert_to_fp8(model)
    master = model.head.weight._data.clone()
    quantize_weights(model)
    assert type(model.head.weight) is ScaledFp8Tensor
    assert torch.equal(model.head.weight.to_hp(), ScaledFp8Tensor.from_hp(master).to_hp())


# ---------------------------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    "case",
    ["unknown_recipe", "filter_raises", "filter_not_callable", "q_filter_raises", "q_bad_float8", "q_filter_not_callable"],
)
def test_bad_arguments_leave_model_unchanged(case):
    model = Block()
    snap = _snapshot(model)

    def boom(mod, fqn):
        if fqn == "mlp.2":
            raise KeyError("no such layer")
        return True

    fn, exc, msg = {
        "unknown_recipe": (lambda: convert_to_fp8(model, recipe="tensorwise"), ValueError, r"unknown recipe 'tensorwise'"),
        "filter_raises": (lambda: convert_to_fp8(model, module_filter_fn=boom), RuntimeError, r"convert_to_fp8: module_filter_fn raised for module 'mlp\.2'; the model was not changed"),
        "filter_not_callable": (lambda: convert_to_fp8(model, module_filter_fn="mlp"), TypeError, r"convert_to_fp8: module_filter_fn must be callable"),
        "q_filter_raises": (lambda: quantize_weights(model, module_filter_fn=boom), RuntimeError, r"quantize_weights: module_filter_fn raised for module 'mlp\.2'"),
        "q_bad_float8": (lambda: quantize_weights(model, float8_dtype=torch.float8_e4m3fnuz), TypeError, r"quantize_weights: unsupported float8 dtype"),
        "q_filter_not_callable": (lambda: quantize_weights(model, module_filter_fn=3), TypeError, r"quantize_weights: module_filter_fn must be callable"),
    }[case]
    with pytest.raises(exc, match=msg) as e:
        fn()
    if case.endswith("filter_raises"):
        assert isinstance(e.value.__cause__, KeyError)  # the original error is chained
    _assert_unchanged(model, snap)


@pytest.mark.parametrize("convert", [convert_to_fp8, quantize_weights], ids=["convert_to_fp8", "quantize_weights"])
@pytest.mark.parametrize("bad", [nn.Linear, "model", torch.randn(4, 4), None], ids=["class", "str", "tensor", "None"])
def test_non_module_is_rejected(convert, bad):
    with pytest.raises(TypeError, match=rf"{convert.__name__}: expected an nn.Module, got"):
        convert(bad)


class ScaledLinear(nn.Linear):
    """A user subclass of nn.Linear (its own __init__ argument and attribute)."""

    def __init__(self, i, o, gain=2.0):
        super().__init__(i, o)
        self.gain = gain


class _Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = ScaledLinear(64, 32)
        self.b = nn.Linear(32, 16)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("convert", [convert_to_fp8, quantize_weights], ids=["convert_to_fp8", "quantize_weights"])
def test_converted_classes_keep_isinstance_and_pickle(convert):
    """A converted module's class derives from its original class (nn.Linear subclasses included), one class per
    original class; the whole converted model pickles and reloads to the same outputs."""
    model = _Holder()
    convert(model)
    assert isinstance(model.a, ScaledLinear) and isinstance(model.a, Fp8LinearMixin) and model.a.gain == 2.0
    assert type(model.b) is Fp8Linear
    other = convert(_Holder())
    assert type(other.a) is type(model.a)  # shared, so compiled code and pickles see one class
    x = torch.randn(5, 64)
    back = pickle.loads(pickle.dumps(model))
    assert type(back.a) is type(model.a) and type(back.b) is Fp8Linear
    assert same_bits(back(x), model(x))
    if convert is convert_to_fp8:  # the state dict holds plain weights: an unconverted copy gives the hp result
        ref = _Holder()
        ref.load_state_dict(model.state_dict())
        assert rel_err(model(x), ref(x)) <= 2 * E4M3_GEMM_BOUND


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 64)
        self.down = nn.Linear(64, 64)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


def test_compile_shares_one_graph_across_converted_layers():
    """Identical converted layers compile once: dynamo guards on the module class, not on a per-instance forward
    (a per-instance forward would recompile for every layer and hit dynamo's recompile limit)."""
    from torch import _dynamo

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    _dynamo.reset()
    layers = nn.ModuleList(_Mlp() for _ in range(10))
    convert_to_fp8(layers)
    for layer in layers:
        layer.compile(backend=backend)
    x = torch.randn(8, 64, requires_grad=True)
    h = x
    for layer in layers:
        h = layer(h)
    h.sum().backward()
    _dynamo.reset()
    assert len(graphs) == 1, f"{len(graphs)} graphs compiled for 10 identical converted layers"
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_converted_subclass_model_loads_in_a_fresh_process(tmp_path):
    """A whole converted model whose Linears are user subclasses pickles by the original class: a process that
    never called convert_to_fp8 loads it (and gets the converted class back); two user classes with the same
    name in different modules do not collide."""
    import subprocess
    import sys

    (tmp_path / "mods_a.py").write_text("import torch.nn as nn\nclass Proj(nn.Linear):\n    pass\n")
    pkg = tmp_path / "mods"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import torch.nn as nn\nclass Proj(nn.Linear):\n    pass\n")
    root = str(Path(__file__).resolve().parents[1])
    save = f"""
import sys, torch, torch.nn as nn
sys.path[:0] = [{str(tmp_path)!r}, {root!r}]
import mods_a, mods.a
from fp8tensor import convert_to_fp8
torch.manual_seed(0)
m = convert_to_fp8(nn.Sequential(mods_a.Proj(32, 32), mods.a.Proj(32, 16)))
x = torch.randn(4, 32)
torch.save({{"model": m, "x": x, "y": m(x).detach()}}, {str(tmp_path / "m.pt")!r})
"""
    load = f"""
import sys, torch
sys.path[:0] = [{str(tmp_path)!r}, {root!r}]
import mods_a, mods.a
from fp8tensor.convert import Fp8LinearMixin
d = torch.load({str(tmp_path / "m.pt")!r}, weights_only=False)
m = d["model"]
assert isinstance(m[0], mods_a.Proj) and isinstance(m[0], Fp8LinearMixin), type(m[0]).__mro__
assert isinstance(m[1], mods.a.Proj) and not isinstance(m[1], mods_a.Proj), type(m[1]).__mro__
assert torch.equal(m(d["x"]), d["y"])
print("LOADED")
"""
    for code in (save, load):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED" in proc.stdout


class LoraLinear(nn.Linear):
    """A Linear with its own forward (a low-rank path added to the base projection)."""

    def __init__(self, i, o, r=4):
        super().__init__(i, o)
        self.a = nn.Parameter(torch.randn(r, i) * 0.1)
        self.b = nn.Parameter(torch.randn(o, r) * 0.1)

    def forward(self, x):
        return super().forward(x) + x @ self.a.t() @ self.b.t()


@pytest.mark.parametrize("convert", [convert_to_fp8, quantize_weights], ids=["convert_to_fp8", "quantize_weights"])
def test_linears_with_their_own_forward_are_left_alone(convert):
    """Conversion would replace a user's forward (dropping e.g. a LoRA path): such Linears are skipped, with a
    warning naming them; plain Linears next to them are converted."""
    model = nn.Sequential(LoraLinear(64, 64), nn.Linear(64, 32))
    inst = nn.Linear(32, 32)
    inst.forward = lambda x: x  # a forward set on the instance (e.g. by another library's hook)
    model.append(inst)
    x = torch.randn(3, 64)
    ref = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"0 \(LoraLinear.forward overrides nn.Linear.forward\).*2 \(a forward set"):
        convert(model)
    assert type(model[0]) is LoraLinear and type(model[0].weight) is nn.Parameter
    assert type(model[2]) is nn.Linear and type(model[2].weight) is nn.Parameter
    assert isinstance(model[1], Fp8LinearMixin)
    assert same_bits(model[0](x), ref[0](x))
    if convert is convert_to_fp8:
        assert model.fp8_skipped == ["0 (LoraLinear.forward overrides nn.Linear.forward)", "2 (a forward set on the instance)"]


def test_converting_again_switches_the_recipe():
    """convert_to_fp8 on a converted model with another recipe switches it (no double wrapping); the result equals
    converting the unconverted model with that recipe directly."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    a = convert_to_fp8(copy.deepcopy(base), recipe="rowwise")
    w = a[0].weight
    convert_to_fp8(a, recipe="rowwise_gw_hp")
    assert a[0].weight is w and a[0].fp8_recipe.name == "rowwise_gw_hp" and w.recipe.name == "rowwise_gw_hp"
    b = convert_to_fp8(copy.deepcopy(base), recipe="rowwise_gw_hp")
    x = torch.randn(8, 64, requires_grad=True)
    xb = x.detach().clone().requires_grad_()
    a(x).sum().backward()
    b(xb).sum().backward()
    assert same_bits(x.grad, xb.grad)
    assert same_bits(a[0].weight.grad, b[0].weight.grad)


def test_parametrized_weight_is_skipped_with_a_warning():
    """A weight-norm (parametrized) Linear has no single weight tensor to swap: left in high precision, named in
    the warning, model unchanged; the plain Linear next to it is converted."""
    from torch.nn.utils.parametrizations import weight_norm

    model = nn.Sequential(weight_norm(nn.Linear(64, 64)), nn.Linear(64, 32))
    x = torch.randn(4, 64)
    ref = model[0](x)
    with pytest.warns(UserWarning, match=r"0 \(weight is parametrized\)"):
        convert_to_fp8(model)
    assert not isinstance(model[0], Fp8LinearMixin) and same_bits(model[0](x), ref)
    assert isinstance(model[1], Fp8LinearMixin)


@pytest.mark.parametrize("weight", ["int8", "float8", "lazy"])
@pytest.mark.parametrize("how", ["convert_to_fp8", "convert_fp8_all_gather", "quantize_weights"])
def test_weights_that_cannot_be_quantized_are_skipped_before_anything_changes(how, weight):
    """A Linear whose weight is not a high-precision float (an integer or a plain float8 tensor: no scales to read it
    by) or not materialized yet (a lazy module) is left as it is, named in the warning (and ``fp8_skipped``); the
    Linear before it is converted, the forward runs. Before: an error raised half-way through (the model half
    converted), a raw ``isfinite`` error, or a converted lazy Linear failing in its first forward."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32))
    if weight == "lazy":
        model[1] = nn.LazyLinear(32)
    else:
        dtype = torch.int8 if weight == "int8" else torch.float8_e4m3fn
        model[1].weight = nn.Parameter(torch.randn(32, 64).to(dtype), requires_grad=False)
    w1 = model[1].weight
    why = {"lazy": r"weight is uninitialized \(a lazy module\)", "int8": r"a torch\.int8 weight",
           "float8": r"a torch\.float8_e4m3fn weight"}[weight]
    with pytest.warns(UserWarning, match=rf"left in high precision: 1 \({why}"):
        if how == "quantize_weights":
            quantize_weights(model)
        else:
            convert_to_fp8(model, fp8_all_gather=how == "convert_fp8_all_gather")
    assert isinstance(model[0], Fp8LinearMixin) and not isinstance(model[1], Fp8LinearMixin)
    assert model[1].weight is w1
    if how != "quantize_weights":
        assert len(model.fp8_skipped) == 1 and model.fp8_skipped[0].startswith("1 (")
    if weight == "lazy":  # materialized by its first forward, as without fp8tensor
        x = torch.randn(3, 64)
        ref = x.double() @ dequant(model[0].weight).double().t() + model[0].bias.double()
        y = model(x)
        assert type(model[1]) is nn.Linear and y.shape == (3, 32)
        assert rel_err(model[0](x), ref) <= E4M3_GEMM_BOUND


def test_optimizer_built_before_conversion_keeps_training_or_is_warned_about():
    """An optimizer built before ``convert_to_fp8`` keeps updating the model (the master is swapped into the old
    Parameter). Where the swap cannot happen (a weak reference to the weight is alive), the module gets a new
    Parameter and ``convert_to_fp8`` warns, naming the weight, that the old one no longer updates the model."""
    import weakref

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 32))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_to_fp8(m)
    before = m[0].weight._data.clone()
    m(torch.randn(4, 64)).sum().backward()
    opt.step()
    assert opt.param_groups[0]["params"][0] is m[0].weight and not torch.equal(m[0].weight._data, before)

    m2 = nn.Sequential(nn.Linear(64, 32))
    keep = weakref.ref(m2[0].weight)  # (blocks torch.utils.swap_tensors)
    with pytest.warns(UserWarning, match=r"convert_to_fp8: 0\.weight \(32, 64\) could not be swapped in place.*optimizer"):
        convert_to_fp8(m2)
    assert type(m2[0].weight) is Fp8MasterWeight and keep() is not m2[0].weight
