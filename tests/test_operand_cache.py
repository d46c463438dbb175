"""The one cache of quantized operands (``fp8tensor.numerics.cache.OperandCache``): a value is served only for the
same source tensor at the same version (and the same further tensors, in the same CUDA-graph capture state), held
values are one per kind and go with ``clear``, weak values live only as long as someone holds them, and
``share_input_quantization=False`` turns held values off."""
from __future__ import annotations

import gc

import torch

import fp8tensor
from fp8tensor.numerics.cache import OperandCache


def _counter():
    calls = []

    def make(value):
        def fn():
            calls.append(1)
            return value
        return fn
    return calls, make


def test_same_source_same_version_hits():
    c, (calls, make) = OperandCache(), _counter()
    x = torch.randn(4, 8)
    v = torch.randn(4, 8)
    assert c.get("k", x, make(v)) is v and c.get("k", x, make(None)) is v and len(calls) == 1
    with torch.no_grad():
        x.mul_(2)  # a new version: made again
    w = torch.randn(2)
    assert c.get("k", x, make(w)) is w and len(calls) == 2
    assert c.get("k", x.view(4, 8), make(v)) is v and len(calls) == 3  # another tensor object: no hit


def test_further_tensors_are_part_of_the_key():
    c, (calls, make) = OperandCache(), _counter()
    x, offs, offs2 = torch.randn(6, 3), torch.tensor([2, 6]), torch.tensor([2, 6])
    a = c.get("cols", x, make("a"), offs)
    assert a == "a" and c.get("cols", x, make("b"), offs) == "a"
    assert c.get("cols", x, make("c"), offs2) == "c"  # equal values, another tensor
    with torch.no_grad():
        offs2.add_(0)
    assert c.get("cols", x, make("d"), offs2) == "d" and len(calls) == 3  # its version moved


def test_held_values_one_per_kind_and_cleared():
    c, (calls, make) = OperandCache(), _counter()
    x, y = torch.randn(3), torch.randn(3)
    c.get("rows", x, make("x"))
    c.get("rows", y, make("y"))  # replaces x's held value
    assert c.get("rows", x, make("x2")) == "x2"
    c.clear("rows")
    assert c.get("rows", x, make("x3")) == "x3" and len(calls) == 4


def test_weak_values_live_as_long_as_someone_holds_them():
    c = OperandCache()
    x = torch.randn(5)
    held = [torch.randn(5)]
    assert c.get("gw", x, lambda: held[0], weak=True) is held[0]
    assert c.get("gw", x, lambda: None, weak=True) is held[0]
    held.clear()
    gc.collect()
    fresh = torch.randn(1)
    assert c.get("gw", x, lambda: fresh, weak=True) is fresh  # the old value died: made again


def test_dead_source_drops_its_entry():
    c = OperandCache()
    x = torch.randn(5)
    c.get("rows", x, lambda: torch.randn(5))
    assert len(c._entries) == 1
    del x
    gc.collect()
    assert len(c._entries) == 0


def test_config_off_holds_nothing_and_inference_tensors_bypass():
    c, (calls, make) = OperandCache(), _counter()
    x = torch.randn(3)
    with fp8tensor.config(share_input_quantization=False):
        c.get("rows", x, make(1))
        c.get("rows", x, make(2))
        v = torch.randn(1)
        assert c.get("gw", x, lambda: v, weak=True) is v and c.get("gw", x, lambda: None, weak=True) is v
    assert len(calls) == 2
    with torch.inference_mode():
        xi = torch.randn(3)
    c.get("rows", xi, make(3))
    c.get("rows", xi, make(4))
    assert len(calls) == 4
