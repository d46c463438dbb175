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


@pytest.mark.parametrize("via", ["detach", "view_as", "alias"])
def test_shared_scale_guard_sees_writes_through_other_aliases(via):
    # DCP writes each saved piece through a fresh alias of the destination (DTensor.to_local(), detach): a piece
    # whose row scales differ from the piece written before must still be refused, not rescale that piece's columns
    p1, p2 = _conflicting_pieces()
    dst = ScaledFp8Tensor.from_hp(torch.randn(4, 8))
    alias = {"detach": lambda t: t.detach(), "view_as": lambda t: t.view_as(t),
             "alias": lambda t: torch.ops.aten.alias(t)}[via]
    with torch.no_grad():
        alias(dst)[:, :4].copy_(p1)
        before = dst.to_hp().clone()
        with pytest.raises(NotImplementedError, match="copy_"):
            alias(dst)[:, 4:].copy_(p2)
    assert torch.equal(dst.to_hp(), before)


@pytest.mark.parametrize("via", ["self", "detach"])
def test_pieces_of_different_rows_load_exactly_through_aliases(via):
    # pieces cut along rows and columns (a checkpoint saved on a 2-D layout): pieces of different rows write different
    # scales, so none refuses another; loading twice works too
    x = torch.randn(4, 8)
    x[2:] *= 50
    g = ScaledFp8Tensor.from_hp(x)
    dst = ScaledFp8Tensor.from_hp(torch.randn(4, 8))
    alias = (lambda t: t) if via == "self" else (lambda t: t.detach())
    for _ in range(2):
        with torch.no_grad():
            for r in (slice(0, 2), slice(2, 4)):
                for c in (slice(0, 4), slice(4, 8)):
                    alias(dst)[r][:, c].copy_(g[r][:, c])
        assert torch.equal(dst.qdata.view(torch.uint8), g.qdata.view(torch.uint8)) and torch.equal(dst.scale, g.scale)
