"""``Fp8MasterWeight``: a high-precision master weight that is quantized to fp8 on use (docs/design.md, "Training:
master weights and the fp8 Linear function")."""
from __future__ import annotations

import collections
import contextlib
import warnings

import torch
import torch.nn.functional as F

from ..numerics import fsdp_payload as _payload
from ..core import compat
from ..core.compat import register_foreach_type
from ..subclass.gemm import fp8_mm
from .grouped import fp8_grouped_mm, fp8_weight_call, grouped_mm_args, is_grouped_mm
from .linear import QuantizeOnUse, _quantize_local, fp8_linear
from ..numerics.quantize import FLOAT8_DTYPES
from .recipes import Recipe, get_recipe
from ..subclass.tensor import ScaledFp8Tensor, cache_hash, fsdp_post_all_gather, written_args

__all__ = ["Fp8MasterWeight", "keep_master_through"]


aten = torch.ops.aten

_PRESERVE = {
    aten.detach.default, aten.alias.default, aten.clone.default, aten.view.default, aten._unsafe_view.default,
    aten.reshape.default, aten.as_strided.default, aten.t.default, aten.transpose.int, aten.slice.Tensor,
    aten.select.int, aten.split.Tensor, aten.split_with_sizes.default, aten.cat.default, aten.new_zeros.default,
    aten.new_empty.default, aten.empty_like.default, aten._to_copy.default,
}


def keep_master_through(ops) -> None:
    """Add op overloads whose results stay :class:`Fp8MasterWeight` when their input is one (layout-preserving ops,
    DTensor's collectives); other ops on a master return plain tensors."""
    _PRESERVE.update(ops)


class Fp8MasterWeight(torch.Tensor, QuantizeOnUse):
    """A high-precision master weight that is quantized to fp8 on use.

    For everything but matmuls it behaves as the plain tensor ``_data`` it wraps (optimizers, init, ``.to()``;
    gradients are plain tensors; layout ops keep the wrapper). ``F.linear(x, w)`` runs :func:`fp8_linear` with its
    recipe, ``torch._grouped_mm`` with 3-D expert weights :func:`fp8tensor.grouped.fp8_grouped_mm`; a bare matmul
    (``F.linear`` on a DTensor of a master) runs grad_weight in high precision, with a warning. Under FSDP2 the
    master quantizes its local rows before the all-gather.

    Args: ``data``, the high-precision tensor (fp32/bf16/fp16; not copied), and ``recipe`` (a name or
    :class:`Recipe`). Raises ``TypeError``: ``data`` is not a floating-point tensor, or is fp8.
    """

    _data: torch.Tensor
    recipe: Recipe

    @staticmethod
    def __new__(cls, data: torch.Tensor, recipe="rowwise", requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            device=data.device, layout=data.layout, requires_grad=requires_grad,
        )

    def __init__(self, data: torch.Tensor, recipe="rowwise", requires_grad: bool = False):
        if not isinstance(data, torch.Tensor) or not data.dtype.is_floating_point or data.dtype in FLOAT8_DTYPES:
            raise TypeError("Fp8MasterWeight: expected a high-precision floating-point tensor, got "
                            f"{getattr(data, 'dtype', type(data))}")
        if isinstance(data, ScaledFp8Tensor):  # (reads as its high-precision dtype, but holds fp8 values)
            raise TypeError("Fp8MasterWeight: expected a high-precision floating-point tensor, got a ScaledFp8Tensor "
                            "(fp8 storage, which an optimizer step cannot update); pass its values, t.to_hp()")
        if isinstance(data, Fp8MasterWeight):
            data = data._data
        self._data = data
        self.recipe = get_recipe(recipe)

    def __tensor_flatten__(self):
        return ["_data"], (self.recipe,)

    def _stable_hash_for_caching(self) -> str:
        """The AOTAutograd cache key of this master as a graph input (``fp8tensor.tensor.cache_hash``)."""
        return cache_hash(self, (self.recipe,))

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Fp8MasterWeight(inner["_data"], ctx[0])

    def __repr__(self) -> str:
        return f"Fp8MasterWeight(recipe={self.recipe.name!r}, data={self._data!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if isinstance(weight, Fp8MasterWeight):
                inp = args[0] if args else kwargs["input"]
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                return fp8_linear(inp, weight, bias, recipe=weight.recipe)
        if is_grouped_mm(func):
            call = fp8_weight_call(args, kwargs)
            if call is not None and isinstance(call[1], Fp8MasterWeight):
                a, b, offs, out_dtype, recipe = call
                return fp8_grouped_mm(a, b, offs, recipe=recipe, out_dtype=out_dtype)
        if func == compat.DATA_SETTER and isinstance(args[0], Fp8MasterWeight):
            # ``w.data = t`` (also Module.to(dtype)): replace the wrapped data too; an fp8 ``t`` gives its values
            # (as ``w.copy_(t)``): a master holds high precision
            src = args[1].to_hp() if isinstance(args[1], ScaledFp8Tensor) else args[1]
            new = src if isinstance(src, Fp8MasterWeight) else Fp8MasterWeight(src, args[0].recipe)
            with compat.disable_torch_function_subclass():
                func(args[0], new)
            args[0]._data = new._data
            return None
        with compat.disable_torch_function_subclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GEMMS:
            return _master_mm(func, args, kwargs)
        if func is aten._grouped_mm.default:
            out = _master_grouped_mm(func, args, kwargs)
            if out is not None:
                return out
        # aten arguments are tensors or lists / tuples of them (fused optimizer steps): no general pytree walk
        masters = []
        u_args = tuple(_unwrap(a, masters) for a in args)
        u_kwargs = {k: _unwrap(v, masters) for k, v in kwargs.items()} if kwargs else kwargs
        out = func(*u_args, **u_kwargs)
        mutable = compat.op_schema(func).is_mutable
        if masters and mutable:
            _bump_written_versions(func, args, kwargs)
        if out is None:
            return None
        if mutable:
            # In-place / out= ops (optimizer steps, copy_, init): the inner data was updated; return wrappers.
            inner_to_outer = {id(m._data): m for m in masters}
            return _map_tensors(out, lambda t: inner_to_outer.get(id(t), t))
        if func in _PRESERVE:
            recipe, dtype = masters[0].recipe, masters[0].dtype
            # (a view of a normal master under inference mode: its wrapper made outside inference mode, so autograd
            # can share the base's version counter with it, as a plain view of a normal tensor; an inference tensor
            # has none. No op runs inside the block. Other outputs, and views of inference masters, stay as made.)
            view = any(r.alias_info is not None for r in compat.op_schema(func).returns)
            leave = view and torch.is_inference_mode_enabled() and not args[0].is_inference()
            with torch.inference_mode(False) if leave else contextlib.nullcontext():
                return _map_tensors(out, lambda t: Fp8MasterWeight(t, recipe) if t.dtype == dtype else t)
        return out

    def share_memory_(self) -> "Fp8MasterWeight":
        """``Tensor.share_memory_`` (``nn.Module.share_memory``): moves the wrapped high-precision data to shared
        memory (a no-op on CUDA) and returns this master. (The wrapper has no storage of its own: torch's
        implementation would crash on it.)"""
        self._data.share_memory_()
        return self

    def is_shared(self) -> bool:
        """``Tensor.is_shared``: whether the wrapped high-precision data is in shared memory."""
        return self._data.is_shared()

    # FSDP2 all-gather extension: quantize local rows, gather fp8 data + row scales.
    @_payload.pre_all_gather_hook
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return _payload.master_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        res = fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)
        if res is not None and self.dim() == 3:  # expert weights: their grouped GEMMs stay fp8_grouped_mm
            res = (GatheredExperts.of(res[0], self.recipe), res[1])
        return res

    def __reduce_ex__(self, protocol):
        # pickles as the plain high-precision tensor (or Parameter): a checkpoint never needs fp8tensor to load
        if compat.is_parameter_marked(self):
            return (compat.rebuild_parameter(), (self._data, self.requires_grad, collections.OrderedDict()))
        return self._data.__reduce_ex__(protocol)


_GEMMS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def _unwrap(a, masters: list):
    """``a`` with every master (also in lists / tuples) replaced by its ``_data``, appended to ``masters``."""
    if isinstance(a, Fp8MasterWeight):
        masters.append(a)
        return a._data
    if type(a) in (list, tuple):
        return type(a)(_unwrap(x, masters) for x in a)
    return a


def _bump_written_versions(func, args, kwargs) -> None:
    """Bump the version of the data of every master ``func`` wrote (the FSDP2 payload's kept results key on it)."""
    for v in written_args(func, args, kwargs):
        if isinstance(v, Fp8MasterWeight):
            torch.autograd.graph.increment_version(v._data)  # one tensor per call: the form every torch takes


def _map_tensors(out, fn):
    """``fn`` applied to every tensor of an op result (a tensor, or lists / tuples of them)."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if type(out) in (list, tuple):
        return type(out)(_map_tensors(x, fn) for x in out)
    return out


_PARTIAL_RECIPE = (
    "fp8tensor: a matmul on an Fp8MasterWeight outside fp8_linear (F.linear on a DTensor whose local tensor is a "
    "master, e.g. a weight swapped in without convert_to_fp8, or torch.mm / @ on a master) runs its forward and "
    "grad_input GEMMs in fp8, but autograd computes the weight gradient from plain tensors: grad_weight in high "
    "precision. convert_to_fp8(model) (before or after parallelizing) runs all three GEMMs in fp8."
)


def _master_mm(func, args, kwargs):
    """A bare ``mm``/``addmm`` on a master (quantized along the contraction dim); warns with gradients enabled."""
    if torch.is_grad_enabled():  # a forward that records autograd (the backward's own mm runs without grad mode)
        warnings.warn(_PARTIAL_RECIPE, stacklevel=2)
    bias, a, b = args[:3] if func is torch.ops.aten.addmm.default else (None, *args[:2])
    if isinstance(a, Fp8MasterWeight):
        a = _quantize_local(a._data, 1, True)
    if isinstance(b, Fp8MasterWeight):
        b = _quantize_local(b._data.t(), 1, True).t()
    if isinstance(bias, Fp8MasterWeight):
        bias = bias._data
    if func is torch.ops.aten.addmm.default:
        beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
        alpha = kwargs.get("alpha", args[4] if len(args) > 4 else 1)
        if not (beta == 1 and alpha == 1):
            return torch.addmm(bias, (a.to_hp() if isinstance(a, ScaledFp8Tensor) else a),
                               (b.to_hp() if isinstance(b, ScaledFp8Tensor) else b), beta=beta, alpha=alpha)
    return fp8_mm(a, b, bias, op=str(func))


def _master_grouped_mm(func, args, kwargs):
    """``aten._grouped_mm`` of 2-D tokens and a 3-D master ``(E, K, N)`` (an exported program's, or one that reached
    the dispatcher without ``__torch_function__``): the master quantized per expert row (over ``K``), then the fp8
    GEMM of the op table; None for other forms (they run on the plain data). Warns, as :func:`_master_mm`, when
    autograd records it (grad_weight would be autograd's high-precision one)."""
    a, b, offs, bias, out_dtype = grouped_mm_args(args, kwargs)
    if (not isinstance(b, Fp8MasterWeight) or isinstance(a, Fp8MasterWeight) or a.dim() != 2 or b.dim() != 3
            or bias is not None or offs is None):
        return None
    if torch.is_grad_enabled():
        warnings.warn(_PARTIAL_RECIPE, stacklevel=2)
    b8 = _quantize_local(b._data, -2, True, b.recipe.float8_dtype)  # (E, K, N) with scales (E, 1, N), as forward
    return torch._grouped_mm(a, b8, offs=offs, out_dtype=out_dtype or torch.promote_types(a.dtype, b.dtype))


class GatheredExperts(ScaledFp8Tensor):
    """The 3-D expert weight FSDP2 all-gathers from an :class:`Fp8MasterWeight`: a :class:`ScaledFp8Tensor` (one scale
    per expert row) whose ``torch._grouped_mm`` runs :func:`~fp8tensor.grouped.fp8_grouped_mm` with the master's
    recipe (also under ``torch.compile``, where no mode sees that call); its ScaledFp8Tensor results keep the type."""

    recipe: Recipe

    @staticmethod
    def of(t: ScaledFp8Tensor, recipe: Recipe) -> "GatheredExperts":
        """``t``'s data and scales (no copy) as a GatheredExperts of ``recipe``."""
        out = GatheredExperts(t.qdata, t.scale, t.orig_dtype, t.fast_accum, shares_scale=t.shares_scale,
                              scale_writes=t._scale_writes, scaled_dims=t.scaled_dims, _trusted=True)
        out.recipe = recipe
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_grouped_mm(func):
            call = fp8_weight_call(args, kwargs)
            if call is not None and isinstance(call[1], GatheredExperts):
                a, b, offs, out_dtype, _ = call
                return fp8_grouped_mm(a, b, offs, recipe=b.recipe, out_dtype=out_dtype)
        with compat.disable_torch_function_subclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        recipe = next((t.recipe for a in (*args, *(kwargs or {}).values())
                       for t in (a if type(a) in (list, tuple) else (a,)) if isinstance(t, GatheredExperts)), None)
        if recipe is None:
            return out
        return _map_tensors(out, lambda t: GatheredExperts.of(t, recipe) if type(t) is ScaledFp8Tensor else t)

    def __tensor_flatten__(self):
        names, ctx = super().__tensor_flatten__()
        return names, (*ctx, self.recipe)

    def _stable_hash_for_caching(self) -> str:
        """The AOTAutograd cache key of these gathered experts as a graph input (with their recipe)."""
        return cache_hash(self, (self.orig_dtype, self.fast_accum, self.shares_scale, self.scaled_dims, self.recipe))

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        t = ScaledFp8Tensor.__tensor_unflatten__(inner_tensors, ctx[:-1], outer_size, outer_stride)
        return GatheredExperts.of(t, ctx[-1])


# optimizers choose foreach / fused by each parameter's exact type: a master must not force the for-loop step
register_foreach_type(Fp8MasterWeight)
