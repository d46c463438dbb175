"""``torch.export`` of tensor-parallel fp8 models: refused early, with an error naming the remedy.

``torch.export`` does not trace DTensor's parallel styles on the torch versions fp8tensor supports; a converted model
and each of its tensor-parallel fp8 modules get a forward pre-hook, first among their hooks, that raises
:func:`fp8tensor.linear.tp_export_message` under ``torch.export`` before any parallel style's hook fails in
DTensor's own way. Outside ``torch.export`` the hook only asks :func:`fp8tensor.compat.is_exporting`.
"""
from __future__ import annotations

import torch.nn as nn

from ..core import compat
from ..training.linear import tp_export_message
from ..subclass.tensor import _is_dtensor

__all__ = ["tp_fp8_module", "refuse_tp_export", "add_tp_export_hook", "add_model_export_hook"]


def tp_fp8_module(m: nn.Module) -> bool:
    """Whether ``m`` is a converted Linear or grouped-experts module holding a DTensor fp8 weight."""
    names = getattr(m, "fp8_expert_params", None)
    if names is None:
        names = ("weight",) if getattr(m, "fp8_recipe", None) is not None else ()  # a converted Linear
    return any(_is_dtensor(compat.parameters_dict(m).get(n)) for n in names)


def refuse_tp_export(module: nn.Module, args):
    """Forward pre-hook, first among a module's pre-hooks, of converted Linears with a DTensor weight and of the model
    passed to :func:`fp8tensor.convert_to_fp8` / :func:`fp8tensor.quantize_weights`: under ``torch.export`` it raises the error naming the
    remedy (:func:`fp8tensor.linear.tp_export_message`) when ``module`` or a submodule is a tensor-parallel fp8
    module, before any parallel style's hook fails in DTensor's own way; otherwise (and always outside
    ``torch.export``) it does nothing."""
    if not compat.is_exporting():
        return
    for name, m in module.named_modules():
        if tp_fp8_module(m):
            where = f"{type(m).__name__}" + (f" {name!r}" if name else "")
            raise NotImplementedError(tp_export_message(f"fp8tensor ({where})"))


def add_tp_export_hook(lin: nn.Module) -> None:
    """Once per Linear whose weight is a DTensor: :func:`refuse_tp_export`, first among its pre-hooks (only
    tensor-parallel Linears get it: a plain Linear's forward keeps its hook-free fast path). Called at conversion
    and when a DTensor weight is registered later (:meth:`fp8tensor.modules.Fp8LinearMixin.register_parameter`)."""
    if _is_dtensor(compat.parameters_dict(lin).get("weight")) and not getattr(lin, "_fp8_tp_export_hook", False):
        compat.prepend_forward_pre_hook(lin, refuse_tp_export)
        lin._fp8_tp_export_hook = True


def add_model_export_hook(module: nn.Module) -> None:
    """Once per converted model: :func:`refuse_tp_export` first among the pre-hooks of the model itself, so that
    ``torch.export.export(model)`` of a model parallelized before or after the conversion fails with fp8tensor's
    error before any hook of a parallel style (on the model's submodules, Linears or not) runs. Outside
    ``torch.export`` the hook only asks :func:`fp8tensor.compat.is_exporting`, once per forward of the model."""
    if not getattr(module, "_fp8_model_export_hook", False):
        compat.prepend_forward_pre_hook(module, refuse_tp_export)
        module._fp8_model_export_hook = True
