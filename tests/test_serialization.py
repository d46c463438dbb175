"""Serialization of ScaledFp8Tensor and of converted modules: pickle, deepcopy, torch.save/load, state_dict."""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn

from fp8tensor import E4M3, E5M2, Fp8MasterWeight, ScaledFp8Tensor, convert_to_fp8, quantize_weights

from conftest import same_bits


def _assert_same_fp8(a: ScaledFp8Tensor, b: ScaledFp8Tensor, *, shared: bool = False) -> None:
    assert type(b) is ScaledFp8Tensor
    assert same_bits(a.qdata, b.qdata), "fp8 bytes differ"
    assert torch.equal(a.scale, b.scale) and a.scale.shape == b.scale.shape
    assert a.orig_dtype == b.orig_dtype and a.dtype == b.dtype and a.fast_accum == b.fast_accum
    assert a.requires_grad == b.requires_grad and a.shape == b.shape
    assert isinstance(a, nn.Parameter) == isinstance(b, nn.Parameter)
    if not shared:
        assert a.qdata.data_ptr() != b.qdata.data_ptr() and a.scale.data_ptr() != b.scale.data_ptr()


def _variants():
    w = torch.randn(24, 48)
    yield "e4m3-fp32", ScaledFp8Tensor.from_hp(w)
    yield "e5m2-bf16-slowacc", ScaledFp8Tensor.from_hp(w.bfloat16(), E5M2, fast_accum=False)
    yield "requires_grad", ScaledFp8Tensor.from_hp(w).requires_grad_()
    yield "param-frozen", nn.Parameter(ScaledFp8Tensor.from_hp(w), requires_grad=False)
    yield "param-trainable", nn.Parameter(ScaledFp8Tensor.from_hp(w.half()), requires_grad=True)
    yield "transposed", ScaledFp8Tensor.from_hp(w).t()
    yield "3d", ScaledFp8Tensor.from_hp(torch.randn(2, 6, 16))


VARIANTS = dict(_variants())


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("how", ["pickle", "deepcopy", "torch.save+weights_only"])
def test_round_trip_keeps_class_bytes_scales_and_flags(name, how):
    t = VARIANTS[name]
    if how == "pickle":
        out = pickle.loads(pickle.dumps(t))
    elif how == "deepcopy":
        out = copy.deepcopy(t)
    else:
        buf = io.BytesIO()
        torch.save({"t": t}, buf)
        buf.seek(0)
        out = torch.load(buf, weights_only=True)["t"]
    _assert_same_fp8(t, out)
    assert torch.equal(out.to_hp(), t.to_hp())


def test_deepcopy_memo_and_shared_references():
    t = ScaledFp8Tensor.from_hp(torch.randn(8, 16))
    a, b = copy.deepcopy([t, t])
    assert a is b
    _assert_same_fp8(t, a)


@pytest.mark.parametrize("f8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
def test_quantized_state_dict_round_trip(assign, f8):
    src = nn.Sequential(nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 16))
    quantize_weights(src, float8_dtype=f8)
    sd = src.state_dict()
    assert type(sd["0.weight"]) is ScaledFp8Tensor and type(sd["0.bias"]) is torch.Tensor
    # through torch.save / torch.load(weights_only=True)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)

    dst = nn.Sequential(nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 16))
    quantize_weights(dst, float8_dtype=f8)
    res = dst.load_state_dict(sd, assign=assign)
    assert not res.missing_keys and not res.unexpected_keys
    for i in (0, 2):
        w, w_src = dst[i].weight, src[i].weight
        assert type(w) is ScaledFp8Tensor and isinstance(w, nn.Parameter) and not w.requires_grad
        assert same_bits(w.qdata, w_src.qdata) and torch.equal(w.scale, w_src.scale)
        assert torch.equal(dst[i].bias, src[i].bias)
    x = torch.randn(4, 48)
    assert torch.equal(dst(x), src(x))


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
def test_quantized_state_dict_into_plain_linear(assign):
    """A plain nn.Linear accepts an fp8 state dict: copied as dequantized values, or assigned as fp8."""
    src = nn.Linear(48, 32)
    quantize_weights(src)
    dst = nn.Linear(48, 32)
    dst.load_state_dict(src.state_dict(), assign=assign)
    x = torch.randn(4, 48)
    if assign:
        assert type(dst.weight) is ScaledFp8Tensor
        assert torch.equal(dst(x), src(x))
    else:
        assert type(dst.weight) is nn.Parameter
        assert torch.equal(dst.weight.detach(), src.weight.to_hp())


def test_converted_model_checkpoint_holds_plain_tensors():
    """state_dict / pickle of a master-weight model contain plain high-precision tensors (loadable anywhere)."""
    m = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))
    convert_to_fp8(m)
    w = m[0].weight
    assert isinstance(w, Fp8MasterWeight)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert all(type(v) is torch.Tensor for v in sd.values())
    assert torch.equal(sd["0.weight"], w._data)
    p = pickle.loads(pickle.dumps(w))  # a module's master Parameter: a plain Parameter (trainable, as it was)
    assert type(p) is nn.Parameter and p.requires_grad and torch.equal(p.detach(), w._data)
    d = pickle.loads(pickle.dumps(w.detach()))  # a master that is not a Parameter: a plain tensor
    assert type(d) is torch.Tensor and torch.equal(d, w._data)


@pytest.mark.parametrize("convert", ["convert_to_fp8", "quantize_weights"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_whole_converted_module_round_trip(convert, how):
    m = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))
    {"convert_to_fp8": convert_to_fp8, "quantize_weights": quantize_weights}[convert](m)
    x = torch.randn(4, 32)
    y = m(x)
    if how == "deepcopy":
        m2 = copy.deepcopy(m)
    elif how == "pickle":
        m2 = pickle.loads(pickle.dumps(m))
    else:
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        m2 = torch.load(buf, weights_only=False)
    assert torch.equal(m2(x), y)
    if how == "deepcopy" or convert == "quantize_weights":
        assert type(m2[0].weight) is type(m[0].weight)
    # the copy runs its own weights: changing the copy leaves the original alone
    with torch.no_grad():
        m2[2].bias.add_(1.0)
    assert torch.equal(m(x), y)
    assert not torch.equal(m2(x), y)
