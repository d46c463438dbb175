"""The classes of converted modules (``Fp8C(Fp8LinearMixin, C)``, ``Fp8C(Fp8GroupedExpertsMixin, C)``: one per pair,
:func:`converted_class`), the parameter swap, the redirect of instance-level forwards and the state-dict hooks."""
from __future__ import annotations

import functools
import types
from typing import Optional

import torch
import torch.nn as nn

from . import checkpoint as _checkpoint
from ..core import compat
from .export import add_tp_export_hook
from ..distributed.fsdp_state import refresh_fsdp_param
from ..training.grouped import Fp8GroupedMMMode
from ..training.linear import fp8_linear
from ..training.master import Fp8MasterWeight
from ..numerics.quantize import E4M3, FLOAT8_DTYPES
from ..subclass.tensor import ScaledFp8Tensor, _is_dtensor, local_of, map_local, map_shard

__all__ = ["fp8_linear_forward", "Fp8LinearMixin", "Fp8Linear", "Fp8GroupedExpertsMixin", "converted_class",
           "fp8_class", "experts_class", "uses_grouped_mm", "own_forward", "instance_forward", "install_fp8_forward",
           "swap_local", "plain_state_dict_hook", "rewrap_after_load", "add_fp8_checkpoint_hooks",
           "quantize_expert_weight", "requantize_after_load", "add_retie_hooks", "retie_after_load",
           "add_load_check_hook"]


def fp8_linear_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """``forward`` of converted ``nn.Linear`` modules: :func:`fp8tensor.fp8_linear` with the module's recipe.

    ``input``: ``[..., in_features]`` (plain tensor or DTensor); returns ``[..., out_features]``."""
    params = compat.parameters_dict(self)
    if "weight" in params and "bias" in params and _plain_parameters(type(self)):  # (µs less than self.weight)
        return fp8_linear(input, params["weight"], params["bias"], recipe=self.fp8_recipe)
    return fp8_linear(input, self.weight, self.bias, recipe=self.fp8_recipe)


def _plain_parameters(cls: type) -> bool:
    """Whether ``self.weight`` / ``self.bias`` of a ``cls`` instance are its ``_parameters`` entries when it has them:
    neither is an attribute of the class (a property, say: ``torch.nn.utils.parametrize`` makes one and removes the
    ``_parameters`` entry). Memoized per class in eager only: under ``torch.compile`` the memo is neither read nor
    written (dynamo guarded the compiled forward on the memo's contents and replayed its filling as a side effect,
    so a model compiled before its first eager call compiled twice, the first graph unlike the later ones)."""
    if compat.is_compiling():
        return not (hasattr(cls, "weight") or hasattr(cls, "bias"))
    plain = _PLAIN_PARAMETERS.get(cls)
    if plain is None:
        plain = _PLAIN_PARAMETERS[cls] = not (hasattr(cls, "weight") or hasattr(cls, "bias"))
    return plain


#: class -> :func:`_plain_parameters` (a fact about the class, which converted modules keep).
_PLAIN_PARAMETERS: dict = {}


class Fp8LinearMixin:
    """Marks a converted Linear and gives it :func:`fp8_linear_forward` as ``forward``.

    ``convert_to_fp8`` / ``quantize_weights`` change a selected module's class ``C`` to ``Fp8C(Fp8LinearMixin, C)``,
    one per class: ``isinstance(m, C)`` holds and ``torch.compile`` shares one graph between layers (a per-instance
    ``forward`` recompiles per Linear). Pickles name the original class.
    """

    forward = fp8_linear_forward
    _fp8_base: type = nn.Linear

    def __reduce_ex__(self, protocol):
        return (_new_converted, (type(self)._fp8_base,), self.__getstate__())

    def register_parameter(self, name: str, param) -> None:
        """``nn.Module.register_parameter``; a DTensor ``weight`` (``parallelize_module`` after the conversion) gets
        the ``torch.export`` check first among the forward pre-hooks (:func:`fp8tensor.export.add_tp_export_hook`)."""
        super().register_parameter(name, param)
        if name == "weight":
            add_tp_export_hook(self)


class Fp8Linear(Fp8LinearMixin, nn.Linear):
    """A converted ``nn.Linear`` (the class :func:`convert_to_fp8` gives plain ``nn.Linear`` modules)."""


#: (mixin, original class) -> converted class, one per pair: the one class-swap skeleton of Linears and experts.
_CONVERTED: dict = {(Fp8LinearMixin, nn.Linear): Fp8Linear}


def converted_class(mixin: type, cls: type) -> type:
    """The converted counterpart ``Fp8C(mixin, C)`` of module class ``cls`` (created once per class and mixin)."""
    if issubclass(cls, mixin):
        return cls
    new = _CONVERTED.get((mixin, cls))
    if new is None:
        new = type(f"Fp8{cls.__name__}", (mixin, cls), {"__module__": cls.__module__, "_fp8_base": cls})
        _CONVERTED[(mixin, cls)] = new
    return new


def fp8_class(cls: type) -> type:
    """The converted counterpart of Linear class ``cls``."""
    return converted_class(Fp8LinearMixin, cls)


def _new_converted(base: type, mixin: type = None):
    """Unpickling helper: an empty instance of the converted class of ``base`` (state is set by pickle)."""
    return object.__new__(converted_class(mixin or Fp8LinearMixin, base))


def own_forward(lin: nn.Module) -> Optional[str]:
    """Why ``lin`` cannot be converted without changing what it computes (a class forward of its own, a
    parametrized weight) or at all (a lazy weight not yet materialized, a weight that is not a high-precision float:
    an integer or a plain float8 tensor, which has no scales to read it by), or None."""
    from torch.nn.utils import parametrize

    if parametrize.is_parametrized(lin, "weight"):
        return "weight is parametrized"
    w = getattr(lin, "weight", None)
    if isinstance(w, nn.parameter.UninitializedParameter):  # (its class changes to nn.Linear at the first forward)
        return "weight is uninitialized (a lazy module): convert it after its first forward"
    # (a ScaledFp8Tensor or a master reads as its high-precision dtype)
    if isinstance(w, torch.Tensor) and (not w.dtype.is_floating_point or w.dtype in FLOAT8_DTYPES):
        return f"a {w.dtype} weight, not a high-precision floating-point one"
    if type(lin).forward is not nn.Linear.forward and not isinstance(lin, Fp8LinearMixin):
        return f"{type(lin).__name__}.forward overrides nn.Linear.forward"
    return None


_MAX_DEPTH = 8
_LINEAR_FORWARDS = (nn.Linear.forward, fp8_linear_forward)


class _Redirect:
    """Where a ``forward`` set on ``lin``'s instance (torchtitan's ``Module.parallelize`` closure) holds ``lin``'s bound
    forward (through cells, defaults, partials, containers, bound methods, wrapper attributes; depth 8), and the edits
    that point it at the fp8 forward (done by :meth:`apply`); what cannot be edited (a named tuple) is ``blocked``."""

    def __init__(self, lin: nn.Module):
        self.lin = lin
        self.found: list = []
        self.blocked: list = []
        self._edits: list = []
        self._memo: dict = {}

    def apply(self) -> None:
        """Point every found reference at ``lin``'s fp8 forward (call after ``lin``'s class was converted)."""
        for edit in self._edits:
            edit()

    def _scan(self, obj, path: str, depth: int):
        """The object that should replace ``obj`` (``obj`` itself when nothing needs replacing)."""
        if isinstance(obj, types.MethodType) and obj.__self__ is self.lin and obj.__func__ in _LINEAR_FORWARDS:
            self.found.append(path)
            return types.MethodType(fp8_linear_forward, self.lin)
        if depth > _MAX_DEPTH or isinstance(obj, (nn.Module, torch.Tensor, type)):
            return obj
        if id(obj) in self._memo:
            return self._memo[id(obj)][1]
        self._memo[id(obj)] = (obj, obj)  # a cycle back to an object being scanned keeps it
        new = self._scan_children(obj, path, depth + 1)
        self._memo[id(obj)] = (obj, new)  # holds obj: its id is not reused during the scan
        return new

    def _scan_children(self, obj, path: str, depth: int):
        def sub(child, where):
            return self._scan(child, path + where, depth)

        def edit_items(container, items):
            for key, value in items:
                new = sub(value, f"[{key!r}]")
                if new is not value:
                    self._edits.append(functools.partial(container.__setitem__, key, new))

        if isinstance(obj, functools.partial):
            func = sub(obj.func, ".func")
            args = tuple(sub(a, f".args[{i}]") for i, a in enumerate(obj.args))
            kw = {k: sub(v, f".keywords[{k!r}]") for k, v in obj.keywords.items()}
            if func is obj.func and _same(args, obj.args) and _same(kw.values(), obj.keywords.values()):
                return obj
            if type(obj) is not functools.partial:
                return self._block(obj, path)
            return functools.partial(func, *args, **kw)
        if isinstance(obj, tuple):
            items = tuple(sub(v, f"[{i}]") for i, v in enumerate(obj))
            if _same(items, obj):
                return obj
            return tuple(items) if type(obj) is tuple else self._block(obj, path)
        if isinstance(obj, list):
            edit_items(obj, list(enumerate(obj)))
        elif isinstance(obj, dict):
            edit_items(obj, list(obj.items()))
        elif isinstance(obj, types.MethodType):  # a bound method of another object
            sub(obj.__func__, ".__func__")
            sub(obj.__self__, ".__self__")
        elif isinstance(obj, types.FunctionType):
            for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                new = sub(value, f"<closure {name}>")
                if new is not value:
                    self._edits.append(functools.partial(setattr, cell, "cell_contents", new))
            if obj.__defaults__:
                defaults = tuple(sub(d, f"<default {i}>") for i, d in enumerate(obj.__defaults__))
                if not _same(defaults, obj.__defaults__):
                    self._edits.append(functools.partial(setattr, obj, "__defaults__", defaults))
            if obj.__kwdefaults__:
                edit_items(obj.__kwdefaults__, list(obj.__kwdefaults__.items()))
        elif callable(obj) and isinstance(getattr(obj, "__dict__", None), dict):  # a callable wrapper object
            for key, value in list(vars(obj).items()):
                new = sub(value, f".{key}")
                if new is not value:
                    self._edits.append(functools.partial(setattr, obj, key, new))
        return obj

    def _block(self, obj, path: str):
        self.blocked.append(f"{path} ({type(obj).__name__})")
        return obj


def _same(a, b) -> bool:
    return all(x is y for x, y in zip(a, b))


def instance_forward(lin: nn.Module) -> Optional[_Redirect]:
    """The redirect plan of a forward set on ``lin``'s instance; None when there is none."""
    f = lin.__dict__.get("forward")
    if f is None:
        return None
    plan = _Redirect(lin)
    new = plan._scan(f, "forward", 0)
    if new is not f:
        plan._edits.append(functools.partial(lin.__dict__.__setitem__, "forward", new))
    return plan


def install_fp8_forward(lin: nn.Linear, cls: type, redirect: Optional[_Redirect]) -> None:
    lin.__class__ = cls
    if redirect is not None:
        redirect.apply()


def swap_local(param: torch.Tensor, fn) -> Optional[nn.Parameter]:
    """Swap the (local) tensor of ``param`` for ``fn(local)``: DTensor parameters in place (FSDP2's bookkeeping
    refreshed; None returned), plain ones as a new Parameter returned to set on the module."""
    if _is_dtensor(param):
        compat.set_local_tensor(param, map_shard(compat.local_tensor(param), fn))
        refresh_fsdp_param(param)
        return None
    return nn.Parameter(fn(param.data), requires_grad=param.requires_grad)


# ---------------------------------------------------------------------------------------------- state-dict hooks
def plain_state_dict_hook(module, state_dict, prefix, local_metadata):
    """State dict of a converted module holds plain high-precision weights (loadable without fp8tensor): every
    parameter of ``module`` that is a master weight (or a DTensor of one) is stored as its high-precision data."""
    for name in compat.parameters_dict(module):
        t = state_dict.get(prefix + name)  # (None for a parameter the state dict leaves out)
        if isinstance(local_of(t), Fp8MasterWeight):
            state_dict[prefix + name] = map_local(t, lambda lt: lt._data)


def rewrap_after_load(module, incompatible_keys):
    """After ``load_state_dict(assign=True)`` replaced a converted weight (a Linear's ``weight``, a grouped-experts
    module's ``fp8_expert_params``) with a plain tensor, make it a master weight again. An fp8 weight assigned into a
    training module (a ``quantize_weights`` checkpoint's ``ScaledFp8Tensor``; the module not stored in fp8 itself) is
    dequantized into its high-precision dtype first: the module trains it, as it does the values such a checkpoint
    loads without ``assign``."""
    stored_fp8 = hasattr(module, "_fp8_float8_dtype")  # (quantize_weights made this module's weights fp8)
    for name in getattr(module, "fp8_expert_params", None) or ("weight",):
        w = getattr(module, name)
        lw = local_of(w)
        if isinstance(lw, ScaledFp8Tensor) and not stored_fp8:
            hp = swap_local(w, lambda lt: lt.to_hp())  # (a DTensor's shard in place)
            if hp is not None:
                setattr(module, name, hp)
                w = hp
            lw = local_of(w)
        if isinstance(lw, (Fp8MasterWeight, ScaledFp8Tensor)) or not getattr(module, "fp8_all_gather", True):
            continue
        new = swap_local(w, lambda lt: Fp8MasterWeight(lt, module.fp8_recipe))
        if new is not None:
            setattr(module, name, new)


def add_fp8_checkpoint_hooks(mod: nn.Module, float8_dtype: torch.dtype = E4M3) -> None:
    """Once per module: the state-dict hooks of :mod:`fp8tensor.checkpoint` and :func:`requantize_after_load` (in
    ``float8_dtype``)."""
    if not getattr(mod, "_fp8_checkpoint_hooks", False):
        compat.register_state_dict_hook(mod, _checkpoint.state_dict_hook)
        mod.register_load_state_dict_pre_hook(_checkpoint.load_state_dict_pre_hook)
        mod.register_load_state_dict_post_hook(requantize_after_load)
        mod._fp8_checkpoint_hooks = True
    mod._fp8_float8_dtype = float8_dtype


def requantize_after_load(module, incompatible_keys):
    """After ``load_state_dict(assign=True)`` put a high-precision tensor where :func:`quantize_weights` stored fp8,
    store it in fp8 again (row-wise)."""
    dt = getattr(module, "_fp8_float8_dtype", E4M3)
    for name in getattr(module, "fp8_expert_params", None) or ("weight",):
        w = compat.parameters_dict(module).get(name)
        if (w is None or _is_dtensor(w) or isinstance(w, ScaledFp8Tensor) or not w.dtype.is_floating_point
                or w.dtype in FLOAT8_DTYPES):
            continue
        q = quantize_expert_weight(w.detach(), dt) if w.dim() == 3 else ScaledFp8Tensor.from_hp(w.detach(), dt)
        setattr(module, name, nn.Parameter(q, requires_grad=False))
        # (where it was loaded from, for retie_after_load: weights loaded from one tensor share one fp8 Parameter;
        # none for tensors without memory of their own: meta, fake)
        if w.device.type != "meta" and not compat.is_fake(w) and w.data_ptr() != 0:
            module.__dict__.setdefault(_LOADED_FROM, {})[name] = (w.data_ptr(), tuple(w.shape), tuple(w.stride()),
                                                                  w.dtype, w.device)


#: Attribute of a module whose fp8 weights :func:`requantize_after_load` made in the current ``load_state_dict``
#: call: ``{name: (data pointer, shape, stride, dtype, device) of the high-precision tensor it was loaded from}``.
_LOADED_FROM = "_fp8_loaded_from"


def add_load_check_hook(root: nn.Module) -> None:
    """Once per model: :func:`fp8tensor.checkpoint.check_before_load` as a ``load_state_dict`` pre-hook of ``root``
    (the module ``convert_to_fp8`` / ``quantize_weights`` was given): the fp8 modules' entries are checked before any
    module loads."""
    if not getattr(root, "_fp8_load_check", False):
        root.register_load_state_dict_pre_hook(_checkpoint.check_before_load)
        root._fp8_load_check = True


def add_retie_hooks(root: nn.Module) -> None:
    """Once per model: the ``load_state_dict`` hooks of :func:`retie_after_load` on ``root`` (the module
    :func:`fp8tensor.quantize_weights` converted)."""
    if not getattr(root, "_fp8_retie_hooks", False):
        root.register_load_state_dict_pre_hook(_forget_loaded_from)
        root.register_load_state_dict_post_hook(retie_after_load)
        root._fp8_retie_hooks = True


def _forget_loaded_from(module, *args) -> None:
    """Pre-hook of the model's ``load_state_dict``: records of an earlier load (of a submodule, which runs no
    :func:`retie_after_load`) are dropped before this one starts."""
    for mod in module.modules():
        mod.__dict__.pop(_LOADED_FROM, None)


def retie_after_load(module, incompatible_keys) -> None:
    """Post-hook of the model's ``load_state_dict``: after ``assign=True`` loaded high-precision weights that
    :func:`requantize_after_load` stored in fp8 one module at a time, weights loaded from one tensor (the same memory
    under several keys, as a tied weight's state dict holds) share one fp8 Parameter again, as their
    high-precision tensors shared memory: a later write to one is seen by every module holding it."""
    first: dict = {}
    for mod in module.modules():
        loaded = mod.__dict__.pop(_LOADED_FROM, None)
        for name, key in (loaded or {}).items():
            p = compat.parameters_dict(mod).get(name)
            if type(p) is not ScaledFp8Tensor:
                continue
            kept = first.setdefault(key, p)
            if kept is not p and torch.equal(kept.qdata.view(torch.uint8), p.qdata.view(torch.uint8)) and (
                    torch.equal(kept.scale, p.scale)):
                setattr(mod, name, kept)


def quantize_expert_weight(lt: torch.Tensor, float8_dtype: torch.dtype) -> ScaledFp8Tensor:
    hp = lt._data if isinstance(lt, Fp8MasterWeight) else lt
    return ScaledFp8Tensor.from_hp(hp.detach(), float8_dtype)


# ---------------------------------------------------------------------------------------------- grouped experts
@functools.lru_cache(maxsize=None)
def _dispatches_experts(fn) -> bool:
    """Whether ``fn`` (a class's ``forward``) is Hugging Face transformers' experts dispatcher
    (``@use_experts_implementation``): it wraps the class's own forward and picks the implementation from
    ``self.config._experts_implementation`` (``"grouped_mm"``, transformers' default where torch has
    ``torch._grouped_mm``, calls ``F.grouped_mm``)."""
    code = getattr(fn, "__code__", None)
    return (getattr(fn, "__wrapped__", None) is not None and code is not None
            and "_experts_implementation" in code.co_names)


def uses_grouped_mm(cls: type) -> bool:
    """Whether module class ``cls`` (or a base below ``nn.Module``) names ``grouped_mm`` in its source (a
    grouped-experts module, e.g. torchtitan's ``GroupedExperts``) or has transformers' experts dispatcher as its
    ``forward`` (:func:`_dispatches_experts`, e.g. Qwen3-MoE's and Mixtral's experts); False when neither can be
    read."""
    import inspect

    for c in cls.__mro__:
        if c in (nn.Module, object) or issubclass(nn.Module, c):
            continue
        if _dispatches_experts(c.__dict__.get("forward")):
            return True
        try:
            if "grouped_mm" in inspect.getsource(c):
                return True
        except (OSError, TypeError):
            continue
    return False


#: Hugging Face experts implementations (``config._experts_implementation``) whose GEMMs run in fp8 under
#: :class:`Fp8GroupedMMMode`: ``grouped_mm`` (``F.grouped_mm``) and ``eager`` (per-expert ``F.linear``). Others
#: (``batched_mm``: ``torch.bmm`` over indexed weights; CUDA-only kernels) would run in high precision.
FP8_EXPERTS_IMPLEMENTATIONS = (None, "grouped_mm", "eager")


def _grouped_experts_forward(self, *args, **kwargs):
    """``forward`` of converted grouped-experts modules: the module's own under :class:`Fp8GroupedMMMode`. A Hugging
    Face experts module set to an implementation outside :data:`FP8_EXPERTS_IMPLEMENTATIONS` warns (eager calls):
    its GEMMs run in high precision."""
    impl = compat.experts_implementation(getattr(self, "config", None))
    if impl not in FP8_EXPERTS_IMPLEMENTATIONS and not compat.is_compiling():
        import warnings

        warnings.warn(f"fp8tensor: {type(self).__name__} runs its experts with _experts_implementation={impl!r}, "
                      "whose GEMMs fp8tensor does not see: they run in high precision (set "
                      "config._experts_implementation to 'grouped_mm' or 'eager' for fp8 experts)", UserWarning,
                      stacklevel=2)
    # (eager: w1 and w3 quantize the tokens they share once, within this call)
    mode = Fp8GroupedMMMode(self.fp8_recipe, share_inputs=not compat.is_compiling())
    try:
        with mode:
            return type(self)._fp8_base.forward(self, *args, **kwargs)
    finally:
        mode.forget_inputs()


class Fp8GroupedExpertsMixin:
    """Marks a converted grouped-experts module ``C`` (class ``Fp8C(Fp8GroupedExpertsMixin, C)``): ``C.forward`` under
    :class:`~fp8tensor.grouped.Fp8GroupedMMMode`; ``fp8_expert_params`` names its converted 3-D parameters."""

    forward = _grouped_experts_forward
    _fp8_base: type = nn.Module

    def __reduce_ex__(self, protocol):
        return (_new_converted, (type(self)._fp8_base, Fp8GroupedExpertsMixin), self.__getstate__())


def experts_class(cls: type) -> type:
    """The converted counterpart of grouped-experts class ``cls``."""
    return converted_class(Fp8GroupedExpertsMixin, cls)
