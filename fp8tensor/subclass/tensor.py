"""``ScaledFp8Tensor`` (fp8 data plus float32 scales, a ``__torch_dispatch__`` wrapper subclass), its op table
(``OP_TABLE``, :func:`implements`) and dispatcher; docs/design.md ("One tensor class", "The op table")."""
from __future__ import annotations

import hashlib
import warnings
from typing import Any, Callable, Optional, Sequence

import torch

from ..core import compat
from ..numerics import fsdp_payload as _payload
from ..numerics.quantize import E4M3, FLOAT8_DTYPES, amax_to_scale, cast_to_fp8, check_float8_dtype, quantize
from ..core.settings import get_config, traced_settings

__all__ = ["ScaledFp8Tensor", "dequantize", "OP_TABLE", "implements", "validate_parts", "make_scaled", "rowwise_dims"]

#: The op table: aten op overload -> ``handler(func, args, kwargs)``. Filled by :func:`implements` (in
#: :mod:`fp8tensor.ops`, :mod:`fp8tensor.gemm`, :mod:`fp8tensor.collectives`).
OP_TABLE: dict = {}


def implements(ops: Sequence) -> Callable:
    """Register ``fn(func, args, kwargs)`` as the handler of each aten op overload in ``ops``; ``RuntimeError`` if an
    op already has one."""

    def deco(fn):
        for op in ops:
            prev = OP_TABLE.get(op)
            if prev is not None:
                raise RuntimeError(f"ScaledFp8Tensor op table: {op} already has a handler ({prev.__module__}."
                                   f"{prev.__qualname__}); refusing to register {fn.__module__}.{fn.__qualname__}")
            OP_TABLE[op] = fn
        return fn

    return deco


_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "fsdp")


def written_args(func, args, kwargs) -> list:
    """The arguments op ``func`` writes (in place or ``out=``), lists and tuples of them flattened one level."""
    out = []
    for i, arg in enumerate(compat.op_schema(func).arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        val = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
        out.extend(val if isinstance(val, (list, tuple)) else [val])
    return out


_IMPLICIT = compat.COMPOSITE_IMPLICIT


def _dispatch(cls, func, types, args=(), kwargs=None):
    """``__torch_dispatch__``: the op table, else composite ops decomposed, out-of-place ops dequantized; in-place /
    ``out=`` writes, collectives and view ops without an entry (unless ``unknown_ops="allow"``: a dequantized copy)
    raise ``NotImplementedError`` naming the op."""
    kwargs = kwargs or {}
    handler = OP_TABLE.get(func)
    if handler is not None:
        return handler(func, args, kwargs)
    if func.has_kernel_for_dispatch_key(_IMPLICIT):
        # composite ops (chunk, narrow, ...) reach us only below autograd (DTensor's local ops): the table sees parts
        out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
    name = str(func)
    if func.namespace in _COLLECTIVE_NAMESPACES:
        raise NotImplementedError(f"ScaledFp8Tensor: collective op {name} is not implemented for fp8 data and scales")
    if any(isinstance(v, ScaledFp8Tensor) for v in written_args(func, args, kwargs)):
        if any(getattr(a, "is_out", False) for a in compat.op_schema(func).arguments):
            raise NotImplementedError(f"ScaledFp8Tensor: out= op {name} into a ScaledFp8Tensor is not supported")
        raise NotImplementedError(
            f"ScaledFp8Tensor: in-place op {name} would modify fp8-stored data, which loses updates to rounding. "
            "Train with a high-precision master weight (fp8tensor.convert_to_fp8) and quantize on use instead. "
            "(Under FSDP2 a converted weight is all-gathered as fp8: between forward and reshard "
            "(reshard_after_forward=False) the module holds that fp8 copy; call model.reshard() and write the "
            "sharded parameter.) To set new values, copy_ them in (quantized per row)."
        )
    if _returns_view(func) and get_config().unknown_ops != "allow":
        # (a view of the dequantized copy would look like a view of t to autograd, and writes through it would
        # change the copy only: silently lost; under "allow" the user takes the dequantized values as they are)
        raise NotImplementedError(
            f"ScaledFp8Tensor: view op {name} has no fp8 implementation; a view of the dequantized values would not "
            "share the fp8 data, so writes through it would be lost. Take a high-precision copy first "
            "(fp8tensor.dequantize(t)) and view that, or, to read dequantized values and never write through them, "
            "enter `with fp8tensor.config(unknown_ops='allow'):`")
    _unknown_op(name)
    args, kwargs = compat.tree_map_only(ScaledFp8Tensor, lambda t: t.to_hp(), (args, kwargs))
    return func(*args, **kwargs)


def _returns_view(func) -> bool:
    """Whether op ``func`` returns an alias of an input (a view op; in-place and ``out=`` returns excluded)."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in compat.op_schema(func).returns)


#: Ops already warned about by :func:`_unknown_op` (once per op and process).
_WARNED_OPS: set = set()


def _unknown_op(name: str) -> None:
    """Per ``get_config().unknown_ops``: warn once per op (default), raise, or allow running ``name`` dequantized."""
    policy = get_config().unknown_ops
    if policy == "allow":
        return
    what = (f"ScaledFp8Tensor: {name} has no fp8 implementation; it runs in high precision on the dequantized "
            "tensors (correct, but not fp8: a missing op table entry")
    if policy == "raise":
        raise NotImplementedError(what + "); under `with fp8tensor.config(unknown_ops='warn'):` it runs dequantized)")
    if name not in _WARNED_OPS:
        _WARNED_OPS.add(name)
        warnings.warn(what + "; dequantize explicitly with fp8tensor.dequantize(t) to silence this, or set "
                      "fp8tensor.set_config(unknown_ops='allow'))", UserWarning, stacklevel=3)


class _ScaleWrites:
    """Regions of a shared scale written by ``copy_`` since its values last changed (``ops._shared_scale_write_ok``);
    any two compare equal (no compiled-graph guard on it)."""

    __slots__ = ("regions",)

    def __init__(self, regions=()):
        self.regions = dict(regions)  # {(storage offset, shape, stride) of the data written: its scale elements}

    def __eq__(self, other):
        return isinstance(other, _ScaleWrites)

    def __hash__(self):
        return 0

    def __repr__(self):
        return f"_ScaleWrites({len(self.regions)} regions)"


try:  # resolved once at import: a cache filled on first use would be a side effect inside a traced
    # autograd.Function (dynamo then keeps every intermediate of its forward and rejects saved fp8 views)
    from torch.distributed.tensor import DTensor as _DTENSOR
except Exception:  # pragma: no cover - builds without distributed
    _DTENSOR = False


def _dtensor_cls():
    """``torch.distributed.tensor.DTensor``; False on builds without distributed."""
    return _DTENSOR


def _is_dtensor(t: Any) -> bool:
    cls = _dtensor_cls()
    return cls is not False and isinstance(t, cls)


def local_of(t: Any) -> Any:
    """The local tensor of a DTensor (without autograd), else ``t`` itself."""
    return compat.local_tensor(t) if _is_dtensor(t) else t


def _is_local_tensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed._local_tensor.LocalTensor`` (one tensor per simulated rank)."""
    cls = type(t)
    if cls is torch.Tensor or cls.__name__ != "LocalTensor":
        return False
    cls = compat.local_tensor_cls()
    return cls is not None and isinstance(t, cls)


def map_local(t: Any, fn):
    """Apply ``fn`` to a tensor, or to the local tensor of a DTensor, keeping mesh, placements, shape and stride
    (without autograd, outside ``torch.compile``: wrapped with ``t``'s own spec directly)."""
    cls = _dtensor_cls()
    if cls is False or not isinstance(t, cls):
        return map_shard(t, fn)
    # (not in inference mode: from_local's view_as dequantizes there, a separate bug; keep from_local's result)
    direct = (not compat.is_compiling() and not (torch.is_grad_enabled() and t.requires_grad)
              and not torch.is_inference_mode_enabled())
    if direct:
        local = compat.local_tensor(t)
        out = map_shard(local, fn)
        if out.shape == local.shape and out.dtype == t.dtype and not out.requires_grad:
            return cls(out, compat.dtensor_spec(t), requires_grad=False)
    else:
        out = map_shard(t.to_local(), fn)
    return cls.from_local(out, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


class _Miss(Exception):
    """A simulated rank's ``fn`` of :func:`map_local_each` returned None."""


def map_local_each(t: Any, fn) -> Optional[tuple]:
    """:func:`map_local` for an ``fn`` that returns a tuple of tensors of the local tensor's shape and dtype (or None):
    each wrapped with ``t``'s mesh, placements, shape and stride. None where ``fn`` returns None (on any simulated
    rank of a ``LocalTensor``)."""
    cls = _dtensor_cls()
    if cls is False or not isinstance(t, cls):
        return fn(t)
    direct = (not compat.is_compiling() and not (torch.is_grad_enabled() and t.requires_grad)
              and not torch.is_inference_mode_enabled())
    local = compat.local_tensor(t) if direct else t.to_local()
    if _is_local_tensor(local):  # one run per simulated rank; a miss on any rank is a miss
        def each(lt):
            out = fn(lt)
            if out is None:
                raise _Miss
            return out
        try:
            outs = map_shard(local, each)
        except _Miss:
            return None
    else:
        outs = fn(local)
    if outs is None:
        return None
    if direct and all(o.shape == local.shape and o.dtype == t.dtype and not o.requires_grad for o in outs):
        spec = compat.dtensor_spec(t)
        return tuple(cls(o, spec, requires_grad=False) for o in outs)
    return tuple(cls.from_local(o, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
                 for o in outs)


def map_shard(local: torch.Tensor, fn):
    """``fn(local)``, per simulated rank for a ``LocalTensor`` (a subclass it builds ends up inside it)."""
    return compat.run_per_simulated_rank(fn)(local) if _is_local_tensor(local) else fn(local)


#: The error of reading a ScaledFp8Tensor's storage as one tensor's (safetensors, Hugging Face ``save_pretrained``).
_NO_STORAGE = (
    "fp8tensor: a ScaledFp8Tensor (fp8 data + float32 scales) has no single storage to read or write as one tensor "
    "(safetensors, Hugging Face save_pretrained). To save, use the plain fp8 layout (weight + weight_scale): "
    "`with fp8tensor.config(state_dict_fp8=\"plain\"): model.save_pretrained(d)` (or safetensors.torch.save_model), "
    "or safetensors.torch.save_file(fp8tensor.plain_state_dict(model.state_dict()), f); to load such a file, "
    "fp8tensor.load_safetensors(model, path) (or safetensors.torch.load_model inside the same config block); "
    "torch.save keeps the ScaledFp8Tensor as it is"
)


class ScaledFp8Tensor(torch.Tensor):
    """A tensor stored as fp8 data with float32 scales; it reads as the high-precision tensor it encodes,
    ``qdata.float() * scale`` (the scale is the *dequantization multiplier*).

    Attributes:
        qdata: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` tensor, the logical shape.
        scale: float32 tensor with ``qdata.ndim`` dims, each dim either 1 (not scaled over) or ``qdata``'s size
            (:meth:`from_hp` of an ``(N, K)`` weight: ``(N, 1)``; ``.t()`` makes it ``(1, N)``).
        orig_dtype: the high-precision dtype (``.dtype`` of this tensor; output dtype of its GEMMs).
        fast_accum: whether its GEMMs may use fp8 fast accumulation (default True; backward operands use False).
        shares_scale: whether this is a view whose scales also scale elements outside it (``copy_`` guards them).
        scaled_dims: one bool per dim, True where there is one scale per index (the scale has the data's size),
            False where one scale is shared along it: the *declared* layout every op decides from; when not given it
            is read from the shapes (a size-1 dim is scaled if another dim is unambiguously shared).

    ``shape``, ``stride``, ``device`` and ``dtype`` are the logical ones. Ops outside the op table run dequantized
    (out-of-place) or raise ``NotImplementedError`` (in-place, ``out=``, collectives); ``.to(fp8 dtype)`` raises
    ``TypeError``. The public constructor checks its arguments (:func:`validate_parts`); op results do not.

    Raises:
        TypeError: ``qdata`` is not an fp8 tensor, ``scale`` is not float32, or ``orig_dtype`` is not floating point.
        ValueError: ``scale`` does not have ``qdata``'s ndim, a scale dim is neither 1 nor ``qdata``'s size, a scale
            is not finite and positive, or ``scaled_dims`` does not match the shapes.
    """

    qdata: torch.Tensor
    scale: torch.Tensor
    orig_dtype: torch.dtype
    fast_accum: bool
    shares_scale: bool
    scaled_dims: tuple

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, orig_dtype: torch.dtype, fast_accum: bool = True,
                requires_grad: bool = False, **kwargs):  # (keywords: those of __init__)
        return torch.Tensor._make_wrapper_subclass(
            cls, qdata.shape, strides=qdata.stride(), storage_offset=qdata.storage_offset(), dtype=orig_dtype,
            device=qdata.device, layout=qdata.layout, requires_grad=requires_grad,
        )

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, orig_dtype: torch.dtype, fast_accum: bool = True,
                 requires_grad: bool = False, *, shares_scale: bool = False,
                 scale_writes: Optional[_ScaleWrites] = None, scaled_dims: Optional[Sequence[bool]] = None,
                 _trusted: bool = False):
        if not _trusted:  # the public constructor; op results come through make_scaled (no checks)
            scaled_dims = validate_parts(qdata, scale, orig_dtype, scaled_dims, "ScaledFp8Tensor")
        _set_parts(self, qdata, scale, orig_dtype, fast_accum, shares_scale, scale_writes, scaled_dims)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hp(cls, t: torch.Tensor, float8_dtype: torch.dtype = E4M3, *, fast_accum: bool = True
                ) -> "ScaledFp8Tensor":
        """Quantize ``t`` row-wise: one float32 scale per row, taken over the last dim.

        ``scale = amax(|row|) / finfo(float8_dtype).max`` (float32), ``qdata = saturate(t / scale)``; all-zero rows
        dequantize to exact zeros. The result does not require grad.

        Args:
            t: floating-point tensor with at least 2 dims (fp32, bf16, fp16, fp64), or a DTensor / ``LocalTensor``
                of one (each local shard quantized; same mesh, placements, shape and stride).
            float8_dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``; fast_accum: stored on the result.

        Returns:
            ScaledFp8Tensor with ``qdata`` of ``t``'s shape and ``scale`` ``(*t.shape[:-1], 1)`` (per
            :func:`fp8tensor.quantize.amax_to_scale`), ``scaled_dims == (True, ..., True, False)``.

        Raises:
            TypeError: ``t`` is not a floating-point tensor, is already fp8, or ``float8_dtype`` is unsupported.
            ValueError: ``t`` has fewer than 2 dims, or holds an inf or NaN (naming the rows; not checked while
                tracing or capturing).
        """
        op = "ScaledFp8Tensor.from_hp"
        check_float8_dtype(float8_dtype, op)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: expected a torch.Tensor, got {type(t).__name__}")
        if isinstance(t, ScaledFp8Tensor):
            raise TypeError(f"{op}: input is already a ScaledFp8Tensor; call .to_hp() first to re-quantize")
        if _is_dtensor(t) or _is_local_tensor(t):
            return map_local(t, lambda lt: cls.from_hp(lt, float8_dtype, fast_accum=fast_accum))
        if t.dtype in FLOAT8_DTYPES or not t.dtype.is_floating_point:
            raise TypeError(f"{op}: expected a high-precision floating-point tensor, got dtype {t.dtype}")
        if t.ndim < 2:
            raise ValueError(f"{op}: expected a tensor with at least 2 dims (rows × columns), got shape {tuple(t.shape)}")
        t = (t.data if type(t) is torch.nn.Parameter else t).detach()  # (a plain view of a plain Parameter)
        check_finite_rows(t, op)
        qdata, scale = quantize(t, -1, float8_dtype)
        return make_scaled(qdata, scale, t.dtype, fast_accum, rowwise_dims(t.ndim, -1))

    def to_hp(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Dequantize: ``(qdata.float() * scale).to(dtype or orig_dtype)``; a plain tensor of the logical shape."""
        return (self.qdata.to(torch.float32) * self.scale).to(dtype or self.orig_dtype)

    def with_fast_accum(self, fast_accum: bool) -> "ScaledFp8Tensor":
        """Same data and scale (no copy), with the given fast-accumulation flag."""
        return make_scaled(self.qdata, self.scale, self.orig_dtype, fast_accum, self.scaled_dims,
                           shares_scale=self.shares_scale, scale_writes=self._scale_writes)

    def scale_writes(self) -> _ScaleWrites:
        """The write bookkeeping of this tensor's scale (created on first use; shared by its views)."""
        if self._scale_writes is None:
            self._scale_writes = _ScaleWrites()
        return self._scale_writes

    @property
    def float8_dtype(self) -> torch.dtype:
        """The fp8 storage dtype of ``qdata``."""
        return self.qdata.dtype

    # ------------------------------------------------------------------ subclass protocol
    def __tensor_flatten__(self):
        ctx = (self.orig_dtype, self.fast_accum, self.shares_scale, self._scale_writes, self.scaled_dims)
        return ["qdata", "scale"], ctx

    def _stable_hash_for_caching(self) -> str:
        """The AOTAutograd cache key of this tensor as a graph input (:func:`cache_hash`; the record of scale writes
        left out: it compares equal to any other)."""
        return cache_hash(self, (self.orig_dtype, self.fast_accum, self.shares_scale, self.scaled_dims))

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        orig_dtype, fast_accum, shares_scale, scale_writes, scaled_dims = ctx
        return make_scaled(inner_tensors["qdata"], inner_tensors["scale"], orig_dtype, fast_accum, scaled_dims,
                           shares_scale=shares_scale, scale_writes=scale_writes)

    __torch_dispatch__ = classmethod(_dispatch)

    def storage(self):
        """Raises ``RuntimeError`` naming the plain layout: the values live in two tensors, not one storage."""
        raise RuntimeError(_NO_STORAGE)

    def share_memory_(self) -> "ScaledFp8Tensor":
        """``Tensor.share_memory_`` (``nn.Module.share_memory``): moves the fp8 data and the scales to shared memory
        (a no-op on CUDA) and returns this tensor. (The wrapper has no storage of its own: torch's implementation
        would crash on it.)"""
        self.qdata.share_memory_()
        self.scale.share_memory_()
        return self

    def is_shared(self) -> bool:
        """``Tensor.is_shared``: whether the fp8 data and the scales are in shared memory."""
        return self.qdata.is_shared() and self.scale.is_shared()

    __torch_function__ = compat.DISABLED_TORCH_FUNCTION

    @property
    def data(self) -> "ScaledFp8Tensor":
        """A detached alias (``Tensor.data``): writes into it (``t.data.copy_(new)``) write this tensor."""
        return compat.DATA_GETTER(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        """``t.data = new``: ``t`` takes ``new``'s values and shape (a high-precision ``new`` quantized in ``t``'s
        layout). Raises ``TypeError``: ``new`` is not a floating-point tensor, or is a plain fp8 tensor;
        ``ValueError``: a high-precision ``new`` holds an inf or NaN (naming the rows; ``t`` unchanged)."""
        if not isinstance(new, ScaledFp8Tensor):
            if not isinstance(new, torch.Tensor) or not new.dtype.is_floating_point or new.dtype in FLOAT8_DTYPES:
                raise TypeError(
                    f"ScaledFp8Tensor.data = ...: expected a ScaledFp8Tensor or a high-precision floating-point "
                    f"tensor, got {getattr(new, 'dtype', type(new))}")
            if new.dim() != self.dim():
                raise TypeError(f"ScaledFp8Tensor.data = ...: expected a tensor of {self.dim()} dims (this tensor's "
                                f"scale layout), got shape {tuple(new.shape)}")
            check_finite_rows(new.detach(), "ScaledFp8Tensor.data = ...")
            q, sc = quantize_like(new.detach().to(torch.float32), self.scaled_dims, self.qdata.dtype)
            new = make_scaled(q, sc, new.dtype, self.fast_accum, self.scaled_dims)
        compat.DATA_SETTER(self, new)
        self.qdata, self.scale = new.qdata, new.scale
        self.orig_dtype, self.scaled_dims = new.orig_dtype, new.scaled_dims
        self.shares_scale, self._scale_writes = new.shares_scale, new._scale_writes

    def __repr__(self) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (f"ScaledFp8Tensor(shape={tuple(self.shape)}, qdata_dtype={self.qdata.dtype}, "
                f"scale_shape={tuple(self.scale.shape)}, orig_dtype={self.orig_dtype}, device={self.device}{grad})")

    # ------------------------------------------------------------------ FSDP2 all-gather extension
    @_payload.pre_all_gather_hook
    @torch.no_grad()
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """FSDP2 hook: all-gather the fp8 rows and their scales as stored (:mod:`fp8tensor.fsdp`);
        ``NotImplementedError`` for fewer than 2 dims."""
        return _payload.scaled_pre_all_gather(self, mesh, outer_size)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """FSDP2 hook: the unsharded ScaledFp8Tensor from the gathered rows and scales (see :mod:`fp8tensor.fsdp`)."""
        return fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)

    # ------------------------------------------------------------------ serialization
    def __reduce_ex__(self, protocol):
        # fp8 storages do not survive plain pickle in every torch version: send the bytes as uint8
        return (_rebuild_scaled_fp8, (self.qdata.view(torch.uint8), self.scale, self.orig_dtype, self.fast_accum,
                                      self.requires_grad, compat.is_parameter_marked(self), self.qdata.dtype,
                                      self.shares_scale, self.scaled_dims))

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        out = _rebuild_scaled_fp8(self.qdata.clone(), self.scale.clone(), self.orig_dtype, self.fast_accum,
                                  self.requires_grad, compat.is_parameter_marked(self),
                                  shares_scale=self.shares_scale, scaled_dims=self.scaled_dims)
        if self._scale_writes is not None:
            out._scale_writes = _ScaleWrites(self._scale_writes.regions)
        memo[id(self)] = out
        return out


# ---------------------------------------------------------------------------------------------- layout and checks
def quantize_like(x: torch.Tensor, scaled_dims, float8_dtype: torch.dtype) -> tuple:
    """``(qdata, scale)`` of ``x`` in ``float8_dtype`` with the layout ``scaled_dims`` (empty reductions: amax 0)."""
    dims = [d for d in range(x.ndim) if not scaled_dims[d]]
    if not dims:
        amax = x.abs()
    elif any(x.shape[d] == 0 for d in dims):
        amax = x.new_zeros([1 if d in dims else n for d, n in enumerate(x.shape)])
    else:
        amax = x.abs().amax(dim=dims, keepdim=True)
    scale = amax_to_scale(amax, float8_dtype)
    return cast_to_fp8(x, scale, float8_dtype), scale


def cache_hash(t: torch.Tensor, ctx: tuple) -> str:
    """``_stable_hash_for_caching`` of fp8tensor's tensor subclasses: the AOTAutograd cache key of ``t`` as an input
    of a compiled graph (torch >= 2.12 asks traceable subclasses for one): its type, shape and ``requires_grad``, its
    flatten metadata ``ctx`` (deterministic reprs), its parts' metadata, and :func:`fp8tensor.config`'s
    ``TRACED_SETTINGS``. Those settings are read by the ops AOTAutograd traces below dynamo, so a graph dynamo
    recompiled under other settings looks the same to the cache: without them the cache returned the graph compiled
    under the old ones. Torch 2.11 keys subclass inputs otherwise (docs/design.md, "Settings and tracing state")."""
    names, _ = t.__tensor_flatten__()
    parts = []
    for name in names:
        p = getattr(t, name)
        parts.append((name, str(p.dtype), tuple(str(n) for n in p.shape), tuple(str(n) for n in p.stride()),
                      p.device.type, str(p.storage_offset()), p.requires_grad))  # (plain tensors)
    payload = (type(t).__qualname__, tuple(str(n) for n in t.shape), t.requires_grad, ctx, tuple(parts),
               traced_settings())
    return hashlib.blake2b(repr(payload).encode(), digest_size=16).hexdigest()


def check_finite_rows(t: torch.Tensor, what: str) -> None:
    """Raise ``ValueError`` (starting with ``what``) naming the rows of plain ``t`` that hold an inf or NaN, or for
    float64 ``t`` a value beyond float32's range (its float32 scale would be inf) (a host sync on CUDA; skipped for
    empty, meta or fake tensors, while tracing and capturing)."""
    if (t.numel() == 0 or t.ndim < 1 or t.device.type == "meta" or compat.is_fake(t) or compat.is_compiling()
            or compat.is_functorch_wrapped(t) or (t.is_cuda and torch.cuda.is_current_stream_capturing())):
        return
    wide = t.dtype == torch.float64  # (its finite values can pass float32's range, where the float32 scale is inf)
    bad = ~(t.abs() <= _FLOAT32_MAX).all(dim=-1) if wide else ~torch.isfinite(t).all(dim=-1)
    if not bool(bad.any()):
        return
    idx = bad.nonzero()
    rows = [int(i[0]) if len(i) == 1 else tuple(int(v) for v in i) for i in idx[:8].tolist()]
    more = f" (first 8 of {len(idx)})" if len(idx) > 8 else ""
    what_bad = "inf, NaN or values beyond float32's range (the scales are float32)" if wide else "inf or NaN"
    raise ValueError(
        f"{what}: {what_bad} in {len(idx)} row(s) of a tensor of shape {tuple(t.shape)}: rows {rows}{more}; "
        "quantized, each such row would be all NaN (its scale is non-finite). Fix or zero those values first")


_FLOAT32_MAX = torch.finfo(torch.float32).max


def rowwise_dims(ndim: int, dim: int) -> tuple:
    """``scaled_dims`` of a quantization reduced over ``dim``: one scale per index of every other dim."""
    dim = dim % ndim if ndim else 0
    return tuple(d != dim for d in range(ndim))


def _shape_dims(qshape, sshape) -> tuple:
    """``scaled_dims`` read from the shapes, as the class docstring says."""
    shared = any(s == 1 and d != 1 for s, d in zip(sshape, qshape))
    return tuple(s != 1 or (d == 1 and shared) for s, d in zip(sshape, qshape))


def _check_layout(qdata, scale, orig_dtype, scaled_dims, op: str) -> tuple:
    """Types, dims and shapes of the parts (not the values); returns the ``scaled_dims`` to use."""
    if not isinstance(qdata, torch.Tensor) or qdata.dtype not in FLOAT8_DTYPES:
        raise TypeError(f"{op}: qdata must be float8_e4m3fn or float8_e5m2, got {getattr(qdata, 'dtype', type(qdata))}")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        raise TypeError(f"{op}: scale must be float32, got {getattr(scale, 'dtype', type(scale))}")
    if not isinstance(orig_dtype, torch.dtype) or not orig_dtype.is_floating_point or orig_dtype in FLOAT8_DTYPES:
        raise TypeError(f"{op}: orig_dtype must be a high-precision float dtype, got {orig_dtype}")
    if scale.ndim != qdata.ndim or any(s != 1 and s != d for s, d in zip(scale.shape, qdata.shape)):
        raise ValueError(f"{op}: scale of shape {tuple(scale.shape)} does not broadcast per-dim to qdata of shape "
                         f"{tuple(qdata.shape)} (each scale dim must be 1 or the data's size)")
    if scaled_dims is None:
        return _shape_dims(qdata.shape, scale.shape)
    dims = tuple(bool(b) for b in scaled_dims)
    if len(dims) != qdata.ndim or any((s != d) if b else (s != 1) for b, s, d in zip(dims, scale.shape, qdata.shape)):
        raise ValueError(f"{op}: scaled_dims {dims} does not match scale {tuple(scale.shape)} and qdata "
                         f"{tuple(qdata.shape)} (a scaled dim needs the data's size in the scale, a shared one size 1)")
    return dims


def validate_parts(qdata, scale, orig_dtype, scaled_dims=None, op: str = "ScaledFp8Tensor") -> tuple:
    """All checks of the public :class:`ScaledFp8Tensor` constructor (types, shapes, every scale finite and positive:
    a device sync on CUDA, skipped while tracing); returns the ``scaled_dims`` to use.

    Raises ``TypeError`` / ``ValueError`` naming ``op``, what was expected and what was given.
    """
    dims = _check_layout(qdata, scale, orig_dtype, scaled_dims, op)
    if (scale.numel() and type(scale) is torch.Tensor and not scale.is_meta and not compat.is_compiling()
            and not compat.dispatch_modes_active()):  # (values readable here: a plain tensor, not traced)
        bad = ~(torch.isfinite(scale) & (scale > 0))
        if bool(bad.any()):
            idx = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(f"{op}: scale must be finite and positive (it multiplies the fp8 data), got "
                             f"{float(scale[idx])} at index {idx} ({int(bad.sum())} bad of {scale.numel()})")
    return dims


def make_scaled(qdata: torch.Tensor, scale: torch.Tensor, orig_dtype: torch.dtype, fast_accum: bool = True,
                scaled_dims: Optional[Sequence[bool]] = None, *, requires_grad: bool = False,
                shares_scale: bool = False, scale_writes: Optional[_ScaleWrites] = None) -> "ScaledFp8Tensor":
    """A ScaledFp8Tensor from trusted parts (op results, collectives, unflatten): no checks; ``scaled_dims`` None reads
    it from the shapes. What ``ScaledFp8Tensor(..., _trusted=True)`` builds, without the class call's keyword
    passing (a Linear step makes several of these); traced, the class call itself (what the tracers know)."""
    if compat.is_compiling():
        return ScaledFp8Tensor(qdata, scale, orig_dtype, fast_accum, requires_grad, shares_scale=shares_scale,
                               scale_writes=scale_writes, scaled_dims=scaled_dims, _trusted=True)
    t = _make_wrapper(ScaledFp8Tensor, qdata.shape, strides=qdata.stride(), storage_offset=qdata.storage_offset(),
                      dtype=orig_dtype, device=qdata.device, layout=qdata.layout, requires_grad=requires_grad)
    _set_parts(t, qdata, scale, orig_dtype, fast_accum, shares_scale, scale_writes, scaled_dims)
    return t


_make_wrapper = torch.Tensor._make_wrapper_subclass


def _set_parts(t: "ScaledFp8Tensor", qdata, scale, orig_dtype, fast_accum, shares_scale, scale_writes,
               scaled_dims) -> None:
    """Set the fields of a new ScaledFp8Tensor ``t`` (``scaled_dims`` None: read from the shapes)."""
    t.scaled_dims = tuple(_shape_dims(qdata.shape, scale.shape) if scaled_dims is None else scaled_dims)
    t.qdata = qdata
    t.scale = scale
    t.orig_dtype = orig_dtype
    t.fast_accum = bool(fast_accum)
    t.shares_scale = bool(shares_scale)
    t._scale_writes = scale_writes


def _rebuild_scaled_fp8(qdata, scale, orig_dtype, fast_accum, requires_grad, is_param=False, float8_dtype=None,
                        shares_scale=False, scaled_dims=None):
    """Unpickling hook (a ``weights_only`` safe global); checks types and shapes, not the (maybe non-finite) scales."""
    if float8_dtype is not None and qdata.dtype != float8_dtype:
        qdata = qdata.view(float8_dtype)
    dims = _check_layout(qdata, scale, orig_dtype, scaled_dims, "ScaledFp8Tensor (unpickling)")
    t = make_scaled(qdata, scale, orig_dtype, fast_accum, dims, requires_grad=requires_grad, shares_scale=shares_scale)
    if is_param:
        compat.mark_parameter(t)  # what nn.Parameter(subclass) sets
    return t


@torch.no_grad()
def fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, *, out=None):
    """``fsdp_post_all_gather`` of ScaledFp8Tensor and ``Fp8MasterWeight`` (payload of :mod:`fp8tensor.fsdp`:
    ``all_gather_outputs`` ``(data,)`` or ``(data, scale)``, ``data`` ``(world * padded_rows, *rest)`` uint8).
    First call: ``(ScaledFp8Tensor (rows, *rest) of param_dtype, inner_tensors)``; later calls refill ``out`` (the
    tensor built the first time, or a DTensor of it) in place and return None.

    Raises ``RuntimeError``: ``out`` is not a ScaledFp8Tensor of the gathered shape.
    """
    if out is not None:
        target = local_of(out)
        if (metadata.mode == _payload.LOCAL and isinstance(target, ScaledFp8Tensor)
                and target.qdata.data_ptr() == all_gather_outputs[0].data_ptr()
                and tuple(target.qdata.shape) == metadata.packed[0]):
            return None  # 1-rank payload: data and scales already view the buffer FSDP2 refilled
        qdata, scale = _payload.gathered(all_gather_outputs, metadata)
        if not isinstance(target, ScaledFp8Tensor) or tuple(target.shape) != tuple(qdata.shape):
            raise RuntimeError(f"fp8tensor fsdp_post_all_gather: out= must be the ScaledFp8Tensor of shape "
                               f"{tuple(qdata.shape)} built on the first all-gather, got {type(target).__name__} of "
                               f"shape {tuple(target.shape)}")
        _payload.refill(target.qdata, target.scale, qdata, scale)
        return None
    qdata, scale, inner = _payload.unsharded_buffers(all_gather_outputs, metadata)
    # one scale per row (both pre-all-gather hooks gather per-row scales), declared so for one-row weights too
    dims = (True, *(s != 1 for s in scale.shape[1:]))
    return make_scaled(qdata, scale, param_dtype, metadata.fast_accum, dims), inner


def dequantize(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Dequantize a ScaledFp8Tensor (or a DTensor of one; placements kept) into ``dtype`` (default: its original
    high-precision dtype); other tensors pass through."""
    return map_local(t, lambda lt: lt.to_hp(dtype) if isinstance(lt, ScaledFp8Tensor)
                     else lt if dtype is None else lt.to(dtype))


# let torch.load(weights_only=True) rebuild ScaledFp8Tensor (also files that name the flat module path)
torch.serialization.add_safe_globals([ScaledFp8Tensor, _rebuild_scaled_fp8,
                                      (ScaledFp8Tensor, "fp8tensor.tensor.ScaledFp8Tensor"),
                                      (_rebuild_scaled_fp8, "fp8tensor.tensor._rebuild_scaled_fp8")])
