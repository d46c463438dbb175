"""Module conversion: ``convert_to_fp8`` (training, master weights) and ``quantize_weights`` (fp8 storage).

Both work on plain modules and on modules already passed through ``parallelize_module`` (DTensor weights) or
``fully_shard`` (FSDP2): a DTensor weight keeps its Parameter object and placements, only its local tensor is
swapped, so optimizers and FSDP2 keep their references. A ``forward`` that a framework set on a Linear instance
(torchtitan's TP wraps the bound ``forward`` it captured) is pointed at the fp8 forward (:class:`_Redirect`).
"""
from __future__ import annotations

import dataclasses
import functools
import types
import warnings
from typing import Callable, Optional

import torch
import torch.nn as nn

from . import compat
from . import checkpoint as _checkpoint
from .quantize import E4M3, check_float8_dtype
from .fsdp_state import check_fsdp_sharded as _check_fsdp_sharded
from .fsdp_state import refresh_fsdp_param
from .grouped import Fp8GroupedMMMode
from .linear import fp8_linear, tp_export_message
from .master import Fp8MasterWeight
from .recipes import Recipe, get_recipe
from .settings import get_config
from .tensor import ScaledFp8Tensor, _is_dtensor, map_shard

__all__ = ["convert_to_fp8", "quantize_weights", "fp8_linear_forward", "Fp8Linear", "Fp8LinearMixin",
           "Fp8GroupedExpertsMixin", "uses_grouped_mm", "fp8_size_rule", "fp8_size_choice"]

FilterFn = Callable[[nn.Module, str], bool]

def fp8_size_rule(in_features: int, out_features: int) -> bool:
    """Whether a Linear of this size is expected to train faster in fp8 than in high precision (row-wise recipes).

    Per token, the fp8 GEMMs save time in proportion to ``K * N`` (their FLOPs) while the quantizations that feed them
    cost time in proportion to ``K + N`` (the bytes of ``x``, ``grad_out`` and the weight's rows they read and write);
    both grow linearly with the number of tokens, so their ratio depends on the shape only. The rule converts a Linear
    when ``K * N / (K + N) >= size_rule_min`` (a field of :class:`fp8tensor.Config`, default 640): ``2048 x 2048``
    (1024), ``2048 <-> 5632`` (1502), ``1024 <-> 4096`` (819) and anything larger are converted; ``1024 x 1024``
    (512), ``768 -> 3072`` (614) and small heads (``4096 -> 16``: 16) stay in high precision.

    The default threshold is measured on H200 (``benchmarks/size_rule.py``: one Linear's forward + backward captured
    as a CUDA graph, and the end-to-end step in ``docs/benchmarks.md``): below 640 even ``rowwise_gw_hp`` (two fp8
    GEMMs) is slower than bf16 at 8192 and 16384 tokens. It is looser than torchao's size-based filter for its
    row-wise recipe (H100, its kernels: ``N <= 2048`` stays in high precision). For another GPU, calibrate it with
    that script and set it with ``fp8tensor.set_config(size_rule_min=...)``. :func:`fp8_size_choice` adds the
    middle tier (``rowwise_gw_hp``) on top of this rule.

    Args:
        in_features: ``K``, the Linear's input features.
        out_features: ``N``, its output features.

    Returns:
        True to convert, False to keep the Linear in high precision.
    """
    K, N = int(in_features), int(out_features)
    if K <= 0 or N <= 0:
        return False
    return K * N >= get_config().size_rule_min * (K + N)


def fp8_size_choice(in_features: int, out_features: int, recipe="rowwise") -> Optional[Recipe]:
    """The size-aware choice for one Linear: the recipe it is converted with, or None to keep it in high precision.

    * ``K * N / (K + N) < size_rule_min`` (:func:`fp8_size_rule` False): None;
    * a recipe with an fp8 grad_weight (``rowwise``) and ``K * N / (K + N) < size_rule_fp8_grad_weight_min`` (both
      :class:`fp8tensor.Config` fields; default 640 and 1024): ``rowwise_gw_hp`` — the output and grad_input GEMMs
      in fp8, grad_weight in high precision (a custom :class:`~fp8tensor.recipes.Recipe` keeps its other fields:
      fp8 format, fast accumulation). Measured on H200 (``benchmarks/size_rule.py``, ``docs/benchmarks.md``): at these sizes the per-token
      quantizations of ``x`` and ``grad_out`` that an fp8 grad_weight GEMM needs cost more than that GEMM saves,
      while the other two GEMMs still pay for theirs. Numerically this is the more accurate recipe;
    * else ``recipe`` itself.

    Args:
        in_features: ``K``; out_features: ``N``.
        recipe: the requested recipe (name or :class:`~fp8tensor.recipes.Recipe`).

    Returns:
        A :class:`~fp8tensor.recipes.Recipe` or None.

    Raises:
        ValueError: unknown recipe.
    """
    r = get_recipe(recipe)
    if not fp8_size_rule(in_features, out_features):
        return None
    K, N = int(in_features), int(out_features)
    if r.grad_weight_fp8 and K * N < get_config().size_rule_fp8_grad_weight_min * (K + N):
        hp = get_recipe("rowwise_gw_hp")
        # the requested recipe with its grad_weight GEMM in high precision (its other fields kept)
        mid = dataclasses.replace(r, name=hp.name, grad_weight_fp8=False)
        return hp if mid == hp else mid
    return r


def fp8_linear_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """``forward`` of converted ``nn.Linear`` modules: :func:`fp8tensor.fp8_linear` with the module's recipe.

    ``input``: ``[..., in_features]`` (plain tensor or DTensor); returns ``[..., out_features]``."""
    return fp8_linear(input, self.weight, self.bias, recipe=self.fp8_recipe)


class Fp8LinearMixin:
    """Marks a converted Linear and gives it :func:`fp8_linear_forward` as ``forward``.

    ``convert_to_fp8`` / ``quantize_weights`` change a selected module's class ``C`` (``nn.Linear``, a subclass of
    it that keeps ``nn.Linear.forward``, or FSDP2's ``FSDPLinear``) to a subclass ``Fp8C(Fp8LinearMixin, C)``, one
    per original class. Changing the class rather than setting ``forward`` on each instance keeps
    ``isinstance(m, C)`` and lets ``torch.compile`` share one graph between layers (a per-instance ``forward`` is
    guarded by object identity, which recompiles once per Linear and soon hits dynamo's recompile limit).
    Pickles name the original class, so a converted model loads in a process that never converted anything.
    """

    forward = fp8_linear_forward
    _fp8_base: type = nn.Linear

    def __reduce_ex__(self, protocol):
        return (_new_converted, (type(self)._fp8_base,), self.__getstate__())

    def register_parameter(self, name: str, param) -> None:
        """``nn.Module.register_parameter`` (also what ``setattr`` of a Parameter calls); a DTensor ``weight`` (a
        ``parallelize_module`` after the conversion) gets the ``torch.export`` check first among the forward
        pre-hooks, before those the parallel style registers next (:func:`_add_tp_export_hook`)."""
        super().register_parameter(name, param)
        if name == "weight":
            _add_tp_export_hook(self)


class Fp8Linear(Fp8LinearMixin, nn.Linear):
    """A converted ``nn.Linear`` (the class :func:`convert_to_fp8` gives plain ``nn.Linear`` modules)."""


_FP8_CLASSES: dict = {nn.Linear: Fp8Linear}


def _fp8_class(cls: type) -> type:
    """The converted counterpart of module class ``cls`` (created once per class)."""
    if issubclass(cls, Fp8LinearMixin):
        return cls
    new = _FP8_CLASSES.get(cls)
    if new is None:
        new = type(f"Fp8{cls.__name__}", (Fp8LinearMixin, cls), {"__module__": cls.__module__, "_fp8_base": cls})
        _FP8_CLASSES[cls] = new
    return new


def _new_converted(base: type):
    """Unpickling helper: an empty instance of the converted class of ``base`` (state is set by pickle)."""
    return object.__new__(_fp8_class(base))


def _own_forward(lin: nn.Module) -> Optional[str]:
    """Why ``lin`` cannot be converted without changing what it computes: a class forward of its own that
    conversion would drop, or a parametrized weight (e.g. weight norm) that has no single tensor to swap. None when
    it can. (A forward set on the instance is judged by :func:`_instance_forward`.)"""
    from torch.nn.utils import parametrize

    if parametrize.is_parametrized(lin, "weight"):
        return "weight is parametrized"
    if type(lin).forward is not nn.Linear.forward and not isinstance(lin, Fp8LinearMixin):
        return f"{type(lin).__name__}.forward overrides nn.Linear.forward"
    return None


_MAX_DEPTH = 8
_LINEAR_FORWARDS = (nn.Linear.forward, fp8_linear_forward)


class _Redirect:
    """Where a ``forward`` set on Linear ``lin``'s instance holds ``lin``'s own bound forward (``nn.Linear.forward``
    or the fp8 forward, bound to ``lin``), and the edits that point each of those references at the fp8 forward.

    Frameworks wrap a module's forward on the instance: torchtitan's ``Module.parallelize`` sets
    ``lin.forward = forward_with_redistribution``, a closure that redistributes the inputs and calls the bound
    ``lin.forward`` it captured (through ``local_map``'s ``functools.partial`` when one applies). Such a wrapper
    ends in the Linear's own computation; the user's own forward (e.g. ``F.linear(x, lin.weight) * 2``) does not
    hold the bound method and is not touched. The scan follows closure cells, default arguments, partials, lists,
    tuples, dicts, bound methods of other objects and attributes of callable wrapper objects (not modules or
    tensors), up to depth 8. Cells, defaults, lists, dicts and attributes are edited in place; partials and plain
    tuples are rebuilt and replaced in their parent; a reference held where neither works (e.g. a named tuple) is
    ``blocked``. Nothing is edited before :meth:`apply`.
    """

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

    def scan_instance_forward(self) -> None:
        f = self.lin.__dict__["forward"]
        new = self._scan(f, "forward", 0)
        if new is not f:
            self._edits.append(functools.partial(self.lin.__dict__.__setitem__, "forward", new))

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


def _instance_forward(lin: nn.Module) -> Optional[_Redirect]:
    """The redirect plan of a forward set on ``lin``'s instance; None when there is none."""
    if lin.__dict__.get("forward") is None:
        return None
    plan = _Redirect(lin)
    plan.scan_instance_forward()
    return plan


def _install_fp8_forward(lin: nn.Linear, cls: type, redirect: Optional[_Redirect]) -> None:
    lin.__class__ = cls
    if redirect is not None:
        redirect.apply()


def _select_linears(module: nn.Module, module_filter_fn: Optional[FilterFn], op: str):
    if not isinstance(module, nn.Module):
        raise TypeError(f"{op}: expected an nn.Module, got {type(module).__name__}")
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(f"{op}: module_filter_fn must be callable (module, fqn) -> bool")
    chosen = []
    for fqn, mod in module.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        if module_filter_fn is not None:
            try:
                keep = module_filter_fn(mod, fqn)
            except Exception as e:  # the model is still untouched here
                raise RuntimeError(f"{op}: module_filter_fn raised for module {fqn!r}; the model was not changed") from e
            if not keep:
                continue
        chosen.append((fqn, mod))
    return chosen


def _drop_custom_forwards(chosen, op: str):
    """Split off Linears whose own ``forward`` conversion would silently replace (e.g. a LoRA Linear adding a
    low-rank path, or a forward set on the instance that never calls the Linear's forward): they stay in high
    precision and are reported. Returns ``(keep, skipped, redirects)``; ``redirects[fqn]`` points a framework's
    instance-level wrapper at the fp8 forward once the module is converted.

    Raises:
        RuntimeError: an instance-level forward holds the Linear's bound forward where it cannot be redirected
            (nothing has been changed yet).
    """
    keep, skipped, redirects, blocked = [], [], {}, []
    for fqn, lin in chosen:
        name = fqn or "<root>"
        why = _own_forward(lin)
        if why is not None:
            skipped.append(f"{name} ({why})")
            continue
        plan = _instance_forward(lin)
        if plan is not None and plan.blocked:
            blocked.append(f"{name!r} ({', '.join(plan.blocked)})")
            continue
        if plan is not None and not plan.found:
            skipped.append(f"{name} (a forward set on the instance)")
            continue
        keep.append((fqn, lin))
        redirects[fqn] = plan
    if blocked:
        raise RuntimeError(
            f"{op}: the forward set on Linear {', '.join(blocked)} calls the Linear's own forward through an object "
            "fp8tensor cannot edit, so converting would leave that Linear in high precision. Convert before "
            "parallelizing (convert_to_fp8 before parallelize_module / torchtitan's Module.parallelize, or "
            "fp8tensor.torchtitan's converter), or keep the bound forward in a closure, partial, list or attribute. "
            "The model was not changed."
        )
    return keep, skipped, redirects


def _swap_local(param: torch.Tensor, fn) -> Optional[nn.Parameter]:
    """Swap the (local) tensor of ``param`` for ``fn(local)``.

    DTensor parameters are updated in place (same Parameter object, same placements; FSDP2's bookkeeping is
    refreshed); plain parameters return a new Parameter to set on the module.
    """
    if _is_dtensor(param):
        compat.set_local_tensor(param, map_shard(compat.local_tensor(param), fn))
        refresh_fsdp_param(param)
        return None
    return nn.Parameter(fn(param.data), requires_grad=param.requires_grad)


def _check_ties(root: nn.Module, chosen, op: str) -> None:
    """Raise before anything changes if a weight that conversion makes a master is also held by an ``nn.Linear``
    that is not converted (left out by the filter, or by its own ``forward``): a weight is either quantized on every
    GEMM use (a master's ``F.linear`` runs the fp8 Linear) or on none, so the two Linears cannot be split.

    Raises:
        RuntimeError: naming both Linears; the model is left unchanged.
    """
    converted = {id(lin) for _, lin in chosen}
    owners = {id(lin.weight): fqn for fqn, lin in chosen if not _is_dtensor(lin.weight)}
    bad = []
    for fqn, mod in root.named_modules():
        if isinstance(mod, nn.Linear) and id(mod) not in converted and id(mod.weight) in owners:
            bad.append(f"{fqn!r} (shares its weight with {owners[id(mod.weight)]!r})")
    if bad:
        raise RuntimeError(
            f"{op}: Linear {', '.join(bad)} is not selected for conversion but its weight is tied to a Linear that "
            "is: a tied weight is quantized on every GEMM use or on none. Select both Linears or neither "
            "(module_filter_fn). The model was not changed."
        )


def _adopt_parameter(root: nn.Module, old: nn.Parameter, new: nn.Parameter) -> None:
    """Make every holder of the plain Parameter ``old`` hold the master ``new``, so weights tied across modules (an
    embedding and the output head, two Linears) stay one Parameter: one gradient, one optimizer state.

    ``torch.utils.swap_tensors(old, new)`` turns the object ``old`` itself into the master, so every reference sees
    it: modules inside and outside ``root``, an optimizer built before conversion. Where torch refuses the swap (a
    weak reference to ``old``, e.g. from ``torch.compile``'s guards, or another C++ reference), ``new`` is set in every
    module of ``root`` that holds ``old``. A module other than a Linear holding the master (a tied embedding) gets the
    plain state-dict hook."""
    for k, v in old.__dict__.items():  # attributes users and frameworks set on the Parameter (no_weight_decay, ...)
        new.__dict__.setdefault(k, v)
    try:
        torch.utils.swap_tensors(old, new)
        holder = old
    except RuntimeError:
        holder = new
        for mod in root.modules():
            for name, p in list(mod._parameters.items()):
                if p is old:
                    mod._parameters[name] = new
    for mod in root.modules():
        if isinstance(mod, nn.Linear) or getattr(mod, "_fp8_state_dict_hook", False):
            continue
        if any(p is holder for p in mod._parameters.values()):
            compat.register_state_dict_hook(mod, _plain_state_dict_hook)
            mod._fp8_state_dict_hook = True


def _plain_state_dict_hook(module, state_dict, prefix, local_metadata):
    """State dict of a converted module holds plain high-precision weights (loadable without fp8tensor): every
    parameter of ``module`` that is a master weight (or a DTensor of one) is stored as its high-precision data."""
    for name, p in module._parameters.items():
        key = prefix + name
        t = state_dict.get(key)
        if t is None:
            continue
        if _is_dtensor(t):
            local = compat.local_tensor(t)
            if isinstance(local, Fp8MasterWeight):
                from torch.distributed.tensor import DTensor

                state_dict[key] = DTensor.from_local(
                    local._data, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
                )
        elif isinstance(t, Fp8MasterWeight):
            state_dict[key] = t._data


def _rewrap_after_load(module, incompatible_keys):
    """After ``load_state_dict(assign=True)`` replaced the weight with a plain tensor, wrap it again."""
    w = module.weight
    local = compat.local_tensor(w) if _is_dtensor(w) else w
    if isinstance(local, (Fp8MasterWeight, ScaledFp8Tensor)):
        return
    new = _swap_local(w, lambda lt: Fp8MasterWeight(lt, module.fp8_recipe))
    if new is not None:
        module.weight = new


# ---------------------------------------------------------------------------------------------- grouped experts
_GROUPED_SOURCE: dict = {}


def uses_grouped_mm(cls: type) -> bool:
    """Whether module class ``cls`` (or a base class below ``nn.Module``) calls ``torch._grouped_mm`` /
    ``F.grouped_mm`` in its source: a grouped-experts module (e.g. torchtitan's ``GroupedExperts``), whose 3-D
    parameters ``(E, out, in)`` :func:`convert_to_fp8` converts. Read with ``inspect.getsource`` (False when the
    source is not available)."""
    import inspect

    hit = _GROUPED_SOURCE.get(cls)
    if hit is None:
        hit = False
        for c in cls.__mro__:
            if c in (nn.Module, object) or issubclass(nn.Module, c):
                continue
            try:
                src = inspect.getsource(c)
            except (OSError, TypeError):
                continue
            if "grouped_mm" in src:
                hit = True
                break
        _GROUPED_SOURCE[cls] = hit
    return hit


def _grouped_experts_forward(self, *args, **kwargs):
    """``forward`` of converted grouped-experts modules: the module's own forward under
    :class:`~fp8tensor.grouped.Fp8GroupedMMMode`, so its ``torch._grouped_mm`` calls with the converted expert weights
    run :func:`~fp8tensor.grouped.fp8_grouped_mm` (also when the weight is the fp8 weight FSDP2 all-gathered)."""
    with Fp8GroupedMMMode(self.fp8_recipe):
        return type(self)._fp8_base.forward(self, *args, **kwargs)


class Fp8GroupedExpertsMixin:
    """Marks a converted grouped-experts module ``C`` (class ``Fp8C(Fp8GroupedExpertsMixin, C)``, one per class):
    its forward is ``C.forward`` under :class:`~fp8tensor.grouped.Fp8GroupedMMMode`; ``fp8_expert_params`` names its
    converted 3-D parameters. Pickles name the original class."""

    forward = _grouped_experts_forward
    _fp8_base: type = nn.Module

    def __reduce_ex__(self, protocol):
        return (_new_converted_experts, (type(self)._fp8_base,), self.__getstate__())


_FP8_EXPERT_CLASSES: dict = {}


def _fp8_experts_class(cls: type) -> type:
    if issubclass(cls, Fp8GroupedExpertsMixin):
        return cls
    new = _FP8_EXPERT_CLASSES.get(cls)
    if new is None:
        new = type(f"Fp8{cls.__name__}", (Fp8GroupedExpertsMixin, cls), {"__module__": cls.__module__,
                                                                         "_fp8_base": cls})
        _FP8_EXPERT_CLASSES[cls] = new
    return new


def _new_converted_experts(base: type):
    """Unpickling helper: an empty instance of the converted class of grouped-experts class ``base``."""
    return object.__new__(_fp8_experts_class(base))


def _select_experts(module: nn.Module, module_filter_fn: Optional[FilterFn], op: str):
    """``(fqn, module, [names of its 3-D floating parameters])`` of the grouped-experts modules to convert."""
    chosen = []
    for fqn, mod in module.named_modules():
        if isinstance(mod, nn.Linear):
            continue
        names = [n for n, p in mod._parameters.items()
                 if p is not None and p.dim() == 3 and (p.dtype.is_floating_point or isinstance(
                     compat.local_tensor(p) if _is_dtensor(p) else p, ScaledFp8Tensor))]
        if not names or not (isinstance(mod, Fp8GroupedExpertsMixin) or uses_grouped_mm(type(mod))):
            continue
        if module_filter_fn is not None:
            try:
                keep = module_filter_fn(mod, fqn)
            except Exception as e:
                raise RuntimeError(f"{op}: module_filter_fn raised for module {fqn!r}; the model was not changed") from e
            if not keep:
                continue
        chosen.append((fqn, mod, names))
    return chosen


def _rewrap_experts_after_load(module, incompatible_keys):
    """After ``load_state_dict(assign=True)`` replaced expert weights with plain tensors, wrap them again."""
    for name in module.fp8_expert_params:
        w = getattr(module, name)
        local = compat.local_tensor(w) if _is_dtensor(w) else w
        if isinstance(local, (Fp8MasterWeight, ScaledFp8Tensor)):
            continue
        new = _swap_local(w, lambda lt: Fp8MasterWeight(lt, module.fp8_recipe))
        if new is not None:
            setattr(module, name, new)


def _convert_experts(root: nn.Module, chosen, r, skipped: list) -> None:
    for fqn, mod, names in chosen:
        done = []
        for name in names:
            w = mod._parameters[name]
            local = compat.local_tensor(w) if _is_dtensor(w) else w
            if isinstance(local, Fp8MasterWeight):
                local.recipe = r
            elif isinstance(local, ScaledFp8Tensor):
                pass
            elif w.shape[1] % 16 or w.shape[2] % 16:
                skipped.append(f"{fqn + '.' if fqn else ''}{name} ({tuple(w.shape)})")
                continue
            else:
                new = _swap_local(w, lambda lt: Fp8MasterWeight(lt, r))
                if new is not None:
                    _adopt_parameter(root, w, new)
            done.append(name)
        if not done:
            continue
        if not getattr(mod, "_fp8_hooks", False):
            compat.register_state_dict_hook(mod, _plain_state_dict_hook)
            mod.register_load_state_dict_post_hook(_rewrap_experts_after_load)
            mod._fp8_hooks = True
        mod.fp8_recipe = r
        mod.fp8_expert_params = tuple(done)
        mod.__class__ = _fp8_experts_class(type(mod))


def convert_to_fp8(
    module: nn.Module, *, recipe="rowwise", module_filter_fn: Optional[FilterFn] = None,
    size_rule: Optional[bool] = None,
) -> nn.Module:
    """Convert every ``nn.Linear`` of ``module`` (in place) to fp8 training with high-precision master weights.

    Each selected Linear's weight is wrapped in :class:`~fp8tensor.master.Fp8MasterWeight` (quantized on use;
    the optimizer still updates the high-precision values) and its ``forward`` becomes
    :func:`~fp8tensor.fp8_linear` with ``recipe`` (the module's class becomes a subclass of its class and of
    :class:`Fp8LinearMixin`: ``nn.Linear`` -> :class:`Fp8Linear`). Callable before or after ``parallelize_module``,
    torchtitan's TP and ``fully_shard``. ``state_dict()`` of the converted module holds plain high-precision tensors.
    A plain weight Parameter becomes its master in place (``torch.utils.swap_tensors``), so tied weights stay tied
    and every holder sees the master: an embedding sharing the output head's weight reads it as the high-precision
    tensor it wraps; one gradient, one optimizer state (an optimizer built before conversion keeps working). Where
    torch refuses the swap (weak references to the Parameter, e.g. after ``torch.compile`` ran the model), the master
    is set in every module of ``module`` that held the Parameter. DTensor weights keep their Parameter object anyway.

    Grouped-experts modules (a module whose class calls ``torch._grouped_mm`` / ``F.grouped_mm``, e.g. torchtitan's
    ``GroupedExperts``, with 3-D parameters ``(E, out_features, in_features)`` such as ``w1`` / ``w2`` / ``w3``) are
    converted alike: each 3-D parameter (both inner dims multiples of 16) becomes a master weight and the module's
    ``forward`` runs under :class:`~fp8tensor.grouped.Fp8GroupedMMMode`, so its grouped GEMMs with these weights run
    :func:`~fp8tensor.grouped.fp8_grouped_mm` (docs/moe.md). ``module_filter_fn`` is asked about these modules too.

    A ``forward`` that a framework set on the instance and that calls the Linear's own bound forward it captured
    (torchtitan's ``Module.parallelize``: ``lin.forward = wrapper`` around the bound ``nn.Linear.forward``) is kept
    and pointed at the fp8 forward, so the Linear still runs all of the recipe's fp8 GEMMs (see :class:`_Redirect`).

    Layers with ``in_features`` or ``out_features`` not a multiple of 16 (fp8 GEMMs need it; padding every call
    would cost more than it saves), and Linears with a ``forward`` of their own (a subclass overriding it, or one
    set on the instance that never calls the Linear's forward, e.g. a LoRA-style Linear: conversion would silently
    replace it) are left in high precision, and a warning lists them; they are also listed in
    ``module.fp8_skipped``. So are Linears whose weight is parametrized (e.g. weight norm). Converting a converted
    model again switches its recipe; a Linear whose weight is already an :class:`Fp8MasterWeight` (swapped in by
    hand) gets the fp8 forward.

    With ``size_rule`` (the size-aware choice, :func:`fp8_size_choice`), Linears too small for fp8 to pay for its
    quantizations stay in high precision too; they are listed as ``"fqn (K->N, size rule)"``. With the ``rowwise``
    recipe, mid-sized Linears (``K * N / (K + N)`` below ``size_rule_fp8_grad_weight_min``) get ``rowwise_gw_hp``
    (grad_weight in high precision); they are listed in ``module.fp8_grad_weight_hp`` as ``"fqn (K->N)"``.

    The model gets a forward pre-hook, first among its hooks, under which ``torch.export`` of a tensor-parallel fp8
    model (parallelized before or after the conversion) raises a ``NotImplementedError`` naming the remedy instead of
    DTensor's own failure; outside ``torch.export`` it does nothing.

    Args:
        module: the model.
        recipe: ``"rowwise"`` (all three GEMMs in fp8) or ``"rowwise_gw_hp"`` (grad_weight in high precision).
        module_filter_fn: ``fn(module, fqn) -> bool``; only Linears and grouped-experts modules for which it returns
            True are converted.
        size_rule: keep Linears that :func:`fp8_size_rule` expects to be slower in fp8 in high precision, and give
            mid-sized ``rowwise`` Linears ``rowwise_gw_hp`` (True, :func:`fp8_size_choice`), or convert every Linear
            the filter selects with ``recipe`` (False); None (default): ``fp8tensor.get_config().size_rule``
            (default False).
            Applied after ``module_filter_fn``.

    Returns:
        ``module`` itself.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, the filter is not callable, or ``size_rule`` is not a bool.
        ValueError: unknown recipe.
        RuntimeError: ``module_filter_fn`` raised, a Linear is currently unsharded by FSDP2, a Linear that is not
            converted shares its weight with one that is, or a forward set on a Linear instance holds the Linear's
            bound forward where it cannot be redirected (e.g. in a named tuple; convert before parallelizing). The
            model is left unchanged.
    """
    op = "convert_to_fp8"
    r = get_recipe(recipe)
    if size_rule is not None and not isinstance(size_rule, bool):
        raise TypeError(f"convert_to_fp8: size_rule must be None, True or False, got {size_rule!r}")
    use_size_rule = get_config().size_rule if size_rule is None else size_rule
    chosen = _select_linears(module, module_filter_fn, op)
    _check_fsdp_sharded([lin.weight for _, lin in chosen], op)
    chosen, skipped, redirects = _drop_custom_forwards(chosen, op)
    _check_ties(module, chosen, op)
    experts = _select_experts(module, module_filter_fn, op)
    _check_fsdp_sharded([getattr(m, n) for _, m, names in experts for n in names], op)
    classes = {fqn: _fp8_class(type(lin)) for fqn, lin in chosen}  # before any change: a failure leaves no trace
    gw_hp = []  # Linears the size rule gives rowwise_gw_hp instead of rowwise
    stay_fp8 = []  # Linears converted before that the size rule would have kept in high precision
    for fqn, lin in chosen:
        w = lin.weight
        local = compat.local_tensor(w) if _is_dtensor(w) else w
        lr = fp8_size_choice(lin.in_features, lin.out_features, r) if use_size_rule else r
        if isinstance(local, Fp8MasterWeight):
            # Converted before (only the recipe may change), or a master swapped in by hand: the module's forward
            # becomes fp8_linear too (a bare F.linear on a DTensor master runs grad_weight in high precision).
            if lr is None:  # (the size rule does not undo a conversion: said in the warning below)
                stay_fp8.append(f"{fqn or '<root>'} ({lin.in_features}->{lin.out_features})")
                lr = r
            local.recipe = lr
        elif isinstance(local, ScaledFp8Tensor):
            continue  # stored in fp8 by quantize_weights: nothing to train
        elif lin.in_features % 16 or lin.out_features % 16 or not w.dtype.is_floating_point:
            skipped.append(f"{fqn or '<root>'} ({lin.in_features}->{lin.out_features})")
            continue
        elif lr is None:
            skipped.append(f"{fqn or '<root>'} ({lin.in_features}->{lin.out_features}, size rule)")
            continue
        else:
            new = _swap_local(w, lambda lt, lr=lr: Fp8MasterWeight(lt, lr))
            if new is not None:  # a plain Parameter: every holder of it gets the master (tied weights)
                _adopt_parameter(module, w, new)
        if lr is not r:
            gw_hp.append(f"{fqn or '<root>'} ({lin.in_features}->{lin.out_features})")
        if not getattr(lin, "_fp8_hooks", False):  # state-dict hooks once per module
            compat.register_state_dict_hook(lin, _plain_state_dict_hook)
            lin.register_load_state_dict_pre_hook(_checkpoint.load_state_dict_pre_hook)  # plain fp8 checkpoints
            lin.register_load_state_dict_post_hook(_rewrap_after_load)
            lin._fp8_hooks = True
        lin.fp8_recipe = lr
        _install_fp8_forward(lin, classes[fqn], redirects[fqn])
        _add_tp_export_hook(lin)
    _convert_experts(module, experts, r, skipped)
    if chosen or experts:
        _add_model_export_hook(module)
    module.fp8_skipped = skipped
    module.fp8_grad_weight_hp = gw_hp
    if skipped:
        warnings.warn(
            f"{op}: left in high precision: {', '.join(skipped)}", stacklevel=2
        )
    if stay_fp8:
        warnings.warn(
            f"{op}: already converted, so they stay fp8 with recipe {r.name!r} although the size rule would keep them "
            f"in high precision (it does not undo a conversion; apply it to an unconverted model): "
            f"{', '.join(stay_fp8)}", stacklevel=2
        )
    return module


def quantize_weights(
    module: nn.Module, *, module_filter_fn: Optional[FilterFn] = None, float8_dtype: torch.dtype = E4M3
) -> nn.Module:
    """Store the weight of every ``nn.Linear`` of ``module`` (in place) as a row-wise :class:`ScaledFp8Tensor`, and
    the 3-D weights ``[E, out, in]`` of every grouped-experts module (as :func:`convert_to_fp8` selects them) as
    ScaledFp8Tensors with per-expert row scales ``[E, out, 1]`` (their grouped GEMMs then run in fp8, the input
    gradient through scale folding).

    For inference and frozen (e.g. LoRA base) weights: ``weight = ScaledFp8Tensor.from_hp(weight)`` with
    ``requires_grad=False``; the Linear's ``forward`` becomes :func:`~fp8tensor.fp8_linear`, so gradients still
    flow to the input, in fp8, through scale folding (the fp8 weight is never re-quantized). Works before or
    after ``parallelize_module`` or torchtitan's TP (each shard is quantized on its own; a framework's wrapper of the
    forward is redirected as in :func:`convert_to_fp8`). Linears sharing one weight share one fp8 copy of it; a
    module other than a Linear that shares it (a tied embedding) keeps the high-precision Parameter. Linears with a
    ``forward`` of their own are left
    unchanged, with a warning (as in :func:`convert_to_fp8`).

    Args:
        module: the model.
        module_filter_fn: ``fn(linear, fqn) -> bool`` selecting Linears.
        float8_dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.

    A Hugging Face transformers ``PreTrainedModel`` also gets ``model.config.quantization_config`` describing its
    fp8 weights (transformers' ``fbgemm_fp8`` method, the same checkpoint layout), so that ``from_pretrained`` of a
    plain-layout ``save_pretrained`` checkpoint loads it correctly or raises clearly
    (:func:`fp8tensor.checkpoint.set_hf_quantization_config`). The model also gets a forward pre-hook that makes
    ``torch.export`` of a tensor-parallel fp8 model raise an error naming the remedy (before or after
    ``parallelize_module``).

    Returns:
        ``module`` itself.

    Raises:
        TypeError: not an ``nn.Module``, filter not callable, or unsupported ``float8_dtype``.
        RuntimeError: ``module_filter_fn`` raised, or a forward wrapper cannot be redirected (as in
            :func:`convert_to_fp8`); the model is left unchanged.
    """
    op = "quantize_weights"
    check_float8_dtype(float8_dtype, op)
    chosen = _select_linears(module, module_filter_fn, op)
    _check_fsdp_sharded([lin.weight for _, lin in chosen], op)
    chosen, skipped, redirects = _drop_custom_forwards(chosen, op)
    experts = _select_experts(module, module_filter_fn, op)
    _check_fsdp_sharded([getattr(m, n) for _, m, names in experts for n in names], op)
    for fqn, mod, names in experts:
        skipped += [f"{fqn + '.' if fqn else ''}{n} ({tuple(getattr(mod, n).shape)})" for n in names
                    if getattr(mod, n).shape[1] % 16 or getattr(mod, n).shape[2] % 16]
    if skipped:
        warnings.warn(f"{op}: left in high precision: {', '.join(skipped)}", stacklevel=2)
    classes = {fqn: _fp8_class(type(lin)) for fqn, lin in chosen}  # before any change: a failure leaves no trace
    shared: dict = {}  # id(old weight) -> (old weight, its fp8 Parameter): Linears sharing a weight share the fp8 one
    for fqn, lin in chosen:
        w = lin.weight
        local = compat.local_tensor(w) if _is_dtensor(w) else w
        if isinstance(local, ScaledFp8Tensor):
            continue

        def q(lt):
            hp = lt._data if isinstance(lt, Fp8MasterWeight) else lt
            return ScaledFp8Tensor.from_hp(hp.detach(), float8_dtype)

        if _is_dtensor(w):
            w.requires_grad_(False)
            compat.set_local_tensor(w, map_shard(compat.local_tensor(w), q))
            refresh_fsdp_param(w)
        else:
            new = shared.get(id(w))
            if new is None:
                new = shared[id(w)] = (w, nn.Parameter(q(w.data), requires_grad=False))
            lin.weight = new[1]
        lin.fp8_recipe = get_recipe("rowwise")
        _install_fp8_forward(lin, classes[fqn], redirects[fqn])
        _add_fp8_checkpoint_hooks(lin, float8_dtype)
        _add_tp_export_hook(lin)
    for fqn, mod, names in experts:  # grouped experts: each 3-D weight stored as row-wise fp8 ([E, out, 1] scales)
        done = []
        for name in names:
            w = mod._parameters[name]
            local = compat.local_tensor(w) if _is_dtensor(w) else w
            if not isinstance(local, ScaledFp8Tensor) and (w.shape[1] % 16 or w.shape[2] % 16):
                continue
            done.append(name)
            if isinstance(local, ScaledFp8Tensor):
                continue
            q = functools.partial(_quantize_expert_weight, float8_dtype=float8_dtype)
            if _is_dtensor(w):
                w.requires_grad_(False)
                compat.set_local_tensor(w, map_shard(compat.local_tensor(w), q))
                refresh_fsdp_param(w)
            else:
                setattr(mod, name, nn.Parameter(q(w.data), requires_grad=False))
        if done:
            _add_fp8_checkpoint_hooks(mod, float8_dtype)
            mod.fp8_recipe = get_recipe("rowwise")
            mod.fp8_expert_params = tuple(done)
            mod.__class__ = _fp8_experts_class(type(mod))
    if chosen or experts:
        _add_model_export_hook(module)
        _checkpoint.set_hf_quantization_config(module)
    return module


def _tp_fp8_module(m: nn.Module) -> bool:
    """Whether ``m`` is a converted Linear or grouped-experts module holding a DTensor fp8 weight."""
    if isinstance(m, Fp8LinearMixin):
        return _is_dtensor(m._parameters.get("weight"))
    return any(_is_dtensor(m._parameters.get(n)) for n in getattr(m, "fp8_expert_params", ()))


def _refuse_tp_export(module: nn.Module, args):
    """Forward pre-hook, first among a module's pre-hooks, of converted Linears with a DTensor weight and of the model
    passed to :func:`convert_to_fp8` / :func:`quantize_weights`: under ``torch.export`` it raises the error naming the
    remedy (:func:`fp8tensor.linear.tp_export_message`) when ``module`` or a submodule is a tensor-parallel fp8
    module, before any parallel style's hook fails in DTensor's own way; otherwise (and always outside
    ``torch.export``) it does nothing."""
    if not compat.is_exporting():
        return
    for name, m in module.named_modules():
        if _tp_fp8_module(m):
            where = f"{type(m).__name__}" + (f" {name!r}" if name else "")
            raise NotImplementedError(tp_export_message(f"fp8tensor ({where})"))


def _add_tp_export_hook(lin: nn.Module) -> None:
    """Once per Linear whose weight is a DTensor: :func:`_refuse_tp_export`, first among its pre-hooks (only
    tensor-parallel Linears get it: a plain Linear's forward keeps its hook-free fast path). Called at conversion
    and when a DTensor weight is registered later (:meth:`Fp8LinearMixin.register_parameter`)."""
    if _is_dtensor(lin._parameters.get("weight")) and not getattr(lin, "_fp8_tp_export_hook", False):
        compat.prepend_forward_pre_hook(lin, _refuse_tp_export)
        lin._fp8_tp_export_hook = True


def _add_model_export_hook(module: nn.Module) -> None:
    """Once per converted model: :func:`_refuse_tp_export` first among the pre-hooks of the model itself, so that
    ``torch.export.export(model)`` of a model parallelized before or after the conversion fails with fp8tensor's
    error before any hook of a parallel style (on the model's submodules, Linears or not) runs. Outside
    ``torch.export`` the hook only asks :func:`fp8tensor.compat.is_exporting`, once per forward of the model."""
    if not getattr(module, "_fp8_model_export_hook", False):
        compat.prepend_forward_pre_hook(module, _refuse_tp_export)
        module._fp8_model_export_hook = True


def _add_fp8_checkpoint_hooks(mod: nn.Module, float8_dtype: torch.dtype = E4M3) -> None:
    """Once per module: the state-dict hooks of :mod:`fp8tensor.checkpoint` (``state_dict()`` in the plain layout
    under ``fp8tensor.config(state_dict_fp8="plain")``; loading accepts the plain layout), and a post-hook that
    stores a weight again in fp8 (``float8_dtype``) after ``load_state_dict(..., assign=True)`` of a high-precision
    checkpoint replaced it."""
    if not getattr(mod, "_fp8_checkpoint_hooks", False):
        compat.register_state_dict_hook(mod, _checkpoint.state_dict_hook)
        mod.register_load_state_dict_pre_hook(_checkpoint.load_state_dict_pre_hook)
        mod.register_load_state_dict_post_hook(_requantize_after_load)
        mod._fp8_checkpoint_hooks = True
    mod._fp8_float8_dtype = float8_dtype


def _requantize_after_load(module, incompatible_keys):
    """After ``load_state_dict(assign=True)`` put a plain high-precision tensor where :func:`quantize_weights` stored
    fp8 (a Linear's ``weight``, a grouped-experts module's expert weights), store it in fp8 again (row-wise, as
    ``quantize_weights`` does)."""
    dt = getattr(module, "_fp8_float8_dtype", E4M3)
    names = getattr(module, "fp8_expert_params", None) or ("weight",)
    for name in names:
        w = module._parameters.get(name)
        if w is None or _is_dtensor(w) or isinstance(w, ScaledFp8Tensor) or not w.dtype.is_floating_point \
                or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            continue
        q = _quantize_expert_weight(w.detach(), dt) if w.dim() == 3 else ScaledFp8Tensor.from_hp(w.detach(), dt)
        setattr(module, name, nn.Parameter(q, requires_grad=False))


def _quantize_expert_weight(lt: torch.Tensor, float8_dtype: torch.dtype) -> ScaledFp8Tensor:
    hp = lt._data if isinstance(lt, Fp8MasterWeight) else lt
    return ScaledFp8Tensor.from_hp(hp.detach(), float8_dtype)
