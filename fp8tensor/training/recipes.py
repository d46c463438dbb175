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

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from ..numerics.quantize import E4M3, E5M2
from ..core.settings import get_config

__all__ = ["Recipe", "RECIPES", "get_recipe", "fp8_size_rule", "fp8_size_choice"]


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


# ---------------------------------------------------------------------------------------------- the size rule
def fp8_size_rule(in_features: int, out_features: int) -> bool:
    """Whether a Linear of this size is expected to train faster in fp8 than in high precision (row-wise recipes).

    Per token, the fp8 GEMMs save time in proportion to ``K * N`` (their FLOPs) while the quantizations that feed them
    cost time in proportion to ``K + N`` (the bytes of ``x``, ``grad_out`` and the weight's rows they read and write);
    both grow linearly with the number of tokens, so their ratio depends on the shape only. The rule converts a Linear
    when ``K * N / (K + N) >= size_rule_min`` (a field of :class:`fp8tensor.Config`, default 640): ``2048 x 2048``
    (1024), ``2048 <-> 5632`` (1502), ``1024 <-> 4096`` (819) and anything larger are converted; ``1024 x 1024``
    (512), ``768 -> 3072`` (614) and small heads (``4096 -> 16``: 16) stay in high precision.

    The default threshold is measured on H200 (``benchmarks/linear.py --size-rule``: one Linear's forward + backward captured
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
      fp8 format, fast accumulation). Measured on H200 (``benchmarks/linear.py --size-rule``, ``docs/benchmarks.md``): at these sizes the per-token
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
