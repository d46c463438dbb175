"""The op table of ScaledFp8Tensor (fp8tensor/subclass/ops.py): subclass kept where it should be, values bit-exact.

For every layout op the rule is: ``op(t).to_hp()`` is bit-for-bit ``op(t.to_hp())`` — an op on fp8 data must move
data and scales together and never re-round. Views must also share ``qdata``'s storage (no hidden copies).
The GEMM entries (mm, addmm) are tested in test_gemm.py.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fp8tensor
from fp8tensor import E4M3, E5M2, ScaledFp8Tensor
from fp8tensor.tensor import OP_TABLE

from conftest import rel_err, same_bits

aten = torch.ops.aten

# (id, fn, kind, shape of the input). kind: "view" = ScaledFp8Tensor sharing qdata storage, "fp8" = ScaledFp8Tensor
# (may copy), "plain" = falls back to a plain tensor of the dequantized values.
W2 = (48, 80)
W3 = (4, 12, 80)
CASES = [
    # slicing
    ("slice_rows", lambda t: t[5:30], "view", W2),
    ("slice_cols", lambda t: t[:, 8:40], "view", W2),
    ("slice_step", lambda t: t[::3, 1::2], "view", W2),
    ("slice_neg", lambda t: t[-10:], "view", W2),
    ("narrow0", lambda t: t.narrow(0, 4, 20), "view", W2),
    ("narrow1", lambda t: t.narrow(1, 3, 17), "view", W2),
    ("select_row", lambda t: t[7], "view", W2),
    ("select_col", lambda t: t[:, 9], "view", W2),
    ("select_neg", lambda t: t.select(-1, -3), "view", W2),
    ("chunk2_kwdim", lambda t: torch.chunk(t, 2, dim=0), "view", W2),
    ("chunk3_dim0", lambda t: torch.chunk(t, 3, dim=0), "view", W2),
    ("chunk4_dim1", lambda t: t.chunk(4, dim=1), "view", W2),
    ("split_int", lambda t: torch.split(t, 16), "view", W2),
    ("split_sizes0", lambda t: torch.split(t, [10, 38], dim=0), "view", W2),
    ("split_sizes1", lambda t: t.split([30, 50], dim=1), "view", W2),
    ("tensor_split", lambda t: torch.tensor_split(t, 3), "view", W2),
    ("unbind0", lambda t: t.unbind(0), "view", W2),
    ("unbind1", lambda t: torch.unbind(t, dim=1), "view", W2),
    # views / reshapes
    ("view_rows_merge", lambda t: t.view(24, 160), "view", W2),
    ("view_split_last", lambda t: t.view(48, 5, 16), "view", W2),
    ("view_flat", lambda t: t.view(-1), "view", W2),
    ("reshape", lambda t: t.reshape(80, 48), "view", W2),
    ("reshape_copy", lambda t: t.t().reshape(-1), "fp8", W2),
    ("flatten", lambda t: t.flatten(), "view", W2),
    ("unflatten", lambda t: t.unflatten(1, (5, 16)), "view", W2),
    ("view_as", lambda t: t.view_as(torch.empty(80, 48)), "view", W2),
    ("t", lambda t: t.t(), "view", W2),
    ("transpose", lambda t: t.transpose(0, 1), "view", W2),
    ("mT", lambda t: t.mT, "view", W2),
    ("permute", lambda t: t.permute(1, 0), "view", W2),
    ("unsqueeze0", lambda t: t.unsqueeze(0), "view", W2),
    ("unsqueeze_last", lambda t: t.unsqueeze(-1), "view", W2),
    ("squeeze_dim", lambda t: t[:1].squeeze(0), "view", W2),
    ("squeeze_all", lambda t: t.unsqueeze(0).unsqueeze(2).squeeze(), "view", W2),
    ("squeeze_dims", lambda t: t.unsqueeze(0).unsqueeze(2).squeeze((0, 2)), "view", W2),
    ("as_strided_identity", lambda t: t.as_strided(t.shape, t.stride()), "view", W2),
    ("detach", lambda t: t.detach(), "view", W2),
    ("alias", lambda t: aten.alias.default(t), "view", W2),
    ("expand_rows", lambda t: t[:1].expand(5, 80), "view", W2),
    ("expand_leading", lambda t: t.expand(3, 48, 80), "view", W2),
    ("expand_identity", lambda t: t.expand(-1, 80), "view", W2),
    # 3-D
    ("3d_view_2d", lambda t: t.view(48, 80), "view", W3),
    ("3d_select0", lambda t: t[1], "view", W3),
    ("3d_select1", lambda t: t[:, 3], "view", W3),
    ("3d_transpose01", lambda t: t.transpose(0, 1), "view", W3),
    ("3d_transpose12", lambda t: t.transpose(1, 2), "view", W3),
    ("3d_permute", lambda t: t.permute(2, 0, 1), "view", W3),
    ("3d_flatten01", lambda t: t.flatten(0, 1), "view", W3),
    ("3d_chunk1", lambda t: t.chunk(3, dim=1), "view", W3),
    ("3d_slice_last", lambda t: t[..., 16:48], "view", W3),
    # copies
    ("clone", lambda t: t.clone(), "fp8", W2),
    ("contiguous_of_t", lambda t: t.t().contiguous(), "fp8", W2),
    ("cat0", lambda t: torch.cat([t[:10], t[20:30]]), "fp8", W2),
    ("cat1", lambda t: torch.cat([t[:, :10], t[:, 20:]], dim=1), "fp8", W2),
    ("cat_neg_dim", lambda t: torch.cat([t[:, :8], t[:, 8:]], dim=-1), "fp8", W2),
    ("cat_self", lambda t: torch.cat([t, t]), "fp8", W2),
    ("cat_of_t", lambda t: torch.cat([t.t(), t.t()], dim=1), "fp8", W2),
    ("vstack", lambda t: torch.vstack([t[:4], t[4:]]), "fp8", W2),
    ("to_same", lambda t: t.to("cpu"), "fp8", W2),
    # fallbacks: out-of-place ops not in the table give plain dequantized results
    ("fallback_exp", lambda t: t.exp(), "plain", W2),
    ("fallback_add_scalar", lambda t: t + 1.5, "plain", W2),
    ("fallback_mul_tensor", lambda t: t * torch.arange(80.0), "plain", W2),
    ("fallback_sum", lambda t: t.sum(dim=1), "plain", W2),
    ("fallback_softmax", lambda t: torch.softmax(t, dim=-1), "plain", W2),
    ("fallback_index", lambda t: t[torch.tensor([1, 3, 5])], "plain", W2),
    ("fallback_repeat", lambda t: t.repeat(2, 1), "plain", W2),
    ("fallback_stack", lambda t: torch.stack([t, t]), "plain", W2),
    ("fallback_abs", lambda t: torch.abs(t), "plain", W2),
]


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _check_scale_invariants(o: ScaledFp8Tensor, like: ScaledFp8Tensor) -> None:
    assert o.scale.dtype == torch.float32
    assert o.scale.ndim == o.qdata.ndim
    assert all(s in (1, d) for s, d in zip(o.scale.shape, o.qdata.shape)), (o.scale.shape, o.qdata.shape)
    assert o.qdata.dtype == like.qdata.dtype
    assert o.dtype == like.dtype and o.orig_dtype == like.orig_dtype
    assert o.fast_accum == like.fast_accum
    assert o.shape == o.qdata.shape


@pytest.mark.parametrize(
    "f8,orig", [(E4M3, torch.float32), (E5M2, torch.bfloat16)], ids=["e4m3-fp32", "e5m2-bf16"]
)
@pytest.mark.parametrize("name,fn,kind,shape", CASES, ids=[c[0] for c in CASES])
def test_op_keeps_subclass_and_is_bit_exact(name, fn, kind, shape, f8, orig):
    # fast_accum=False is not the default: checks that ops carry the flag along
    t = ScaledFp8Tensor.from_hp(torch.randn(shape, dtype=orig), f8, fast_accum=False)
    qbits = t.qdata.view(torch.uint8).clone()
    scale = t.scale.clone()
    hp = t.to_hp()
    outs, refs = _as_list(fn(t)), _as_list(fn(hp))
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        if kind == "plain":
            assert type(o) is torch.Tensor, type(o)
            assert o.dtype == r.dtype and same_bits(o, r)
            continue
        assert type(o) is ScaledFp8Tensor, f"{name}: expected a ScaledFp8Tensor, got {type(o).__name__}"
        _check_scale_invariants(o, t)
        got = o.to_hp()
        assert same_bits(got, r.contiguous()) or torch.equal(got, r), f"{name}: to_hp() differs from op(to_hp())"
        if kind == "view":
            assert o.qdata.untyped_storage().data_ptr() == t.qdata.untyped_storage().data_ptr(), f"{name} copied"
    # the input is never modified
    assert torch.equal(t.qdata.view(torch.uint8), qbits) and torch.equal(t.scale, scale)


def test_chunk_and_split_rows_keep_matching_row_scales():
    """torch.chunk(W, 2/3, dim=0) and torch.split(W, [400, 496], dim=0): subclass, rows and row scales match."""
    w = torch.randn(896, 64)
    t = ScaledFp8Tensor.from_hp(w)
    for pieces in (torch.chunk(t, 2, dim=0), torch.chunk(t, 3, dim=0), torch.split(t, [400, 496], dim=0)):
        start = 0
        for p in pieces:
            n = p.shape[0]
            assert type(p) is ScaledFp8Tensor and p.shape == (n, 64)
            assert tuple(p.scale.shape) == (n, 1)
            assert torch.equal(p.scale, t.scale[start : start + n])
            assert same_bits(p.qdata, t.qdata[start : start + n])
            assert torch.equal(p.to_hp(), t.to_hp()[start : start + n])
            start += n
        assert start == 896
    assert [p.shape[0] for p in torch.chunk(t, 3, dim=0)] == [299, 299, 298]


def test_cat_of_independently_quantized_tensors_is_exact():
    """cat along the unscaled dim of tensors with different row scales keeps each element's exact scale."""
    a = ScaledFp8Tensor.from_hp(torch.randn(16, 32))
    b = ScaledFp8Tensor.from_hp(torch.randn(16, 48) * 100)
    c = torch.cat([a, b], dim=1)
    assert type(c) is ScaledFp8Tensor and c.shape == (16, 80)
    assert torch.equal(c.to_hp(), torch.cat([a.to_hp(), b.to_hp()], dim=1))
    # along the scaled dim the row scales are concatenated
    d = torch.cat([a, ScaledFp8Tensor.from_hp(torch.randn(8, 32))], dim=0)
    assert tuple(d.scale.shape) == (24, 1) and torch.equal(d.scale[:16], a.scale)
    # mixing fp8 formats or plain tensors falls back to a plain dequantized cat
    e = torch.cat([a, ScaledFp8Tensor.from_hp(torch.randn(4, 32), E5M2)])
    assert type(e) is torch.Tensor and e.shape == (20, 32)
    p = torch.randn(4, 32)
    f = torch.cat([a, p])
    assert type(f) is torch.Tensor and torch.equal(f, torch.cat([a.to_hp(), p]))


def test_to_copy_dtypes():
    t = ScaledFp8Tensor.from_hp(torch.randn(16, 32))
    b = t.to(torch.bfloat16)
    assert type(b) is ScaledFp8Tensor and b.dtype == torch.bfloat16
    assert same_bits(b.qdata, t.qdata) and torch.equal(b.scale, t.scale)  # data stays fp8, only the output dtype
    assert torch.equal(b.to_hp(), t.to_hp(torch.bfloat16))
    assert type(b.float()) is ScaledFp8Tensor and b.float().dtype == torch.float32
    i = t.to(torch.int32)
    assert type(i) is torch.Tensor and torch.equal(i, t.to_hp().to(torch.int32))
    m = t.to("meta")
    assert type(m) is ScaledFp8Tensor and m.qdata.is_meta and m.scale.is_meta and m.shape == t.shape


@pytest.mark.parametrize("op", ["zeros_like", "empty_like", "new_zeros", "new_empty", "new_ones"])
def test_factories_keep_subclass(op):
    t = ScaledFp8Tensor.from_hp(torch.randn(16, 32), fast_accum=False)
    fn = {
        "zeros_like": lambda: torch.zeros_like(t),
        "empty_like": lambda: torch.empty_like(t),
        "new_zeros": lambda: t.new_zeros(8, 32),
        "new_empty": lambda: t.new_empty((8, 32)),
        "new_ones": lambda: t.new_ones(8, 32),
    }[op]
    o = fn()
    assert type(o) is ScaledFp8Tensor
    _check_scale_invariants(o, t)
    expected = 1.0 if op == "new_ones" else 0.0  # empty_like reads as zeros (no fp8 garbage / NaN)
    assert torch.equal(o.to_hp(), torch.full(o.shape, expected))
    # a different dtype gives a plain tensor
    z = torch.zeros_like(t, dtype=torch.bfloat16)
    assert type(z) is torch.Tensor and z.dtype == torch.bfloat16


def test_copy_into_and_out_of_scaled_fp8():
    src = ScaledFp8Tensor.from_hp(torch.randn(16, 32))
    dst = ScaledFp8Tensor.from_hp(torch.randn(16, 32))
    dst.copy_(src)
    assert same_bits(dst.qdata, src.qdata) and torch.equal(dst.scale, src.scale)
    # a high-precision source is quantized with dst's (row-wise) layout
    x = torch.randn(16, 32)
    dst.copy_(x)
    assert type(dst) is ScaledFp8Tensor and torch.equal(dst.to_hp(), ScaledFp8Tensor.from_hp(x).to_hp())
    # into a plain tensor: the dequantized values
    plain = torch.empty(16, 32)
    plain.copy_(src)
    assert torch.equal(plain, src.to_hp())
    with pytest.raises(RuntimeError, match="shape mismatch"):
        dst.copy_(torch.randn(8, 32))


def test_is_same_size_and_metadata():
    t = ScaledFp8Tensor.from_hp(torch.randn(16, 32))
    assert aten.is_same_size.default(t, t.clone())
    assert not aten.is_same_size.default(t, t[:8])
    assert t.size() == (16, 32) and t.stride() == (32, 1) and t.device.type == "cpu" and t.dtype == torch.float32
    assert "ScaledFp8Tensor" in repr(t) and "float8_e4m3fn" in repr(t)


def test_in_place_arithmetic_raises_naming_master_weight():
    t = ScaledFp8Tensor.from_hp(torch.randn(16, 32))
    before_q, before_s = t.qdata.view(torch.uint8).clone(), t.scale.clone()
    # (fill_ / zero_ write values, as copy_ does: tests/test_mutation.py)
    for fn in (lambda: t.add_(1.0), lambda: t.mul_(2.0), lambda: t.clamp_(0, 1), lambda: t.sub_(torch.ones(16, 32))):
        with pytest.raises(NotImplementedError, match="in-place.*master weight") as e:
            fn()
        assert "aten." in str(e.value)  # names the op
    assert torch.equal(t.qdata.view(torch.uint8), before_q) and torch.equal(t.scale, before_s)


def test_out_into_scaled_fp8_raises_naming_op():
    t = ScaledFp8Tensor.from_hp(torch.randn(16, 32))
    x = torch.randn(16, 32)
    before = t.qdata.view(torch.uint8).clone()
    with pytest.raises(NotImplementedError, match=r"out= op aten\.add\.out"):
        torch.add(x, x, out=t)
    with pytest.raises(NotImplementedError, match=r"aten\.mm\.out"):
        torch.mm(torch.randn(16, 8), torch.randn(8, 32), out=t)
    with pytest.raises(NotImplementedError, match=r"aten\.exp\.out"):
        torch.exp(x, out=t)
    assert torch.equal(t.qdata.view(torch.uint8), before)


def test_as_strided_non_identity_raises():
    t = ScaledFp8Tensor.from_hp(torch.randn(16, 32))
    with pytest.raises(NotImplementedError, match="as_strided"):
        t.as_strided((4, 4), (1, 1))


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_flatten

        if any(isinstance(a, ScaledFp8Tensor) for a in tree_flatten((args, kwargs or {}))[0]):
            self.seen.add(func)
            self.seen.add(func.overloadpacket)
        return func(*args, **(kwargs or {}))


def test_every_op_table_entry_is_exercised():
    """Each op registered by fp8tensor/subclass/ops.py is reached by a test case here or in test_gemm.py."""
    rec = _RecordOps()
    with rec:
        for name, fn, kind, shape in CASES:
            fn(ScaledFp8Tensor.from_hp(torch.randn(shape)))
        test_to_copy_dtypes()
        for op in ["zeros_like", "empty_like", "new_zeros", "new_empty", "new_ones"]:
            test_factories_keep_subclass(op)
        test_copy_into_and_out_of_scaled_fp8()
        test_is_same_size_and_metadata()
        test_as_strided_non_identity_raises()
        t = ScaledFp8Tensor.from_hp(torch.randn(16, 32))
        x = torch.randn(4, 32)
        torch.mm(x, t.t())
        torch.addmm(torch.randn(16), x, t.t())
        aten._reshape_alias.default(t, (32, 16), (16, 1))
        aten._unsafe_view.default(t, (32, 16))
        aten.reshape.default(t, (32, 16))
    own = [
        op
        for op, fn in OP_TABLE.items()
        if getattr(fn, "__module__", "") == "fp8tensor.ops"
        # CompositeImplicitAutograd ops (aten.reshape) decompose before any subclass sees them in eager mode
        and not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
    ]
    missing = [str(op) for op in own if op not in rec.seen]
    assert not missing, f"ops in the op table without a test case: {missing}"


def test_reshape_alias_and_unsafe_view_values():
    t = ScaledFp8Tensor.from_hp(torch.randn(16, 32))
    for o in (aten._reshape_alias.default(t, (32, 16), (16, 1)), aten._unsafe_view.default(t, (32, 16)),
              aten.reshape.default(t, (32, 16))):
        assert type(o) is ScaledFp8Tensor
        assert torch.equal(o.to_hp(), t.to_hp().reshape(32, 16))


def test_detach_and_requires_grad_flags():
    t = ScaledFp8Tensor.from_hp(torch.randn(16, 32))
    t.requires_grad_()
    assert t.requires_grad and type(t) is ScaledFp8Tensor
    d = t.detach()
    assert not d.requires_grad and type(d) is ScaledFp8Tensor and same_bits(d.qdata, t.qdata)


def test_fallback_result_matches_dequantized_value_closely():
    """Sanity of the fallback on a numeric op: exp of the dequantized values, within fp8 error of exp(x)."""
    x = torch.randn(32, 64) * 0.1
    t = ScaledFp8Tensor.from_hp(x)
    out = t.exp()
    assert type(out) is torch.Tensor
    assert rel_err(out, x.double().exp()) < 2.0**-4 * 0.1 * 2


@pytest.mark.parametrize("view", [lambda t: t.diagonal(), lambda t: t.unfold(1, 2, 2), lambda t: t.view(torch.uint8),
                                  lambda t: torch.view_as_real(t)], ids=["diagonal", "unfold", "view_dtype", "view_as_real"])
def test_view_op_without_fp8_form_raises(view):
    """A view op the table lacks raises ``NotImplementedError`` naming it (``unknown_ops`` "warn", the default, and
    "raise"): a view of the dequantized values would not share the fp8 data, and writes through it would be lost
    silently."""
    t = ScaledFp8Tensor.from_hp(torch.randn(8, 8))
    before = t.qdata.view(torch.uint8).clone()
    for policy in ("warn", "raise"):
        with fp8tensor.config(unknown_ops=policy), pytest.raises(NotImplementedError, match="view op aten"):
            view(t)
    assert torch.equal(t.qdata.view(torch.uint8), before)
    d = fp8tensor.dequantize(t).diagonal()  # (the way the message gives)
    assert torch.equal(d, t.to_hp().diagonal())


def test_view_op_without_fp8_form_reads_dequantized_values_under_allow():
    """Under ``unknown_ops="allow"`` a view op without an fp8 form reads the dequantized values (``einsum("ii->i")``,
    ``diagonal().sum()``): what it returns views a copy, so the fp8 tensor is never written through it."""
    t = ScaledFp8Tensor.from_hp(torch.randn(8, 8))
    hp = t.to_hp()
    with fp8tensor.config(unknown_ops="allow"):
        assert torch.equal(t.diagonal(), hp.diagonal())
        assert torch.equal(torch.einsum("ii->i", t), torch.einsum("ii->i", hp))
        assert torch.equal(t.unfold(1, 4, 4).sum(-1), hp.unfold(1, 4, 4).sum(-1))


def test_write_through_expand_reaches_the_data_or_raises():
    """``expand`` is a view: a write through one that broadcasts nothing reaches the fp8 data (row re-quantized, the
    other rows untouched); one that broadcasts raises, as it does for a plain tensor, and changes nothing."""
    t = ScaledFp8Tensor.from_hp(torch.randn(6, 8))
    ref = t.to_hp().clone()
    with torch.no_grad():
        t[2:3].expand(1, 8).fill_(100.0)
    got = t.to_hp()
    assert torch.equal(got[2], torch.full((8,), 100.0)) and torch.equal(got[:2], ref[:2]) and torch.equal(got[3:], ref[3:])
    before = t.qdata.view(torch.uint8).clone(), t.scale.clone()
    with pytest.raises(RuntimeError, match="more than one element"):
        t.expand(3, 6, 8).copy_(torch.randn(3, 6, 8))
    with pytest.raises(RuntimeError, match="more than one element"):
        t[:1].expand(4, 8).fill_(1.0)
    assert torch.equal(t.qdata.view(torch.uint8), before[0]) and torch.equal(t.scale, before[1])


def test_copy_into_column_slices_with_conflicting_row_scales_raises():
    """Column slices share their row scales: pieces with the same row scales load exactly (a DCP load of column
    chunks), a piece whose row scales differ from what another piece already wrote raises instead of corrupting it."""
    full = torch.randn(4, 8)
    full[:, 4:] *= 10
    g = ScaledFp8Tensor.from_hp(full)
    dst = ScaledFp8Tensor.from_hp(torch.randn(4, 8))
    dst[:, :4].copy_(g[:, :4])
    torch.chunk(dst, 2, dim=1)[1].copy_(g[:, 4:])
    assert same_bits(dst.qdata, g.qdata) and torch.equal(dst.scale, g.scale)
    # a second load (new values, same regions) works too
    g2 = ScaledFp8Tensor.from_hp(torch.randn(4, 8))
    dst[:, :4].copy_(g2[:, :4])
    dst[:, 4:].copy_(g2[:, 4:])
    assert torch.equal(dst.to_hp(), g2.to_hp())
    # pieces quantized separately (different row scales) cannot share one row scale
    dst = ScaledFp8Tensor.from_hp(torch.randn(4, 8))
    dst[:, :4].copy_(ScaledFp8Tensor.from_hp(full[:, :4]))
    before = dst.to_hp().clone()
    with pytest.raises(NotImplementedError, match="copy_"):
        dst[:, 4:].copy_(ScaledFp8Tensor.from_hp(full[:, 4:]))
    assert torch.equal(dst.to_hp(), before)
    # whole rows own their scales
    rows = ScaledFp8Tensor.from_hp(torch.randn(6, 8))
    rows[2:6].copy_(ScaledFp8Tensor.from_hp(full))
    assert torch.equal(rows[2:6].to_hp(), ScaledFp8Tensor.from_hp(full).to_hp())
