"""Module conversion: ``convert_to_fp8`` (training, master weights) and ``quantize_weights`` (fp8 storage): which
modules are converted and the conversion itself (docs/design.md, "Map of the package"; docs/fsdp.md, docs/tp.md)."""
from __future__ import annotations

import functools
import warnings
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..core import compat
from . import checkpoint as _checkpoint
from ..numerics.quantize import E4M3, FLOAT8_DTYPES, check_float8_dtype
from ..distributed.fsdp_state import check_fsdp_sharded as _check_fsdp_sharded
from ..distributed.fsdp_state import fp8_all_gather_default, rule_changes_after_init
from .export import add_model_export_hook, add_tp_export_hook, refuse_tp_export
from ..training.master import Fp8MasterWeight
from .modules import (Fp8GroupedExpertsMixin, Fp8Linear, Fp8LinearMixin, _new_converted, add_fp8_checkpoint_hooks,
                      experts_class, fp8_class, fp8_linear_forward, install_fp8_forward, instance_forward, own_forward,
                      plain_state_dict_hook, quantize_expert_weight, requantize_after_load, rewrap_after_load,
                      add_load_check_hook, add_retie_hooks,
                      swap_local, uses_grouped_mm)
from ..training.recipes import fp8_size_choice, fp8_size_rule, get_recipe
from ..core.settings import get_config
from ..subclass.tensor import ScaledFp8Tensor, _is_dtensor, check_finite_rows, local_of

__all__ = ["convert_to_fp8", "quantize_weights", "fp8_linear_forward", "Fp8Linear", "Fp8LinearMixin",
           "Fp8GroupedExpertsMixin", "uses_grouped_mm", "fp8_size_rule", "fp8_size_choice"]

FilterFn = Callable[[nn.Module, str], bool]

#: Names that pickles of converted modules made by earlier versions look up in ``fp8tensor.convert``: the unpickling
#: helper and the hooks those modules held.
_refuse_tp_export = refuse_tp_export
_plain_state_dict_hook = plain_state_dict_hook
_rewrap_after_load = _rewrap_experts_after_load = rewrap_after_load
_requantize_after_load = requantize_after_load


def _new_converted_experts(base: type):
    """Unpickling helper of grouped-experts modules pickled by fp8tensor before the class skeleton was shared."""
    return _new_converted(base, Fp8GroupedExpertsMixin)


def _wanted(module_filter_fn: Optional[FilterFn], mod: nn.Module, fqn: str, op: str) -> bool:
    if module_filter_fn is None:
        return True
    try:
        return module_filter_fn(mod, fqn)
    except Exception as e:  # the model is still untouched here
        raise RuntimeError(f"{op}: module_filter_fn raised for module {fqn!r}; the model was not changed") from e


def _select(module: nn.Module, module_filter_fn: Optional[FilterFn], op: str, ties: bool = False):
    """``(linears [(fqn, lin)], skipped, redirects, experts [(fqn, module, [3-D parameter names])])`` to convert,
    checked before anything changes."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{op}: expected an nn.Module, got {type(module).__name__}")
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(f"{op}: module_filter_fn must be callable (module, fqn) -> bool")
    chosen = [(fqn, mod) for fqn, mod in module.named_modules()
              if isinstance(mod, nn.Linear) and _wanted(module_filter_fn, mod, fqn, op)]
    _check_fsdp_sharded([(f"{name}.weight" if name else "weight", lin.weight) for name, lin in chosen], op)
    chosen, skipped, redirects = _drop_custom_forwards(chosen, op)
    if ties:
        _check_ties(module, chosen, op)
    experts = []
    for fqn, mod in module.named_modules():
        if isinstance(mod, nn.Linear):
            continue
        weights = {n: p for n, p in compat.parameters_dict(mod).items() if p is not None and p.dim() == 3}
        names = [n for n, p in weights.items() if isinstance(local_of(p), ScaledFp8Tensor)
                 or (p.dtype.is_floating_point and p.dtype not in FLOAT8_DTYPES)]
        # a plain float8 weight has no scales to read it by: left as it is, as a Linear's (own_forward)
        plain_fp8 = [n for n, p in weights.items() if n not in names and p.dtype in FLOAT8_DTYPES]
        if ((names or plain_fp8) and (isinstance(mod, Fp8GroupedExpertsMixin) or uses_grouped_mm(type(mod)))
                and _wanted(module_filter_fn, mod, fqn, op)):
            if names:
                experts.append((fqn, mod, names))
            skipped += [f"{fqn + '.' if fqn else ''}{n} (a {weights[n].dtype} weight, not a high-precision "
                        "floating-point one)" for n in plain_fp8]
    _check_fsdp_sharded([(f"{name}.{n}" if name else n, getattr(m, n)) for name, m, names in experts
                         for n in names], op)
    return chosen, skipped, redirects, experts


def _drop_custom_forwards(chosen, op: str):
    """``(keep, skipped, redirects)``: Linears whose own ``forward`` conversion would replace are skipped; raises
    ``RuntimeError`` (nothing changed yet) where an instance forward cannot be redirected."""
    keep, skipped, redirects, blocked = [], [], {}, []
    for fqn, lin in chosen:
        name = fqn or "<root>"
        why = own_forward(lin)
        plan = instance_forward(lin) if why is None else None
        if why is not None or (plan is not None and not plan.blocked and not plan.found):
            skipped.append(f"{name} ({why or 'a forward set on the instance'})")
        elif plan is not None and plan.blocked:
            blocked.append(f"{name!r} ({', '.join(plan.blocked)})")
        else:
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


def _check_ties(root: nn.Module, chosen, op: str) -> None:
    """Raise ``RuntimeError`` (naming both; nothing changed) if a weight conversion makes a master (or, for
    ``quantize_weights``, an fp8 copy) is also held by an ``nn.Linear`` that is not converted: a tied weight is
    quantized on every GEMM use or on none."""
    converted = {id(lin) for _, lin in chosen}
    owners = {id(lin.weight): fqn for fqn, lin in chosen  # (an fp8 weight both read as it is: nothing to refuse)
              if not _is_dtensor(lin.weight) and not isinstance(lin.weight, ScaledFp8Tensor)}
    bad = [f"{fqn!r} (shares its weight with {owners[id(mod.weight)]!r})" for fqn, mod in root.named_modules()
           if isinstance(mod, nn.Linear) and id(mod) not in converted and id(mod.weight) in owners]
    if bad:
        raise RuntimeError(
            f"{op}: Linear {', '.join(bad)} is not selected for conversion but its weight is tied to a Linear that "
            "is: a tied weight is quantized on every GEMM use or on none. Select both Linears or neither "
            "(module_filter_fn). The model was not changed."
        )


def _tied_outside_linears(root: nn.Module, chosen) -> set:
    """``id`` s of the plain (not DTensor) weights of the ``chosen`` Linears that a module of ``root`` other than a
    Linear also holds (an embedding tied to the output head)."""
    weights = {id(lin.weight) for _, lin in chosen if not _is_dtensor(lin.weight)}
    return {id(p) for mod in root.modules() if not isinstance(mod, nn.Linear)
            for p in compat.parameters_dict(mod).values() if p is not None and id(p) in weights}


def _adopt_parameter(root: nn.Module, old: nn.Parameter, new: nn.Parameter, where: str = "",
                     stacklevel: int = 3) -> None:
    """Make every holder of ``old`` hold the master ``new`` (``swap_tensors``, else set in every module of ``root``
    with a warning: an optimizer built before keeps ``old``); a non-Linear holder (a tied embedding) gets the plain
    state-dict hook."""
    for k, v in old.__dict__.items():  # attributes users and frameworks set on the Parameter (no_weight_decay, ...)
        new.__dict__.setdefault(k, v)
    try:
        torch.utils.swap_tensors(old, new)
        holder = old
    except RuntimeError as e:
        holder = new
        warnings.warn(
            f"convert_to_fp8: {where or 'a weight'} {tuple(old.shape)} could not be swapped in place "
            f"({str(e).splitlines()[0][:160]}; a weak reference or a view of it is alive), so the module now holds a "
            "new Parameter: an optimizer (or anything else) holding the old one no longer updates the model. Build "
            "the optimizer after convert_to_fp8, or drop the references and views first", UserWarning,
            stacklevel=stacklevel)
        for mod in root.modules():
            for name, p in list(compat.parameters_dict(mod).items()):
                if p is old:
                    compat.parameters_dict(mod)[name] = new
    for mod in root.modules():
        if isinstance(mod, nn.Linear) or getattr(mod, "_fp8_state_dict_hook", False):
            continue
        if any(p is holder for p in compat.parameters_dict(mod).values()):
            compat.register_state_dict_hook(mod, plain_state_dict_hook)
            mod._fp8_state_dict_hook = True


def _convert_experts(root: nn.Module, chosen, r, skipped: list) -> None:
    for fqn, mod, names in chosen:
        done = []
        for name in names:
            w = compat.parameters_dict(mod)[name]
            local = local_of(w)
            if isinstance(local, Fp8MasterWeight):
                local.recipe = r
            elif not isinstance(local, ScaledFp8Tensor):
                if w.shape[1] % 16 or w.shape[2] % 16:
                    skipped.append(f"{fqn + '.' if fqn else ''}{name} ({tuple(w.shape)})")
                    continue
                new = swap_local(w, lambda lt: Fp8MasterWeight(lt, r))
                if new is not None:
                    _adopt_parameter(root, w, new, f"{fqn + '.' if fqn else ''}{name}", stacklevel=4)
            done.append(name)
        if done:
            if not getattr(mod, "_fp8_hooks", False):
                compat.register_state_dict_hook(mod, plain_state_dict_hook)
                mod.register_load_state_dict_pre_hook(_checkpoint.load_state_dict_pre_hook)  # plain fp8 checkpoints
                mod.register_load_state_dict_post_hook(rewrap_after_load)
                mod._fp8_hooks = True
            mod.fp8_recipe = r
            mod.fp8_expert_params = tuple(done)
            mod.__class__ = experts_class(type(mod))


def convert_to_fp8(
    module: nn.Module, *, recipe="rowwise", module_filter_fn: Optional[FilterFn] = None,
    size_rule: Optional[bool] = None, fp8_all_gather: Optional[bool] = None,
) -> nn.Module:
    """Convert every ``nn.Linear`` of ``module`` (in place; returns ``module``) to fp8 training with high-precision
    master weights.

    Each selected Linear's weight becomes an :class:`~fp8tensor.master.Fp8MasterWeight` (quantized on use) and its
    class ``Fp8C(Fp8LinearMixin, C)`` (``nn.Linear`` -> :class:`Fp8Linear`), whose ``forward`` is
    :func:`~fp8tensor.fp8_linear` with ``recipe``. Callable before or after ``parallelize_module``, torchtitan's TP
    and ``fully_shard``; ``state_dict()`` holds plain high-precision tensors. A plain weight Parameter becomes its
    master in place (``torch.utils.swap_tensors``, else set in every holder), so tied weights stay one Parameter.
    Grouped-experts modules (calling ``torch._grouped_mm``; 3-D parameters ``(E, out_features, in_features)``, inner
    dims multiples of 16) are converted alike (docs/moe.md).

    A ``forward`` a framework set on the instance around the Linear's bound forward (torchtitan's
    ``Module.parallelize``) is pointed at the fp8 forward (:class:`~fp8tensor.modules._Redirect`). Left in high
    precision, with a warning, and listed in ``module.fp8_skipped``: Linears with a dim not a multiple of 16, a
    ``forward`` of their own (a subclass's, or an instance one that never calls the Linear's, e.g. LoRA), a
    parametrized weight, a weight that is not a high-precision float (integer, plain float8) or not materialized yet
    (a lazy module), and with ``size_rule`` those too small (``"fqn (K->N, size rule)"``); mid-sized ``rowwise``
    Linears it gives ``rowwise_gw_hp`` are listed in ``module.fp8_grad_weight_hp``. Converting again switches the
    recipe. ``torch.export`` of a tensor-parallel fp8 model raises ``NotImplementedError`` (docs/serving.md).

    Args:
        module: the model.
        recipe: ``"rowwise"`` (all three GEMMs in fp8), ``"rowwise_gw_hp"`` or a :class:`~fp8tensor.Recipe`.
        module_filter_fn: ``fn(module, fqn) -> bool`` selecting Linears and grouped-experts modules.
        size_rule: True: the size-aware choice :func:`fp8_size_choice` (applied after ``module_filter_fn``); False:
            every selected Linear with ``recipe``; None (default): ``fp8tensor.get_config().size_rule`` (False).
        fp8_all_gather: True: each weight becomes an :class:`Fp8MasterWeight`, which FSDP2 all-gathers in fp8 with
            its row scales. False: a plain Parameter all-gathered in its ``param_dtype``, quantized on use. None
            (default): :func:`fp8tensor.distributed.fsdp_state.fp8_all_gather_default` (False on one host over NCCL,
            except for weights of at least ``get_config().fp8_all_gather_min_numel`` elements; docs/fsdp.md). Stored
            as ``module.fp8_all_gather``. Expert weights and existing masters stay masters (a warning if False). A
            weight that a module other than a Linear also holds (an output head tied to the embedding) stays a plain
            Parameter whatever this says: the embedding reads it in high precision, under FSDP2 too.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, the filter is not callable, the recipe is neither a name
            nor a :class:`Recipe`, or ``size_rule`` or ``fp8_all_gather`` is not None or a bool.
        ValueError: unknown recipe.
        RuntimeError: ``module_filter_fn`` raised, a Linear is currently unsharded by FSDP2, a Linear that is not
            converted shares its weight with one that is, or an instance forward cannot be redirected. The model is
            left unchanged.
    """
    op = "convert_to_fp8"
    r = get_recipe(recipe)
    for name, value in (("size_rule", size_rule), ("fp8_all_gather", fp8_all_gather)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"convert_to_fp8: {name} must be None, True or False, got {value!r}")
    asked_plain = fp8_all_gather is False  # (re-converting a master with the rule's False keeps it silently)
    early = False  # the rule chose the fp8 all-gather only because no process group exists yet (one-host job)
    big = None  # the rule's bf16 all-gather: weights of at least this many elements are all-gathered in fp8 still
    if fp8_all_gather is None:
        fp8_all_gather = fp8_all_gather_default()
        early = fp8_all_gather and rule_changes_after_init()
        big = None if fp8_all_gather else get_config().fp8_all_gather_min_numel
    use_size_rule = get_config().size_rule if size_rule is None else size_rule
    chosen, skipped, redirects, experts = _select(module, module_filter_fn, op, ties=True)
    classes = {fqn: fp8_class(type(lin)) for fqn, lin in chosen}  # before any change: a failure leaves no trace
    # (a weight an embedding also holds stays plain, quantized on use: FSDP2 all-gathers it in high precision, and the
    # embedding reads it exactly, as without FSDP2; a master's fp8 all-gather would hand it fp8-rounded rows)
    tied = _tied_outside_linears(module, chosen)
    gw_hp = []  # Linears the size rule gives rowwise_gw_hp instead of rowwise
    stay_fp8 = []  # Linears converted before that the size rule would have kept in high precision
    keep_masters = []  # Linears converted before with the fp8 all-gather, now asked for fp8_all_gather=False
    for fqn, lin in chosen:
        w = lin.weight
        local = local_of(w)
        label = f"{fqn or '<root>'} ({lin.in_features}->{lin.out_features}"
        lr = fp8_size_choice(lin.in_features, lin.out_features, r) if use_size_rule else r
        if isinstance(local, Fp8MasterWeight):
            # converted before (only the recipe may change), or a master swapped in by hand: gets the fp8 forward
            if lr is None:  # (the size rule does not undo a conversion: said in the warning below)
                stay_fp8.append(label + ")")
                lr = r
            if asked_plain:
                keep_masters.append(fqn or "<root>")
            local.recipe = lr
        elif isinstance(local, ScaledFp8Tensor):
            continue  # stored in fp8 by quantize_weights: nothing to train
        elif lin.in_features % 16 or lin.out_features % 16 or not w.dtype.is_floating_point:
            skipped.append(label + ")")
            continue
        elif lr is None:
            skipped.append(label + ", size rule)")
            continue
        elif (fp8_all_gather or (big is not None and lin.in_features * lin.out_features >= big)) and (
                id(w) not in tied):
            new = swap_local(w, lambda lt, lr=lr: Fp8MasterWeight(lt, lr))
            if new is not None:  # a plain Parameter: every holder of it gets the master (tied weights)
                _adopt_parameter(module, w, new, f"{fqn + '.' if fqn else ''}weight")
        if lr is not r:
            gw_hp.append(label + ")")
        if not getattr(lin, "_fp8_hooks", False):  # state-dict hooks once per module
            compat.register_state_dict_hook(lin, plain_state_dict_hook)
            lin.register_load_state_dict_pre_hook(_checkpoint.load_state_dict_pre_hook)  # plain fp8 checkpoints
            lin.register_load_state_dict_post_hook(rewrap_after_load)
            lin._fp8_hooks = True
        lin.fp8_recipe = lr
        # (what the weight is: a master is all-gathered in fp8; a plain one, e.g. an embedding's too, is not, also
        # after load_state_dict(assign=True), whose rewrap reads this flag)
        lin.fp8_all_gather = isinstance(local_of(lin.weight), Fp8MasterWeight) or (
            fp8_all_gather and id(w) not in tied)
        install_fp8_forward(lin, classes[fqn], redirects[fqn])
        add_tp_export_hook(lin)
    _convert_experts(module, experts, r, skipped)
    if chosen or experts:
        add_model_export_hook(module)
        add_load_check_hook(module)
    module.fp8_skipped = skipped
    module.fp8_grad_weight_hp = gw_hp
    if skipped:
        warnings.warn(f"{op}: left in high precision: {', '.join(skipped)}", stacklevel=2)
    if stay_fp8:
        warnings.warn(
            f"{op}: already converted, so they stay fp8 with recipe {r.name!r} although the size rule would keep them "
            f"in high precision (it does not undo a conversion; apply it to an unconverted model): "
            f"{', '.join(stay_fp8)}", stacklevel=2)
    if early and any(getattr(lin, "fp8_all_gather", False) for _, lin in chosen):
        warnings.warn(
            f"{op}: torch.distributed is not initialized yet, so fp8_all_gather=None chose the fp8 all-gather "
            "(Fp8MasterWeight weights); this job runs all its ranks on one host (WORLD_SIZE == LOCAL_WORLD_SIZE), "
            "where after init_process_group('nccl') the rule chooses the bf16 all-gather, and the two differ in "
            "speed and in the fp8 rounding of the weights. Convert after init_process_group, or pass "
            "fp8_all_gather=True or False", stacklevel=2)
    if keep_masters:
        warnings.warn(
            f"{op}: fp8_all_gather=False does not apply to Linears whose weight is already a master weight (converted "
            f"before with the fp8 all-gather); they keep it: {', '.join(keep_masters)}. Convert an unconverted model "
            "to gather its weights in high precision", stacklevel=2)
    return module


def quantize_weights(
    module: nn.Module, *, module_filter_fn: Optional[FilterFn] = None, float8_dtype: torch.dtype = E4M3
) -> nn.Module:
    """Store the weight of every ``nn.Linear`` of ``module`` (in place; returns ``module``) as a row-wise
    :class:`ScaledFp8Tensor`, and
    the 3-D weights ``[E, out, in]`` of every grouped-experts module (as :func:`convert_to_fp8` selects them) as
    ScaledFp8Tensors with per-expert row scales ``[E, out, 1]`` (their grouped GEMMs then run in fp8, the input
    gradient through scale folding).

    For inference and frozen (e.g. LoRA base) weights: ``weight = ScaledFp8Tensor.from_hp(weight)``, not requiring
    grad; the Linear's ``forward`` becomes :func:`~fp8tensor.fp8_linear` (input gradients in fp8). Works before or
    after ``parallelize_module`` or torchtitan's TP (per shard; forward wrappers redirected as in
    :func:`convert_to_fp8`). Linears sharing one weight share one fp8 copy; a Linear whose weight a module that is not a
    Linear also holds (an output head tied to the embedding) is left in high precision, with a warning (an fp8 copy
    would not see writes into the tied weight through the embedding, and quantizing it on each call would cost more
    than its high-precision GEMM: untie it first, ``head.weight = nn.Parameter(head.weight.detach().clone())``, to
    store it in fp8). Linears with a ``forward`` of their own, or a weight that is not a high-precision float or not materialized yet
    (a lazy module), are left unchanged, with a warning. A Hugging Face ``PreTrainedModel``
    gets ``config.quantization_config`` (:func:`fp8tensor.checkpoint.set_hf_quantization_config`).

    Args: ``module``, ``module_filter_fn`` (``fn(module, fqn) -> bool``), ``float8_dtype`` (``torch.float8_e4m3fn``,
    default, or ``torch.float8_e5m2``).

    Raises (the model left unchanged):
        TypeError: not an ``nn.Module``, filter not callable, or unsupported ``float8_dtype``.
        ValueError: a selected weight holds an inf or NaN (naming the parameter and its rows).
        RuntimeError: as :func:`convert_to_fp8` (a Linear left out by ``module_filter_fn`` sharing its weight with
            a selected one included).
    """
    op = "quantize_weights"
    check_float8_dtype(float8_dtype, op)
    chosen, skipped, redirects, experts = _select(module, module_filter_fn, op, ties=True)
    # A weight an embedding (or another module that is not a Linear) also holds stays that one high-precision
    # Parameter: an fp8 copy would never see writes into it through the other module, and quantizing it on each use
    # would read more bytes per call than the high-precision GEMM does.
    tied = _tied_outside_linears(module, chosen)
    skipped += [f"{fqn} (weight tied to a module that is not a Linear, e.g. an embedding)" for fqn, lin in chosen
                if id(lin.weight) in tied]
    chosen = [(fqn, lin) for fqn, lin in chosen if id(lin.weight) not in tied]
    for fqn, mod, names in experts:
        skipped += [f"{fqn + '.' if fqn else ''}{n} ({tuple(getattr(mod, n).shape)})" for n in names
                    if getattr(mod, n).shape[1] % 16 or getattr(mod, n).shape[2] % 16]
    targets = [(fqn, lin, ("weight",)) for fqn, lin in chosen] + experts
    for fqn, mod, names in targets:
        for n in names:  # inf / NaN rows raise before any change (quantized, they would be all NaN)
            local = local_of(getattr(mod, n))
            local = local._data if isinstance(local, Fp8MasterWeight) else local  # (a DTensor's shard, a master's data)
            if not isinstance(local, ScaledFp8Tensor) and local.dtype.is_floating_point:  # (fp8 weights skipped)
                check_finite_rows(local.detach(), f"{op}: {fqn + '.' if fqn else ''}{n}")
    classes = {fqn: fp8_class(type(lin)) for fqn, lin in chosen}  # before any change: a failure leaves no trace
    module.fp8_skipped = skipped
    if skipped:
        warnings.warn(f"{op}: left in high precision: {', '.join(skipped)}", stacklevel=2)
    q = functools.partial(quantize_expert_weight, float8_dtype=float8_dtype)  # a master's data, or the tensor itself
    shared: dict = {}  # id(old weight) -> (old weight, its fp8 Parameter): Linears sharing a weight share the fp8 one
    for fqn, mod, names in targets:
        linear = isinstance(mod, nn.Linear)  # else grouped experts: each 3-D weight gets [E, out, 1] scales
        done = []
        for name in names:
            w = getattr(mod, name)
            if isinstance(local_of(w), ScaledFp8Tensor):  # stored in fp8 before (a Linear is then left as it is)
                if not linear:
                    done.append(name)
                continue
            if not linear and (w.shape[1] % 16 or w.shape[2] % 16):
                continue
            done.append(name)
            if _is_dtensor(w):
                w.requires_grad_(False)
                swap_local(w, q)
            else:  # (experts get a Parameter each)
                if not linear or id(w) not in shared:
                    shared[id(w)] = (w, nn.Parameter(q(w.data), requires_grad=False))
                setattr(mod, name, shared[id(w)][1])
        if not done:
            continue
        mod.fp8_recipe = get_recipe("rowwise")
        add_fp8_checkpoint_hooks(mod, float8_dtype)
        if linear:
            if hasattr(mod, "fp8_all_gather"):  # converted before: an fp8 weight is all-gathered in fp8
                mod.fp8_all_gather = True
            install_fp8_forward(mod, classes[fqn], redirects[fqn])
            add_tp_export_hook(mod)
        else:
            mod.fp8_expert_params = tuple(done)
            mod.__class__ = experts_class(type(mod))
    if chosen or experts:
        add_model_export_hook(module)
        add_load_check_hook(module)
        add_retie_hooks(module)
        _checkpoint.set_hf_quantization_config(module)
    return module


