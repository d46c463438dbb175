"""State of a ScaledFp8Tensor view that shares its scales (a column slice of a row-scaled tensor) is real state:
it survives ``__tensor_flatten__`` / ``__tensor_unflatten__`` (what torch.compile, DTensor and FSDP2 do to a
subclass) and ``deepcopy``, so ``copy_`` keeps refusing writes that would corrupt the sibling views."""
from __future__ import annotations

import copy

import pytest
import torch

from fp8tensor import ScaledFp8Tensor


def _roundtrip(t: ScaledFp8Tensor) -> ScaledFp8Tensor:
    names, ctx = t.__tensor_flatten__()
    return ScaledFp8Tensor.__tensor_unflatten__({n: getattr(t, n) for n in names}, ctx, t.shape, t.stride())


def _conflicting_pieces():
    full = torch.randn(4, 8)
    full[:, 4:] *= 10
    return ScaledFp8Tensor.from_hp(full[:, :4]), ScaledFp8Tensor.from_hp(full[:, 4:])


def test_shared_scale_guard_survives_flatten_unflatten():
    p1, p2 = _conflicting_pieces()
    dst = ScaledFp8Tensor.from_hp(torch.randn(4, 8))
    right = _roundtrip(dst[:, 4:])
    assert right.shares_scale and not dst.shares_scale
    dst[:, :4].copy_(p1)
    before = dst.to_hp().clone()
    with pytest.raises(NotImplementedError, match="copy_"):
        right.copy_(p2)
    assert torch.equal(dst.to_hp(), before)


def test_shared_scale_pieces_with_equal_scales_load_after_flatten_unflatten():
    x = torch.randn(4, 8)
    g = ScaledFp8Tensor.from_hp(x)
    dst = ScaledFp8Tensor.from_hp(torch.randn(4, 8))
    _roundtrip(dst[:, :4]).copy_(g[:, :4])
    _roundtrip(dst[:, 4:]).copy_(g[:, 4:])
    assert torch.equal(dst.qdata.view(torch.uint8), g.qdata.view(torch.uint8)) and torch.equal(dst.scale, g.scale)


def test_deepcopy_keeps_shares_scale():
    dst = ScaledFp8Tensor.from_hp(torch.randn(4, 8))
    c = copy.deepcopy(dst[:, :4])
    assert c.shares_scale and type(c) is ScaledFp8Tensor
    assert not copy.deepcopy(dst).shares_scale
