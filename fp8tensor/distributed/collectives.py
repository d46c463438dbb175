"""Collectives of :class:`~fp8tensor.tensor.ScaledFp8Tensor` (DTensor's sharding, redistribution and
``distribute_tensor``): fp8 data (as ``uint8``) and float32 scales move as two collectives of the same kind, except
``broadcast_``, which sends the values in the logical dtype (docs/tp.md, "What is communicated"); reductions raise
``NotImplementedError``. Also the ops whose results stay master weights."""
from __future__ import annotations

import importlib
from typing import Any

import torch

from ..core import compat
from ..training.master import keep_master_through
from ..subclass.ops import _SCALE_COPY, _scale_fits
from ..subclass.tensor import ScaledFp8Tensor, implements, make_scaled, quantize_like

__all__: list[str] = []

aten = torch.ops.aten
_funcol = compat.c10d_functional_ops()


def _dist_op(name: str) -> list:
    """``[torch.ops.<name>]`` (``"namespace.op.overload"``), or ``[]`` on a torch build without distributed."""
    if not torch.distributed.is_available():
        return []
    importlib.import_module("torch.distributed._functional_collectives")  # registers _wrap_tensor_autograd

    obj = torch.ops
    for part in name.split("."):
        obj = getattr(obj, part)
    return [obj]


def _bind(func, args, kwargs) -> dict[str, Any]:
    """Arguments of an op call by schema name, defaults filled in."""
    schema = compat.op_schema(func).arguments
    return {a.name: args[i] if i < len(args) else kwargs.get(a.name, a.default_value) for i, a in enumerate(schema)
            if i < len(args) or a.name in kwargs or a.has_default_value()}


def _bytes(q: torch.Tensor) -> torch.Tensor:
    """fp8 data as contiguous ``uint8`` (same bytes): the dtype collectives carry."""
    return q.contiguous().view(torch.uint8)


def _like(t: ScaledFp8Tensor, qbytes: torch.Tensor, scale: torch.Tensor, dims=None) -> ScaledFp8Tensor:
    """A collective's result from ``t``: its dtypes and flags; ``dims`` its ``scaled_dims`` (default ``t``'s)."""
    dims = t.scaled_dims if dims is None else dims
    return make_scaled(qbytes.view(t.qdata.dtype), scale, t.orig_dtype, t.fast_accum, dims)


# --------------------------------------------------------------------------------------------- functional
def _serial(t: ScaledFp8Tensor) -> bool:
    """Whether ``t``'s collectives are waited on one by one: on the CPU (gloo; docs/pytorch_issues.md item 3)."""
    return t.qdata.device.type == "cpu"


def _data_and_scale(t: ScaledFp8Tensor, func, scale: torch.Tensor, *rest) -> tuple:
    """``(func(bytes of t's data, *rest), func(scale, *rest))``; :func:`_serial`: the scale's first, each waited on."""
    if _serial(t):
        s = _funcol.wait_tensor.default(func(scale, *rest))
        return _funcol.wait_tensor.default(func(_bytes(t.qdata), *rest)), s
    return func(_bytes(t.qdata), *rest), func(scale, *rest)


@implements(_dist_op("_c10d_functional.all_gather_into_tensor.default"))
def _all_gather_data_and_scales(func, args, kwargs):
    """Concatenate every rank's data and scales along dim 0; a scale shared along dim 0 (per ``scaled_dims``) is
    gathered compactly, waited on and repeated over each rank's rows."""
    b = _bind(func, args, kwargs)
    t, group_size, group = b["input"], b["group_size"], b["group_name"]
    rows = t.shape[0]
    q, s = _data_and_scale(t, func, t.scale.contiguous(), group_size, group)
    if not _serial(t) and (rows == 1 or not t.scaled_dims[0]):
        s = _funcol.wait_tensor.default(s)
    if not t.scaled_dims[0] and rows != 1:
        s = s.repeat_interleave(rows, dim=0)
    return _like(t, q, s, (True, *t.scaled_dims[1:]))


@implements(_dist_op("_c10d_functional._wrap_tensor_autograd.default"))
def _wrap_async(func, args, kwargs):
    """Wrap the in-flight result in an ``AsyncCollectiveTensor`` (waited on before its first read), as the op does."""
    return compat.functional_collectives().AsyncCollectiveTensor(args[0])


@implements(_dist_op("_c10d_functional.wait_tensor.default"))
def _wait_data_and_scale(func, args, kwargs):
    """Wait on the data and on the scale (both came from the collective that produced this tensor)."""
    t = args[0]
    return make_scaled(func(t.qdata), func(t.scale), t.orig_dtype, t.fast_accum, t.scaled_dims)


@implements(_dist_op("_c10d_functional.all_to_all_single.default"))
def _all_to_all_data_and_scales(func, args, kwargs):
    """Split along dim 0 and exchange; the scale is made full-size on dim 0 first so it splits with the rows."""
    b = _bind(func, args, kwargs)
    t, out_splits, in_splits, group = b["input"], b["output_split_sizes"], b["input_split_sizes"], b["group_name"]
    s = t.scale
    if not t.scaled_dims[0]:
        s = s.expand(t.shape[0], *s.shape[1:])
    q, s = _data_and_scale(t, func, s.contiguous(), out_splits, in_splits, group)
    return _like(t, q, s, (True, *t.scaled_dims[1:]))


@implements(_dist_op("_dtensor.shard_dim_alltoall.default"))
def _shard_dim_alltoall_data_and_scales(func, args, kwargs):
    """DTensor's Shard(a) -> Shard(b) all-to-all (CUDA path). The scale is made full-size on ``gather_dim``; a
    scale compact on ``shard_dim`` is expanded to ``group_size`` slots there, one (equal) slot per rank."""
    b = _bind(func, args, kwargs)
    t, gd, sd, group = b["input"], b["gather_dim"], b["shard_dim"], b["group_name"]
    gd, sd = gd % t.dim(), sd % t.dim()
    shape, dims = list(t.scale.shape), list(t.scaled_dims)
    if not dims[gd]:
        shape[gd], dims[gd] = t.shape[gd], True
    if not dims[sd]:
        shape[sd] = compat.process_group_size(group)
    q = func(_bytes(t.qdata), gd, sd, group)
    s = func(t.scale.expand(shape).contiguous(), gd, sd, group)
    return _like(t, q, s, tuple(dims))


# --------------------------------------------------------------------------------------------- c10d (in place)
def _check_fp8_list(op: str, tensors) -> bool:
    """True if the flat list holds ScaledFp8Tensors only; raise if it mixes them with other tensors."""
    n = sum(isinstance(t, ScaledFp8Tensor) for t in tensors)
    if n and n != len(tensors):
        raise NotImplementedError(f"ScaledFp8Tensor: {op} with a mix of ScaledFp8Tensor and other tensors")
    return n > 0


def _bytes_in_place(t: ScaledFp8Tensor, run) -> None:
    """``run(q)`` (a c10d op writing ``q``, ``t``'s fp8 bytes or a contiguous copy of them; its Work waited on), then
    ``q`` copied back into ``t`` where it is a copy."""
    q = t.qdata.view(torch.uint8) if t.qdata.is_contiguous() else _bytes(t.qdata)
    compat.wait_work(run(q))
    if q.data_ptr() != t.qdata.data_ptr():
        t.qdata.copy_(q.view(t.qdata.dtype))


def _contiguous_scale(t: ScaledFp8Tensor) -> torch.Tensor:
    """The scale of ``t``, replaced by a private contiguous copy first if it is a non-contiguous view."""
    if not t.scale.is_contiguous():
        t.scale = t.scale.contiguous()
    return t.scale


@implements(_dist_op("c10d.scatter_.default"))
def _scatter_data_and_scales(func, args, kwargs):
    """``distribute_tensor`` with Shard: scatter the fp8 bytes and the scales from the source rank in place.

    Raises:
        NotImplementedError: several output tensors, or ScaledFp8Tensors mixed with other tensors.
        TypeError / ValueError: a source shard with another fp8 dtype, shape or an incompatible scale layout.
    """
    b = _bind(func, args, kwargs)
    outs, ins = list(b["output_tensors"]), [list(x) for x in b["input_tensors"]]
    op = "c10d.scatter_"
    if not _check_fp8_list(op, outs + [t for lst in ins for t in lst]):
        return func(*args, **kwargs)
    if len(outs) != 1 or len(ins) > 1:
        raise NotImplementedError(f"ScaledFp8Tensor: {op} supports one output tensor per rank, got {len(outs)}")
    out = outs[0]
    srcs = ins[0] if ins else []
    for i, src in enumerate(srcs):
        if src.qdata.dtype != out.qdata.dtype:
            raise TypeError(f"ScaledFp8Tensor {op}: shard {i} is {src.qdata.dtype}, output is {out.qdata.dtype}")
        if tuple(src.shape) != tuple(out.shape):
            raise ValueError(f"ScaledFp8Tensor {op}: shard {i} has shape {tuple(src.shape)}, output {tuple(out.shape)}")
        if not _scale_fits(src.scale, out.scale):
            raise ValueError(
                f"ScaledFp8Tensor {op}: shard {i}'s scale {tuple(src.scale.shape)} does not fit the output's scale "
                f"layout {tuple(out.scale.shape)} (a scale can be expanded, never compacted)")
    s_out = _contiguous_scale(out)
    q_in = [[_bytes(src.qdata) for src in srcs]] if ins else []
    s_in = [[src.scale.expand(s_out.shape).contiguous() for src in srcs]] if ins else []
    rest = (b["process_group"], b["root_rank"], b["async_op"], b["timeout"])
    _bytes_in_place(out, lambda q: func([q], q_in, *rest)[1])
    _, work = func([s_out], s_in, *rest)
    return [out], work


@implements(_dist_op("c10d.broadcast_.default"))
def _broadcast_values(func, args, kwargs):
    """``broadcast_`` of a ScaledFp8Tensor (``distribute_tensor`` with Replicate; ``set_model_state_dict`` with
    ``broadcast_from_rank0``): one collective of the values in the logical dtype, which each receiving rank holding a
    ScaledFp8Tensor quantizes in its own layout, in place.

    The values travel, not the fp8 bytes and the scales, because a receiving rank may hold a plain tensor of the
    logical dtype (torch's state-dict broadcast allocates one): both sides post the same collective whatever the
    other holds. A tensor quantized from values of its logical dtype (``from_hp``, ``quantize_weights``: each row's
    largest code is the format's maximum) almost always round-trips: re-quantizing its dequantized values gives back
    its codes and scales, and the source keeps its tensor untouched. Where they do not round-trip (rows whose codes
    stay below the maximum, codes whose values fall among float16's subnormals), the source's tensor is re-quantized
    in place too (its views and aliases see it), so every rank holds the same bits, within fp8 rounding of the
    source (docs/tp.md, "What is communicated"). Nothing raises after the collective (a rank raising alone would
    leave the others in the next collective): a non-finite row stays non-finite on every rank.

    Raises ``NotImplementedError`` before the collective (the other ranks then wait in it): more than one tensor in
    the list, ScaledFp8Tensors mixed with other tensors, or a tensor whose scales stand for elements outside it (a
    view such as a column slice of a row-scaled tensor, or its copies; a view merging the scaled rows) or whose
    elements share memory (an expanded view)."""
    b = _bind(func, args, kwargs)
    tensors = list(b["tensors"])
    op = "c10d.broadcast_"
    if not _check_fp8_list(op, tensors):
        return func(*args, **kwargs)
    if len(tensors) != 1:
        raise NotImplementedError(f"ScaledFp8Tensor: {op} supports one tensor per call, got {len(tensors)}")
    t = tensors[0]
    if t.shares_scale or t.__dict__.get(_SCALE_COPY) or any(
            st == 0 and n > 1 for n, st in zip(t.qdata.shape, t.qdata.stride())):
        raise NotImplementedError(
            f"ScaledFp8Tensor {op}: the tensor ({tuple(t.shape)}, scale {tuple(t.scale.shape)}) is a view whose "
            "scales stand for elements outside it (such as a column slice of a row-scaled tensor), or an expanded "
            "view; broadcast the whole tensor, or a tensor quantized on its own (ScaledFp8Tensor.from_hp(t.to_hp()))")
    # (every rank's own values: the collective overwrites them on the receivers; a group that sends nothing keeps them)
    values = t.to_hp(t.orig_dtype).contiguous()
    rest = (b["process_group"], b["root_rank"], b["root_tensor"], b["async_op"], b["timeout"])
    _, work = func([values], *rest)
    compat.wait_work(work)
    q, s = quantize_like(values, t.scaled_dims, t.qdata.dtype)
    s = s.expand(t.scale.shape)
    if (compat.process_group_rank(b["process_group"]) == b["root_rank"]
            and torch.equal(q.view(torch.uint8), t.qdata.view(torch.uint8)) and torch.equal(s, t.scale)):
        return [t], work
    t.qdata.copy_(q)  # (in place, as a plain broadcast writes its receivers: views and aliases of t see it)
    if any(st == 0 and n > 1 for n, st in zip(t.scale.shape, t.scale.stride())):
        t.scale = s.contiguous()  # an expanded scale holds one value for many rows: t takes a scale of its own
    else:
        t.scale.copy_(s)
    return [t], work


# --------------------------------------------------------------------------------------------- padding
@implements([aten.constant_pad_nd.default, aten.pad.default])
def _pad_data_with_zeros_scale_with_ones(func, args, kwargs):
    """Zero-padding (DTensor's uneven shards): fp8 zeros, the scale padded with ones where scaled; other values or
    modes dequantize. (``aten.pad`` reaches the table inside DTensor's dispatch on torch 2.14.)"""
    b = _bind(func, args, kwargs)
    t, pad = b["self"], list(b["pad"])
    value = b.get("value", 0)
    if b.get("mode", "constant") != "constant" or (value is not None and value != 0):
        return func(t.to_hp(), *args[1:], **kwargs)
    spad = []
    for i in range(len(pad) // 2):
        d = t.dim() - 1 - i
        spad += pad[2 * i : 2 * i + 2] if t.scaled_dims[d] else [0, 0]
    q = aten.constant_pad_nd.default(t.qdata.view(torch.uint8), pad, 0)
    s = aten.constant_pad_nd.default(t.scale, spad, 1.0) if any(spad) else t.scale
    return _like(t, q, s)


# --------------------------------------------------------------------------------------------- master weights
keep_master_through([aten.constant_pad_nd.default, aten.pad.default] + [
    op for name in ("_c10d_functional.all_gather_into_tensor.default", "_c10d_functional.wait_tensor.default",
                    "_c10d_functional._wrap_tensor_autograd.default", "_c10d_functional.all_to_all_single.default",
                    "_dtensor.shard_dim_alltoall.default")
    for op in _dist_op(name)
])
