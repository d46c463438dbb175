"""fp8 training recipes: which GEMM of an fp8 Linear runs in fp8, in which format, with which accumulation.

Recipes (every GEMM operand is scaled along the GEMM's contraction dim, so scales factor out of the sum):

=================  ===============================  ===============================  ===============================
recipe             output ``y = x W^T``             grad_input ``gx = gy W``         grad_weight ``gW = gy^T x``
=================  ===============================  ===============================  ===============================
``rowwise``        e4m3; x per token (over K),       e4m3; gy per token (over N),     e4m3; gy^T per output feature
                   W per output row (over K);        W per input column (over N,      (over tokens), x per input
                   fast accumulation                 re-quantized from the master);   feature (over tokens);
                                                     slow accumulation                slow accumulation
``rowwise_gw_hp``  as ``rowwise``                   as ``rowwise``                   high precision (no fp8)
=================  ===============================  ===============================  ===============================

The autograd function that runs them is :mod:`fp8tensor.linear`; the master weight :mod:`fp8tensor.master`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .quantize import E4M3, E5M2

__all__ = ["Recipe", "RECIPES", "get_recipe"]


@dataclass(frozen=True)
class Recipe:
    """An fp8 training recipe.

    Attributes:
        name: ``"rowwise"`` or ``"rowwise_gw_hp"``.
        grad_weight_fp8: run the grad_weight GEMM in fp8 (True) or in high precision (False).
        fast_accum_forward: fp8 fast accumulation for the output GEMM.
        fast_accum_backward: fp8 fast accumulation for the gradient GEMMs.
        float8_dtype: fp8 format of the *weight side* of every fp8 GEMM: the weight in the output and grad_input
            GEMMs (and FSDP2's fp8 all-gather of it), the saved input in the grad_weight GEMM. The other operand
            (activations, grad_out) is always e4m3, so every GEMM is e4m3 × ``float8_dtype`` — the combinations
            ``torch._scaled_mm`` runs (it has no e5m2 × e5m2 GEMM). ``torch.float8_e4m3fn`` (default) or
            ``torch.float8_e5m2``.

    Raises:
        ValueError: ``float8_dtype`` is not an fp8 format.
    """

    name: str
    grad_weight_fp8: bool
    fast_accum_forward: bool = True
    fast_accum_backward: bool = False
    float8_dtype: torch.dtype = E4M3

    def __post_init__(self):
        if self.float8_dtype not in (E4M3, E5M2):
            raise ValueError(f"fp8tensor Recipe {self.name!r}: float8_dtype must be torch.float8_e4m3fn or "
                             f"torch.float8_e5m2, got {self.float8_dtype}")


RECIPES = {
    "rowwise": Recipe("rowwise", grad_weight_fp8=True),
    "rowwise_gw_hp": Recipe("rowwise_gw_hp", grad_weight_fp8=False),
}


def get_recipe(recipe) -> Recipe:
    """Look up a recipe by name (or pass a :class:`Recipe` through).

    Raises:
        ValueError: unknown recipe name.
    """
    if isinstance(recipe, Recipe):
        return recipe
    if recipe not in RECIPES:
        raise ValueError(f"fp8tensor: unknown recipe {recipe!r}; expected one of {sorted(RECIPES)}")
    return RECIPES[recipe]
