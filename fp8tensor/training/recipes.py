"""fp8 training recipes: which GEMM of an fp8 Linear runs in fp8, in which format, with which accumulation
(docs/recipes.md), and the size rule (docs/design.md, "Size-aware conversion")."""
from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import Optional

import torch

from ..numerics.quantize import E4M3, E5M2
from ..core.settings import get_config

__all__ = ["Recipe", "Gemm", "Operand", "SCALINGS", "RECIPES", "get_recipe", "weight_format", "fp8_size_rule",
           "fp8_size_choice"]


#: Operand scalings a recipe can name: ``"rowwise"`` (one float32 scale per slice along the GEMM's contraction dim)
#: or ``"hp"`` (high precision).
SCALINGS = ("rowwise", "hp")


@dataclass(frozen=True)
class Operand:
    """How one GEMM operand is prepared: ``scaling`` (one of :data:`SCALINGS`) and ``float8_dtype``
    (``torch.float8_e4m3fn``, default, or ``torch.float8_e5m2``; ignored for ``"hp"``). Raises ``ValueError``: unknown
    scaling (``"tensorwise"`` included, with the reason) or a non-fp8 ``float8_dtype``."""

    scaling: str = "rowwise"
    float8_dtype: torch.dtype = E4M3

    def __post_init__(self):
        if self.scaling not in SCALINGS:
            why = (" (tensor-wise scaling is not offered: row-wise runs as fast on Hopper and is more accurate)"
                   if self.scaling == "tensorwise" else "")
            raise ValueError(f"fp8tensor Operand: scaling must be one of {SCALINGS}, got {self.scaling!r}{why}")
        if self.float8_dtype not in (E4M3, E5M2):
            raise ValueError("fp8tensor Operand: float8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got "
                             f"{self.float8_dtype}")


@dataclass(frozen=True)
class Gemm:
    """One of the fp8 Linear's three GEMMs ``a @ b``: ``a`` the activation side (``x``, ``grad_out``, ``grad_out^T``),
    ``b`` the weight side (``W^T``, ``W``, and the saved ``x`` for grad_weight).

    Attributes:
        a, b: :class:`Operand` s (a string is read as ``Operand(that scaling)``), both ``"rowwise"`` or both
            ``"hp"``; ``a`` is e4m3 (``torch._scaled_mm`` takes e5m2 on one side only: the weight side).
        fast_accum: fp8 fast accumulation (``torch._scaled_mm(use_fast_accum=True)``).

    Raises ``TypeError`` (``a`` or ``b`` neither an :class:`Operand` nor a string) or ``ValueError`` (mixed
    scalings, an unknown scaling, an e5m2 activation side).
    """

    a: Operand = Operand()
    b: Operand = Operand()
    fast_accum: bool = False

    def __post_init__(self):
        for side in ("a", "b"):
            v = getattr(self, side)
            if isinstance(v, str):
                object.__setattr__(self, side, Operand(v))
            elif not isinstance(v, Operand):
                raise TypeError(f"fp8tensor Gemm: {side} must be an Operand (or its scaling as a string, one of "
                                f"{SCALINGS}), got {v!r}")
        if self.a.scaling != self.b.scaling:
            raise ValueError(f"fp8tensor Gemm: both operands are fp8 or both high precision, got a={self.a.scaling!r}"
                             f" and b={self.b.scaling!r}")
        if self.fp8 and self.a.float8_dtype != E4M3:
            raise ValueError("fp8tensor Gemm: the activation side (a) is e4m3 (torch._scaled_mm takes e5m2 on one "
                             "side only, the weight side b)")
        if not isinstance(self.fast_accum, bool):
            raise ValueError(f"fp8tensor Gemm: fast_accum must be True or False, got {self.fast_accum!r}")

    @property
    def fp8(self) -> bool:
        """Whether this GEMM runs in fp8."""
        return self.a.scaling != "hp"


_HP = Operand("hp")


@dataclass(frozen=True)
class Recipe:
    """An fp8 training recipe: what each of the fp8 Linear's three GEMMs does, as data (:data:`RECIPES`: the named
    ones). Stored on each converted Linear (``module.fp8_recipe``).

    Attributes:
        name: a label (``"rowwise"``, ``"rowwise_gw_hp"``, or your own).
        output: :class:`Gemm` of ``y = x @ W^T`` (default fp8, fast accumulation).
        grad_input: :class:`Gemm` of ``grad_x = grad_out @ W`` (default fp8, slow accumulation).
        grad_weight: :class:`Gemm` of ``grad_W = grad_out^T @ x`` (default fp8, slow accumulation).
        grouped_fast_accum: the backward GEMMs of :func:`fp8tensor.fp8_grouped_mm` (the experts' grad_input and
            grad_weight) accumulate fast (default True); ``False``: they follow ``grad_input`` and ``grad_weight`` as
            the Linear's do. ``torch._scaled_grouped_mm``'s slow accumulation is the slow part of the experts'
            backward at fine-grained expert shapes, and fast accumulation changed the gradients' relative error
            against float64 (0.037, the fp8 error) by at most 1e-5 (docs/moe.md).

    Raises ``TypeError`` (``name`` not a string, a GEMM not a :class:`Gemm`) or ``ValueError`` (the weight sides of
    the output and grad_input GEMMs differ in fp8 format; ``grouped_fast_accum`` not a bool).
    """

    name: str
    output: Gemm = Gemm(fast_accum=True)
    grad_input: Gemm = Gemm()
    grad_weight: Gemm = Gemm()
    grouped_fast_accum: bool = True  # (also a class attribute: a Recipe pickled before this field reads True)

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"fp8tensor Recipe: name must be a string, got {self.name!r}")
        if not isinstance(self.grouped_fast_accum, bool):
            raise ValueError(f"fp8tensor Recipe {self.name!r}: grouped_fast_accum must be True or False, got "
                             f"{self.grouped_fast_accum!r}")
        for field in ("output", "grad_input", "grad_weight"):
            if not isinstance(getattr(self, field), Gemm):
                raise TypeError(f"fp8tensor Recipe {self.name!r}: {field} must be a Gemm (e.g. Gemm(fast_accum=True) "
                                f"or Gemm('hp', 'hp')), got {getattr(self, field)!r}")
        if self.output.fp8 and self.grad_input.fp8 and self.output.b.float8_dtype != self.grad_input.b.float8_dtype:
            raise ValueError(f"fp8tensor Recipe {self.name!r}: the output and grad_input GEMMs quantize the one "
                             "weight, so their weight sides (b) have one fp8 format")

    # The fields the Linear, the grouped GEMM and FSDP2's payload read, derived from the GEMMs:
    @property
    def float8_dtype(self) -> torch.dtype:
        """The weight's fp8 format (the weight side of the output GEMM; FSDP2's fp8 all-gather sends it)."""
        return self.output.b.float8_dtype if self.output.fp8 else self.grad_input.b.float8_dtype

    @property
    def grad_weight_fp8(self) -> bool:
        return self.grad_weight.fp8

    @property
    def fast_accum_forward(self) -> bool:
        return self.output.fast_accum

    @property
    def fast_accum_backward(self) -> bool:
        return self.grad_input.fast_accum

    def replace(self, **changes) -> "Recipe":
        """A copy with some fields changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


def weight_format(recipe, float8_dtype: torch.dtype) -> "Recipe":
    """``recipe`` (a :class:`Recipe` or a name) with every fp8 weight side (and the saved input of an fp8 grad_weight)
    in ``float8_dtype`` (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``). Raises ``ValueError``: unknown recipe
    name, or ``float8_dtype`` not an fp8 format."""
    recipe = get_recipe(recipe)
    Operand("rowwise", float8_dtype)  # (validates the format even where no GEMM of the recipe is fp8)

    def b(g: Gemm) -> Gemm:
        return dataclasses.replace(g, b=Operand(g.b.scaling, float8_dtype)) if g.fp8 else g
    return dataclasses.replace(recipe, output=b(recipe.output), grad_input=b(recipe.grad_input),
                               grad_weight=b(recipe.grad_weight))


#: The named recipes (read-only; pass a :class:`Recipe` itself for any other).
RECIPES = types.MappingProxyType({
    "rowwise": Recipe("rowwise"),
    "rowwise_gw_hp": Recipe("rowwise_gw_hp", grad_weight=Gemm(_HP, _HP)),
})


def get_recipe(recipe) -> Recipe:
    """Look up a recipe by name (or pass a :class:`Recipe` through). Raises ``TypeError`` (neither a name nor a
    :class:`Recipe`) or ``ValueError`` (unknown name)."""
    if isinstance(recipe, Recipe):
        return recipe
    if not isinstance(recipe, str):
        raise TypeError(f"fp8tensor: a recipe is a name ({sorted(RECIPES)}) or a Recipe, got {recipe!r}")
    if recipe not in RECIPES:
        raise ValueError(f"fp8tensor: unknown recipe {recipe!r}; expected one of {sorted(RECIPES)}")
    return RECIPES[recipe]


# ---------------------------------------------------------------------------------------------- the size rule
def fp8_size_rule(in_features: int, out_features: int) -> bool:
    """Whether a Linear of this size is expected to train faster in fp8 than in high precision (row-wise recipes):
    True to convert, False to keep it in high precision.

    fp8 saves time in proportion to ``K * N`` and quantizing costs in proportion to ``K + N``, so the rule converts
    a Linear when ``K * N / (K + N) >= size_rule_min`` (:class:`fp8tensor.Config`, default 640, measured on H200
    with ``benchmarks/linear.py --size-rule``; docs/design.md, "Size-aware conversion").

    Args:
        in_features: ``K``, the Linear's input features; out_features: ``N``, its output features.
    """
    K, N = int(in_features), int(out_features)
    if K <= 0 or N <= 0:
        return False
    return K * N >= get_config().size_rule_min * (K + N)


def fp8_size_choice(in_features: int, out_features: int, recipe="rowwise") -> Optional[Recipe]:
    """The size-aware choice for one Linear: the :class:`Recipe` it is converted with, or None to keep it in high
    precision.

    None if :func:`fp8_size_rule` says so; for a recipe with an fp8 grad_weight and ``K * N / (K + N) <
    size_rule_fp8_grad_weight_min`` (default 1024), that recipe with grad_weight in high precision, named
    ``rowwise_gw_hp`` (docs/design.md, "Size-aware conversion"); else ``recipe`` (a name or :class:`Recipe`) itself.
    Raises ``ValueError``: unknown recipe.
    """
    r = get_recipe(recipe)
    if not fp8_size_rule(in_features, out_features):
        return None
    K, N = int(in_features), int(out_features)
    if r.grad_weight_fp8 and K * N < get_config().size_rule_fp8_grad_weight_min * (K + N):
        hp = get_recipe("rowwise_gw_hp")
        mid = dataclasses.replace(r, name=hp.name, grad_weight=Gemm(_HP, _HP))
        return hp if mid == hp else mid
    return r
