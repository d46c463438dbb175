"""``torch.export`` of tensor-parallel fp8 models (which it cannot trace) refused early by a forward pre-hook, first
among the hooks of the model and of each TP fp8 module, raising an error naming the remedy (docs/serving.md)."""
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


@compat.eager_unless_inlined  # (a hook torch.nn's eager module call runs: no compiled frame of its own)
def refuse_tp_export(module: nn.Module, args):
    """The forward pre-hook: under ``torch.export``, raise ``NotImplementedError``
    (:func:`fp8tensor.linear.tp_export_message`) when ``module`` or a submodule is a tensor-parallel fp8 module."""
    if not compat.is_exporting():
        return
    for name, m in module.named_modules():
        if tp_fp8_module(m):
            where = f"{type(m).__name__}" + (f" {name!r}" if name else "")
            raise NotImplementedError(tp_export_message(f"fp8tensor ({where})"))


def add_tp_export_hook(lin: nn.Module) -> None:
    """Once per Linear whose weight is a DTensor: :func:`refuse_tp_export` first among its pre-hooks."""
    if _is_dtensor(compat.parameters_dict(lin).get("weight")) and not getattr(lin, "_fp8_tp_export_hook", False):
        compat.prepend_forward_pre_hook(lin, refuse_tp_export)
        lin._fp8_tp_export_hook = True


def add_model_export_hook(module: nn.Module) -> None:
    """Once per converted model: :func:`refuse_tp_export` first among the model's own pre-hooks."""
    if not getattr(module, "_fp8_model_export_hook", False):
        compat.prepend_forward_pre_hook(module, refuse_tp_export)
        module._fp8_model_export_hook = True
