"""The non-GEMM entries of the op table of :class:`~fp8tensor.tensor.ScaledFp8Tensor`, each handler named after what
it does to the scale (docs/design.md, "The op table")."""
from __future__ import annotations

from typing import Sequence

import torch

from ..core import compat
from ..numerics.quantize import FLOAT8_DTYPES
from .tensor import ScaledFp8Tensor, check_finite_rows, implements, make_scaled, quantize_like

aten = torch.ops.aten


def _wrap(qdata: torch.Tensor, scale: torch.Tensor, like: ScaledFp8Tensor, shares_scale: bool = False, dims=None):
    """A view of ``like`` with ``scaled_dims`` ``dims`` (default ``like``'s); ``shares_scale``: its scales also scale
    data outside it (``copy_`` guards it). Under ``inference_mode`` it is built outside it, as ``like`` was."""
    shares = shares_scale or like.shares_scale
    writes = like.scale_writes() if _same_scale_memory(scale, like.scale) else None  # (one record per scale memory)
    dims = like.scaled_dims if dims is None else dims
    if torch.is_inference_mode_enabled() and not like.is_inference():
        with torch.inference_mode(False):
            out = make_scaled(qdata, scale, like.orig_dtype, like.fast_accum, dims, shares_scale=shares,
                              scale_writes=writes)
    else:  # (no context manager entered: the usual case, a view made on every Linear call)
        out = make_scaled(qdata, scale, like.orig_dtype, like.fast_accum, dims, shares_scale=shares,
                          scale_writes=writes)
    if like.__dict__.get(_SCALE_COPY):  # (a view of a view whose scales are a copy: writes refused too)
        out.__dict__[_SCALE_COPY] = True
    if shares:  # the tensor whose scale groups this view cuts through: a partial write re-quantizes them in it
        root = like.__dict__.get(_ROOT)
        out.__dict__[_ROOT] = root if root is not None else (like.qdata, like.scale, like.scaled_dims)
    return out


#: Attribute of a ``shares_scale`` view: ``(qdata, scale, scaled_dims)`` of the tensor it was cut from.
_ROOT = "_fp8tensor_scale_root"
#: Attribute of a view whose scale is a copy of its base's (made by ``view`` / ``reshape``): ``copy_`` into it raises.
_SCALE_COPY = "_fp8tensor_scale_copy"


def _same_scale_memory(scale: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``scale`` is ``base`` or a view of its memory (not a copy a view op materialized): then its tensor
    shares ``base``'s tensor's record of scale writes, so a write through any alias or slice sees the others."""
    if scale is base:
        return True
    root, base_root = compat.view_base(scale), compat.view_base(base)
    return root is not None and root is (base if base_root is None else base_root)


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


# --------------------------------------------------------------------------------------------- aliases / copies
@implements([aten.detach.default, aten.alias.default, aten.lift_fresh.default])
def _same_scale_alias(func, args, kwargs):
    t = args[0]
    return _wrap(func(t.qdata), t.scale, t)


@implements([aten.clone.default])
def _clone_both(func, args, kwargs):
    t = args[0]
    return _wrap(func(t.qdata, **kwargs), t.scale.clone(), t)


@implements([aten._to_copy.default])
def _to_copy_move_scale(func, args, kwargs):
    """Moves data and scale; a float dtype changes the logical dtype, others dequantize, fp8 raises ``TypeError``."""
    t = args[0]
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", None)
    if dtype in FLOAT8_DTYPES:
        raise TypeError(
            f"ScaledFp8Tensor.to({dtype}): a plain float8 tensor cannot hold the scale, so converting would silently "
            "change the values (saturate large rows, flush small ones). Use .qdata (the fp8 data) with .scale, or "
            ".to_hp() and quantize the values yourself.")
    if dtype is not None and not dtype.is_floating_point:
        return func(t.to_hp(), dtype=dtype, **kwargs)
    kwargs.pop("layout", None)
    qdata = func(t.qdata, **kwargs)
    scale_kwargs = {k: v for k, v in kwargs.items() if k in ("device", "non_blocking", "pin_memory")}
    scale = func(t.scale, **scale_kwargs)
    return make_scaled(qdata, scale, dtype or t.orig_dtype, t.fast_accum, t.scaled_dims)


@implements([aten.dequantize.self])
def _dequantize_float32(func, args, kwargs):
    """``t.dequantize()``: the plain float32 ``qdata * scale``, with no ``unknown_ops`` warning."""
    return args[0].to_hp(torch.float32)


@implements([aten.copy_.default])
def _copy_into_data_and_scale(func, args, kwargs):
    """``dst.copy_(src)``: data and scale, or ``src`` quantized in ``dst``'s layout (plain ``dst``: dequantized)."""
    dst, src = args[0], args[1]
    if not isinstance(dst, ScaledFp8Tensor):
        dst.copy_(src.to_hp(dst.dtype))
        return dst
    if tuple(dst.shape) != tuple(src.shape):
        raise RuntimeError(
            f"ScaledFp8Tensor copy_: shape mismatch, destination {tuple(dst.shape)} and source {tuple(src.shape)}")
    if any(st == 0 and n > 1 for n, st in zip(dst.qdata.shape, dst.qdata.stride())):
        raise RuntimeError(
            "ScaledFp8Tensor copy_: unsupported operation: more than one element of the destination refers to a "
            f"single memory location (an expanded view, data {tuple(dst.shape)} with strides {dst.qdata.stride()}); "
            "clone it first, as for a plain tensor")
    if dst.__dict__.get(_SCALE_COPY):
        raise NotImplementedError(
            "ScaledFp8Tensor copy_: writing through a view whose scales are a copy (a view that merges the scaled "
            f"rows, e.g. t.view(-1)[i] = v, data {tuple(dst.shape)}) is not supported: the tensor's own scales would "
            "not change. Write through a view that keeps the rows (t[r, c] = v, t[:, a:b] = ...), or into the "
            "high-precision tensor")
    if not isinstance(src, ScaledFp8Tensor):
        if src.is_complex():
            raise TypeError(f"ScaledFp8Tensor copy_: a complex source ({src.dtype}) cannot be quantized to fp8; "
                            "copy its real part (src.real)")
        if src.dtype in FLOAT8_DTYPES:
            raise TypeError(
                f"ScaledFp8Tensor copy_: the source is a plain {src.dtype} tensor, which has no scales to read it by "
                "(its values are the fp8 codes of some scaled tensor); copy a ScaledFp8Tensor (ScaledFp8Tensor(qdata, "
                "scale)), or convert the source explicitly (src.float()) if its codes are the values")
        if not src.is_floating_point():
            src = src.to(torch.float32)  # (its values, as copy_ converts them: bool, integers)
        check_finite_rows(src.detach(), "ScaledFp8Tensor copy_")  # (quantized, an inf / NaN row would be all NaN)
    if isinstance(src, ScaledFp8Tensor):
        if src.qdata.dtype == dst.qdata.dtype and _scale_fits(src.scale, dst.scale):
            q, s = src.qdata, src.scale.expand(dst.scale.shape)
        else:
            q, s = quantize_like(src.to_hp(torch.float32), dst.scaled_dims, dst.qdata.dtype)
    elif dst.shares_scale:  # a partial write of high-precision values: re-quantize the scale groups it touches
        _write_scale_groups(dst, src)
        return dst
    else:
        q, s = quantize_like(src.to(dst.device), dst.scaled_dims, dst.qdata.dtype)
    if dst.shares_scale and not _shared_scale_write_ok(dst, s):
        raise NotImplementedError(
            "ScaledFp8Tensor copy_: the destination is a view whose scales are shared with elements outside it "
            f"(e.g. a column slice of a row-scaled tensor: data {tuple(dst.shape)}, scale {tuple(dst.scale.shape)}), "
            "another part of it was already written with different scales, and writing these would change that "
            "part. Copy whole rows, pieces quantized with the same row scales, or into a high-precision tensor.")
    dst.qdata.copy_(q)
    dst.scale.copy_(s)
    return dst


@implements([aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default])
def _fill_as_copy(func, args, kwargs):
    """``t.fill_(v)`` / ``t.zero_()`` (also ``t[i, j] = v``): a ``copy_`` of the value."""
    dst = args[0]
    value = 0.0 if func is aten.zero_.default else args[1]
    if isinstance(value, ScaledFp8Tensor):
        value = value.to_hp(torch.float32)
    src = torch.as_tensor(value, dtype=torch.float32, device=dst.device).expand(dst.shape)
    return _copy_into_data_and_scale(aten.copy_.default, (dst, src), {})


def _write_scale_groups(dst: ScaledFp8Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` into a view sharing scales outside it: the touched scale groups of its root tensor are
    re-quantized, the others untouched. ``NotImplementedError`` when the root is unknown (compiled, copied)."""
    root = dst.__dict__.get(_ROOT)
    if root is None:
        raise NotImplementedError(
            "ScaledFp8Tensor copy_: a partial write (into a view whose scales also scale elements outside it, e.g. "
            f"an element or a column slice of a row-scaled tensor: data {tuple(dst.shape)}, scale "
            f"{tuple(dst.scale.shape)}) whose originating tensor is not known here; write into the whole tensor "
            "(t.copy_(new_values)) or into its high-precision form")
    rq, rs, rdims = root
    dev = rq.device
    # Where each element of dst lies in root: a tensor with root's strides holding logical positions, viewed as dst.
    pos = torch.empty_strided(rq.shape, rq.stride(), dtype=torch.long, device=dev)
    pos.copy_(torch.arange(rq.numel(), device=dev).view(rq.shape))
    where = pos.as_strided(dst.qdata.shape, dst.qdata.stride(), dst.qdata.storage_offset() - rq.storage_offset())
    where = where.reshape(-1)
    hp = (rq.to(torch.float32) * rs).reshape(-1)
    hp[where] = src.to(device=dev, dtype=torch.float32).expand(dst.shape).reshape(-1)
    hp = hp.view(rq.shape)
    touched = torch.zeros(rq.numel(), dtype=torch.bool, device=dev)
    touched[where] = True
    unscaled = [d for d in range(rq.dim()) if not rdims[d]]
    touched = touched.view(rq.shape)
    groups = touched.amax(dim=unscaled, keepdim=True) if unscaled else touched  # (scale's shape)
    q, s = quantize_like(hp, rdims, rq.dtype)
    rs.copy_(torch.where(groups, s, rs))
    rq.view(torch.uint8).copy_(torch.where(groups, q.view(torch.uint8), rq.view(torch.uint8)))


def _shared_scale_write_ok(dst: ScaledFp8Tensor, new_scale: torch.Tensor) -> bool:
    """Whether ``copy_`` may write ``new_scale`` into ``dst``, whose scales sibling views share (DCP loads of column
    chunks): not when another region was already written with the old scales (rewriting a region starts over)."""
    region = (dst.qdata.storage_offset(), tuple(dst.qdata.shape), tuple(dst.qdata.stride()))
    written = dst.scale_writes().regions  # {region: the span of scale elements it was written with}
    span = _scale_span(dst.scale)
    same = new_scale.shape == dst.scale.shape and _all_equal([new_scale.contiguous(), dst.scale.contiguous()])
    if not same:
        sharing = [r for r, e in written.items() if e is not None and span is not None
                   and e[0] <= span[1] and span[0] <= e[1]]
        if sharing and region not in sharing:
            return False
        for r in sharing:  # first write, or this region again (a new load): a new generation of these scales
            del written[r]
    written[region] = span
    return True


def _scale_span(scale: torch.Tensor):
    """``(first, last)`` position in its storage of the elements ``scale`` views (None when it has none): column
    slices of different rows write disjoint spans, so neither refuses the other (spans interleaved by strides count
    as overlapping: a refusal, never a silent rescale)."""
    if scale.numel() == 0:
        return None
    first = scale.storage_offset()
    return first, first + sum((n - 1) * st for n, st in zip(scale.shape, scale.stride()))


def _scale_fits(src_scale: torch.Tensor, dst_scale: torch.Tensor) -> bool:
    """True if ``src_scale`` can be written into ``dst_scale`` without losing information."""
    return all(s == d or s == 1 for s, d in zip(src_scale.shape, dst_scale.shape))


# --------------------------------------------------------------------------------------------- factories
_LIKE = (aten.empty_like.default, aten.zeros_like.default)


@implements([*_LIKE, aten.new_zeros.default, aten.new_empty.default, aten.new_ones.default])
def _new_with_unit_scale(func, args, kwargs):
    """``*_like(t)`` / ``t.new_*(size)``: unit scales in ``t``'s layout (another ndim: shared; another dtype: plain)."""
    t = args[0]
    size = list(t.shape if func in _LIKE else args[1])
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", None)
    if dtype is not None and dtype != t.orig_dtype:
        return func(t.to_hp(), *args[1:], dtype=dtype, **kwargs)
    device = kwargs.get("device") or t.device
    if func in _LIKE:
        q = func(t.qdata, **kwargs)
        if func is aten.empty_like.default:
            q.zero_()  # fp8 garbage could be NaN; a fresh tensor reads as zeros
    else:
        q = (torch.ones if func is aten.new_ones.default else torch.zeros)(size, dtype=t.qdata.dtype, device=device)
    dims = t.scaled_dims if len(size) == t.scale.ndim else (False,) * len(size)
    s = torch.ones([n if b else 1 for b, n in zip(dims, size)], dtype=torch.float32, device=device)
    return make_scaled(q, s, t.orig_dtype, t.fast_accum, dims)


# --------------------------------------------------------------------------------------------- layout: permutations
def t_view(t: ScaledFp8Tensor) -> ScaledFp8Tensor:
    """``t.t()`` of a 2-D ScaledFp8Tensor without the dispatcher (no autograd recording): the ``aten.t`` entry."""
    return _wrap(t.qdata.t(), t.scale.t(), t, dims=t.scaled_dims[::-1])


@implements([aten.t.default, aten.transpose.int, aten.permute.default])
def _permute_scale(func, args, kwargs):
    t = args[0]
    perm = list(range(t.dim()))
    if func is aten.permute.default:
        perm = [_norm_dim(d, t.dim()) for d in args[1]]
    elif t.dim() > 1:  # t(): dims 0 and 1; transpose: the two given
        d0, d1 = (0, 1) if func is aten.t.default else (_norm_dim(args[1], t.dim()), _norm_dim(args[2], t.dim()))
        perm[d0], perm[d1] = perm[d1], perm[d0]
    q = func(t.qdata, *args[1:])  # (torch's own argument checks)
    return _wrap(q, t.scale.permute(perm), t, dims=tuple(t.scaled_dims[d] for d in perm))


@implements([aten.unsqueeze.default])
def _unsqueeze_scale(func, args, kwargs):
    t, d = args[0], _norm_dim(args[1], args[0].dim() + 1)
    dims = t.scaled_dims[:d] + (False,) + t.scaled_dims[d:]
    return _wrap(t.qdata.unsqueeze(d), t.scale.unsqueeze(d), t, dims=dims)


@implements([aten.expand.default])
def _expand_scale(func, args, kwargs):
    """``t.expand(size)``: data and scale expanded (new leading dims and broadcast size-1 dims unscaled where the
    scale has size 1 there, broadcast with the data where it is scaled). Writing through a view that broadcasts
    raises, as for plain tensors (``copy_``)."""
    t, size = args[0], list(args[1])
    q = func(t.qdata, size, **kwargs)  # (torch's own checks of the size)
    lead = q.dim() - t.dim()
    dims = (False,) * lead + tuple(t.scaled_dims)
    s = t.scale
    for _ in range(lead):  # (views: the result shares t's scale memory)
        s = s.unsqueeze(0)
    s = s.expand([n if b else 1 for b, n in zip(dims, q.shape)])
    return _wrap(q, s, t, dims=dims)


@implements([aten.as_strided.default])
def _as_strided_identity(func, args, kwargs):
    t, size, stride = args[0], args[1], args[2]
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    if list(size) == list(t.shape) and list(stride) == list(t.stride()) and offset in (None, t.storage_offset()):
        return _wrap(t.qdata, t.scale, t)
    raise NotImplementedError(
        f"ScaledFp8Tensor: aten.as_strided is only supported as the identity (size {tuple(t.shape)}, "
        f"stride {t.stride()}), got size {tuple(size)}, stride {tuple(stride)}")


# --------------------------------------------------------------------------------------------- layout: views
def _view_groups(old: Sequence[int], new: Sequence[int]):
    """Split two shapes of equal numel into matching runs of dims ``(old_dims, new_dims)``."""
    groups, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        oi, nj = [i], [j]
        po = old[i] if i < len(old) else 1
        pn = new[j] if j < len(new) else 1
        i, j = i + 1, j + 1
        while po != pn:
            if po < pn:
                po *= old[i]
                oi.append(i)
                i += 1
            else:
                pn *= new[j]
                nj.append(j)
                j += 1
        # absorb trailing size-1 dims into the current group
        while i < len(old) and old[i] == 1 and (j >= len(new) or new[j] != 1):
            oi.append(i)
            i += 1
        while j < len(new) and new[j] == 1 and (i >= len(old) or old[i] != 1):
            nj.append(j)
            j += 1
        groups.append(([d for d in oi if d < len(old)], [d for d in nj if d < len(new)]))
    return groups


def _view_scale(scale: torch.Tensor, old: Sequence[int], new: Sequence[int], dims: Sequence[bool]):
    """The scale and ``scaled_dims`` of a ``view(new)`` of data of shape ``old`` declared ``dims``: per run of dims
    that reshape into each other, scaled (reshaped with the data, materialized if mixed) if any dim of size > 1 is
    scaled, else shared; a run of size-1 dims keeps its flag; the same shape keeps everything."""
    old, new = list(old), list(new)
    if old == new:
        return scale, tuple(dims)
    if len(new) == 0:
        return scale.reshape(()), ()
    if len(old) == 0 or 0 in old:  # no elements to share a scale (or a 0-d tensor): one scale per element
        return scale.expand(old).reshape(new), (True,) * len(new)
    inter, target, new_dims = [], [], [False] * len(new)
    for odims, ndims in _view_groups(old, new):
        if all(old[d] == 1 for d in odims) and all(new[d] == 1 for d in ndims):
            flag, keep = any(dims[d] for d in odims), False
        else:
            flag = keep = any(dims[d] and old[d] != 1 for d in odims)
        inter += [old[d] for d in odims] if keep else [1] * len(odims)
        target += [new[d] for d in ndims] if keep else [1] * len(ndims)
        for d in ndims:
            new_dims[d] = flag
    return scale.expand(inter).reshape(target), tuple(new_dims)


@implements([aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._reshape_alias.default])
def _view_scale_with_data(func, args, kwargs):
    t, size = args[0], args[1]
    if func is aten.reshape.default:
        q = t.qdata.reshape(size)
    elif func is aten._unsafe_view.default:
        q = func(t.qdata, size)
    else:  # view, _reshape_alias (its stride argument is the view's own)
        q = aten.view.default(t.qdata, size)
    scale, dims = _view_scale(t.scale, t.shape, q.shape, t.scaled_dims)
    out = _wrap(q, scale, t, dims=dims)  # (a view of a view marked _SCALE_COPY is marked by _wrap)
    try:  # a scale materialized by the view no longer aliases t's: copy_ into the view raises (t would not change)
        if out.scale.untyped_storage().data_ptr() != t.scale.untyped_storage().data_ptr():
            out.__dict__[_SCALE_COPY] = True
    except Exception:  # (tensors without storage: fake or traced)
        pass
    return out


@implements([aten.view_as.default])
def _view_as_scale_with_data(func, args, kwargs):
    """``t.view(other.shape)`` (undecomposed under ``torch.inference_mode``)."""
    return _view_scale_with_data(aten.view.default, (args[0], list(args[1].shape)), {})


@implements([aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims])
def _squeeze_scale(func, args, kwargs):
    t = args[0]
    q = func(t.qdata, *args[1:], **kwargs)
    scale, dims = _view_scale(t.scale, t.shape, q.shape, t.scaled_dims)
    return _wrap(q, scale, t, dims=dims)


# --------------------------------------------------------------------------------------------- layout: slicing
@implements([aten.slice.Tensor])
def _slice_scale_if_scaled(func, args, kwargs):
    t = args[0]
    dim = _norm_dim(kwargs.get("dim", args[1] if len(args) > 1 else 0), t.dim())
    start = kwargs.get("start", args[2] if len(args) > 2 else None)
    end = kwargs.get("end", args[3] if len(args) > 3 else None)
    step = kwargs.get("step", args[4] if len(args) > 4 else 1)
    q = aten.slice.Tensor(t.qdata, dim, start, end, step)
    if t.scaled_dims[dim]:
        return _wrap(q, aten.slice.Tensor(t.scale, dim, start, end, step), t)
    return _wrap(q, t.scale, t, shares_scale=q.shape[dim] < t.shape[dim])


@implements([aten.select.int])
def _select_scale(func, args, kwargs):
    t, dim, index = args[0], _norm_dim(args[1], args[0].dim()), args[2]
    q = t.qdata.select(dim, index)
    s = t.scale.select(dim, index if t.scaled_dims[dim] else 0)
    dims = t.scaled_dims[:dim] + t.scaled_dims[dim + 1 :]
    return _wrap(q, s, t, shares_scale=not t.scaled_dims[dim] and t.shape[dim] > 1, dims=dims)


@implements([aten.split.Tensor, aten.split_with_sizes.default])
def _split_scale_if_scaled(func, args, kwargs):
    t, split = args[0], args[1]
    dim = _norm_dim(kwargs.get("dim", args[2] if len(args) > 2 else 0), t.dim())
    qs = func(t.qdata, split, dim)
    if t.scaled_dims[dim]:
        ss = func(t.scale, split, dim)
        return [_wrap(q, s, t) for q, s in zip(qs, ss)]
    return [_wrap(q, t.scale, t, shares_scale=len(qs) > 1) for q in qs]


@implements([aten.unbind.int])
def _unbind_scale(func, args, kwargs):
    t = args[0]
    dim = _norm_dim(kwargs.get("dim", args[1] if len(args) > 1 else 0), t.dim())
    return [_select_scale(aten.select.int, (t, dim, i), {}) for i in range(t.shape[dim])]


def _all_equal(scales) -> bool:
    """Whether scales are equal (eager only: under tracing we cannot look at values and say no)."""
    if any(compat.is_fake(s) or type(s) is not torch.Tensor for s in scales):
        return False
    first = scales[0]
    return all(s.shape == first.shape and torch.equal(s, first) for s in scales[1:])


@implements([aten.cat.default])
def _cat_scales(func, args, kwargs):
    """Concatenate data; scales concatenated when scaled along ``dim``, shared when equal, else expanded (bit-exact)."""
    tensors = list(args[0])
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    fp8 = [t for t in tensors if isinstance(t, ScaledFp8Tensor)]
    if len(fp8) != len(tensors) or len({t.qdata.dtype for t in fp8}) != 1 or len({t.dim() for t in fp8}) != 1:
        hp = [t.to_hp() if isinstance(t, ScaledFp8Tensor) else t for t in tensors]
        return torch.cat(hp, dim)
    first = fp8[0]
    dim = _norm_dim(dim, first.dim())
    q = torch.cat([t.qdata for t in fp8], dim)
    # Off the cat dim, scales must share a layout: scaled where any input is (expanded where one was shared).
    nd = first.dim()
    off = [any(t.scaled_dims[d] for t in fp8) for d in range(nd)]
    scales = [t.scale.expand([t.scale.shape[d] if d == dim else (t.shape[d] if off[d] else 1) for d in range(nd)])
              for t in fp8]
    if all(t.scaled_dims[dim] for t in fp8):
        s, along = torch.cat(scales, dim), True
    elif not any(t.scaled_dims[dim] for t in fp8) and _all_equal([s.contiguous() for s in scales]):
        s, along = scales[0], False
    else:
        s = torch.cat([sc.expand([t.shape[d] if d == dim else sc.shape[d] for d in range(nd)])
                       for sc, t in zip(scales, fp8)], dim)
        along = True
    dims = tuple(along if d == dim else off[d] for d in range(nd))
    return make_scaled(q, s.contiguous(), first.orig_dtype, all(t.fast_accum for t in fp8), dims)


# --------------------------------------------------------------------------------------------- metadata-only
@implements([aten.is_same_size.default])
def _is_same_size(func, args, kwargs):
    return args[0].shape == args[1].shape


@implements([compat.assert_tensor_metadata_op])
def _assert_tensor_metadata(func, args, kwargs):
    # (``t.to(dtype)`` in an exported program records this check: it reads metadata, so no dequantized copy)
    t = args[0]
    want = dict(zip(("size", "stride", "dtype"), args[1:]))
    want.update(kwargs)
    have = {"size": tuple(t.shape), "stride": tuple(t.stride()), "dtype": t.dtype, "device": t.device,
            "layout": t.layout}
    for name, value in want.items():
        if value is None:
            continue
        if name in ("size", "stride"):
            value = tuple(value)
        elif name == "device":
            value = torch.device(value)
            if value.index is None:
                value, have[name] = value.type, have[name].type
        if value != have[name]:
            raise RuntimeError(f"aten._assert_tensor_metadata: ScaledFp8Tensor {name} mismatch: expected {value}, "
                               f"got {have[name]}")
