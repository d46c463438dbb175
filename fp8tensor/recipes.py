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

from .quantize import E4M3

__all__ = ["Recipe", "RECIPES", "get_recipe"]


@dataclass(frozen=True)
class Recipe:
    """An fp8 training recipe.

    Attributes:
        name: ``"rowwise"`` or ``"rowwise_gw_hp"``.
        grad_weight_fp8: run the grad_weight GEMM in fp8 (True) or in high precision (False).
        fast_accum_forward: fp8 fast accumulation for the output GEMM.
        fast_accum_backward: fp8 fast accumulation for the gradient GEMMs.
        float8_dtype: fp8 format of every operand.
    """

    name: str
    grad_weight_fp8: bool
    fast_accum_forward: bool = True
    fast_accum_backward: bool = False
    float8_dtype: torch.dtype = E4M3


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
