"""fp8 training: high-precision master weights quantized on use, and the fp8 Linear autograd function.

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

When the weight is already fp8 (a frozen :class:`ScaledFp8Tensor`, or the fp8 weight FSDP2 all-gathered), grad_input
uses *scale folding* instead of re-quantizing W: ``gy @ (diag(s) W8) = (gy diag(s)) @ W8``.

The mechanism is an ``autograd.Function`` (:func:`fp8_linear`) that receives the input and the weight as they come —
plain tensors or DTensors — and only calls tensor ops (``reshape``, ``t``, ``mm``) plus :func:`map_local` for
quantization. DTensor's own sharding rules place the GEMMs; each rank quantizes its own shard. No placement is ever
inspected here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map_only

from .gemm import fp8_mm, quantize_operand
from .quantize import E4M3, quantize_rowwise
from .tensor import ScaledFp8Tensor, _is_dtensor, map_local

__all__ = ["Recipe", "RECIPES", "get_recipe", "Fp8MasterWeight", "fp8_linear"]


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


# ---------------------------------------------------------------------------------------------- quantization
def _quantize_local(t: torch.Tensor, dim: int, fast_accum: bool, float8_dtype=E4M3) -> torch.Tensor:
    """Quantize a plain tensor or a master weight along ``dim`` into a ScaledFp8Tensor.

    A ScaledFp8Tensor is returned as is (only its fast-accumulation flag set): it is never re-quantized, and
    :func:`fp8tensor.gemm.fp8_mm` folds its scale when it lies on the contraction dim."""
    if isinstance(t, ScaledFp8Tensor):
        return t.with_fast_accum(fast_accum)
    if isinstance(t, Fp8MasterWeight):
        t = t._data
    if t.dim() == 2:
        q, s = quantize_operand(t, dim, float8_dtype)  # fused kernel + GEMM layout where it applies
    else:
        q, s = quantize_rowwise(t, dim=dim, float8_dtype=float8_dtype)
    return ScaledFp8Tensor(q, s, t.dtype, fast_accum)


def _quantize(t: torch.Tensor, dim: int, fast_accum: bool, float8_dtype=E4M3) -> torch.Tensor:
    """:func:`_quantize_local` on a tensor or on each DTensor shard (sub-row-wise when ``dim`` is sharded)."""
    return map_local(t, lambda lt: _quantize_local(lt, dim, fast_accum, float8_dtype))


def _dequantize(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return map_local(t, lambda lt: lt.to_hp(dtype) if isinstance(lt, ScaledFp8Tensor) else lt)


def _is_fp8(t: torch.Tensor) -> bool:
    local = t.to_local() if _is_dtensor(t) else t
    shards = getattr(local, "_local_tensors", None)  # LocalTensorMode: one tensor per simulated rank
    if isinstance(shards, dict) and shards:
        local = next(iter(shards.values()))
    return isinstance(local, ScaledFp8Tensor)


class _Fp8Linear(torch.autograd.Function):
    """``y = x @ W^T + b`` with all GEMMs in fp8 per the recipe; see the module docstring."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Recipe):
        K = x.shape[-1]
        N = weight.shape[0]
        x2 = x.reshape(-1, K)
        w8 = _quantize(weight, -1, recipe.fast_accum_forward, recipe.float8_dtype)
        out = torch.mm(x2, w8.t())
        if bias is not None:
            out = out + bias
        ctx.recipe = recipe
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        # Not a view of ``out`` (as F.linear's output is not): FSDP2 hooks the module output for backward, and an
        # in-place op on a view output would drop that hook (torch warns about it).
        return torch.ops.aten._unsafe_view(out, (*x.shape[:-1], N))

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        recipe: Recipe = ctx.recipe
        K = x.shape[-1]
        N = weight.shape[0]
        g2 = grad_out.reshape(-1, N)
        fast = recipe.fast_accum_backward
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            if _is_fp8(weight):
                # Scale folding: W8 is scaled along N, the contraction dim of gy @ W; fp8_mm folds it into gy.
                w_b = _quantize(weight, -1, fast)
            else:
                # Re-quantize the master along N (per input column) for this GEMM.
                w_b = _quantize(weight, 0, fast, recipe.float8_dtype)
            grad_x = torch.mm(g2, w_b).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, K)
            if recipe.grad_weight_fp8 and _is_fp8(x2):
                # x arrived in fp8 scaled per token (fp8 sequence-parallel all-gather): its scales lie on the
                # contraction dim of gy^T @ x, so fp8_mm folds them into gy^T (no re-quantization of x).
                grad_w = torch.mm(g2.t(), _quantize(x2, 0, fast))
            elif recipe.grad_weight_fp8:
                # x per input feature over tokens; gy^T (N, M) is quantized per output feature over tokens by
                # fp8_mm itself. Nothing derived from grad_out goes through map_local: under torch.compile the
                # backward of an autograd.Function is traced with grad placements guessed from the forward output
                # (Partial), which need not be the runtime ones (Replicate).
                x8 = _quantize(x2, 0, fast, recipe.float8_dtype)
                grad_w = torch.mm(g2.t(), x8)
            else:
                grad_w = torch.mm(g2.t(), _dequantize(x2, g2.dtype))
            grad_w = grad_w.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b, None


def fp8_linear(
    input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *, recipe="rowwise"
) -> torch.Tensor:
    """fp8 ``F.linear``: ``input @ weight.T + bias`` with the output, grad_input and grad_weight GEMMs in fp8.

    Args:
        input: ``(*, K)`` floating-point tensor (plain or DTensor).
        weight: ``(N, K)`` high-precision tensor, :class:`Fp8MasterWeight`, :class:`ScaledFp8Tensor`, or a
            DTensor of any of these.
        bias: optional ``(N,)`` tensor.
        recipe: ``"rowwise"`` (default), ``"rowwise_gw_hp"`` or a :class:`Recipe`.

    Returns:
        ``(*, N)`` tensor in ``input``'s dtype.

    Raises:
        ValueError: unknown recipe.
        RuntimeError: ``input.shape[-1] != weight.shape[1]``, or ``weight`` is not 2-D.
    """
    r = get_recipe(recipe)
    if weight.dim() != 2:
        raise RuntimeError(f"fp8_linear: weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
    if input.dim() < 1 or input.shape[-1] != weight.shape[1]:
        raise RuntimeError(
            f"fp8_linear: input's last dim {tuple(input.shape)[-1:]} does not match weight's in_features "
            f"{weight.shape[1]} (weight shape {tuple(weight.shape)})"
        )
    return _Fp8Linear.apply(input, weight, bias, r)


# ---------------------------------------------------------------------------------------------- master weight
_PRESERVE = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten.t.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.select.int,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default,
    torch.ops.aten.cat.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten._to_copy.default,
}


class Fp8MasterWeight(torch.Tensor):
    """A high-precision master weight that is quantized to fp8 on use.

    For everything except matmuls it behaves as the plain tensor ``_data`` it wraps (same shape, dtype and
    device): optimizers (SGD, AdamW foreach/fused) update ``_data`` in place, ``torch.nn.init`` functions,
    ``.to()``, gradient clipping and ``zero_grad`` work; gradients are plain tensors. Layout ops keep the
    wrapper (so DTensor sharding and FSDP2 keep it as the local tensor); other ops return plain tensors.

    ``F.linear(x, w)`` on a master weight runs :func:`fp8_linear` with the weight's recipe. A module converted
    with :func:`fp8tensor.convert_to_fp8` always routes through :func:`fp8_linear`, also when the weight is a
    DTensor. With FSDP2, the master quantizes its local rows before the all-gather (``fsdp_pre_all_gather``), so
    the forward sees a :class:`ScaledFp8Tensor` (see :mod:`fp8tensor.fsdp`).

    Args:
        data: the high-precision tensor (fp32/bf16/fp16). Not copied.
        recipe: recipe name or :class:`Recipe`.

    Raises:
        TypeError: ``data`` is not a floating-point tensor, or is fp8.
    """

    _data: torch.Tensor
    recipe: Recipe

    @staticmethod
    def __new__(cls, data: torch.Tensor, recipe="rowwise", requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
            layout=data.layout,
            requires_grad=requires_grad,
        )

    def __init__(self, data: torch.Tensor, recipe="rowwise", requires_grad: bool = False):
        if not isinstance(data, torch.Tensor) or not data.dtype.is_floating_point or data.dtype in (
            torch.float8_e4m3fn,
            torch.float8_e5m2,
        ):
            raise TypeError(f"Fp8MasterWeight: expected a high-precision floating-point tensor, got {getattr(data, 'dtype', type(data))}")
        if isinstance(data, Fp8MasterWeight):
            data = data._data
        self._data = data
        self.recipe = get_recipe(recipe)

    def __tensor_flatten__(self):
        return ["_data"], (self.recipe,)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Fp8MasterWeight(inner["_data"], ctx[0])

    def __repr__(self) -> str:
        return f"Fp8MasterWeight(recipe={self.recipe.name!r}, data={self._data!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if isinstance(weight, Fp8MasterWeight):
                inp = args[0] if args else kwargs["input"]
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                return fp8_linear(inp, weight, bias, recipe=weight.recipe)
        if func == torch._C.TensorBase.data.__set__ and isinstance(args[0], Fp8MasterWeight):
            # ``w.data = t`` (also how ``Module.to(dtype)`` converts parameters): replace the wrapped data too,
            # else the wrapper would report t's dtype while still computing with the old ``_data``.
            new = args[1] if isinstance(args[1], Fp8MasterWeight) else Fp8MasterWeight(args[1], args[0].recipe)
            with torch._C.DisableTorchFunctionSubclass():
                func(args[0], new)
            args[0]._data = new._data
            return None
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        masters = [a for a in _flat(args, kwargs) if isinstance(a, Fp8MasterWeight)]
        recipe = masters[0].recipe
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            return _master_mm(func, args, kwargs)
        u_args, u_kwargs = tree_map_only(Fp8MasterWeight, lambda t: t._data, (args, kwargs))
        out = func(*u_args, **u_kwargs)
        if func._schema.is_mutable:
            # In-place / out= ops (optimizer steps, copy_, init): the inner data was updated; return wrappers.
            inner_to_outer = {id(m._data): m for m in masters}
            return tree_map_only(torch.Tensor, lambda t: inner_to_outer.get(id(t), t), out)
        if func in _PRESERVE:
            return tree_map_only(
                torch.Tensor,
                lambda t: Fp8MasterWeight(t, recipe) if t.dtype.is_floating_point and t.dtype == masters[0].dtype else t,
                out,
            )
        return out

    # FSDP2 all-gather extension: quantize local rows, gather fp8 data + row scales.
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        from .fsdp import master_pre_all_gather

        return master_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        from .fsdp import post_all_gather

        return post_all_gather(self, all_gather_outputs, metadata, param_dtype, out=out)

    def __reduce_ex__(self, protocol):
        # Pickles as the plain high-precision tensor: a checkpoint never needs fp8tensor to load.
        return self._data.__reduce_ex__(protocol)


def _flat(args, kwargs):
    from torch.utils._pytree import tree_flatten

    return tree_flatten((args, kwargs))[0]


def _master_mm(func, args, kwargs):
    """A bare ``mm``/``addmm`` on a master weight (outside :func:`fp8_linear`): fp8 forward, quantizing the
    master along the contraction dim."""
    if func is torch.ops.aten.addmm.default:
        bias, a, b = args[0], args[1], args[2]
    else:
        bias, a, b = None, args[0], args[1]
    if isinstance(a, Fp8MasterWeight):
        a = _quantize_local(a._data, 1, True)
    if isinstance(b, Fp8MasterWeight):
        b = _quantize_local(b._data.t(), 1, True).t()
    if isinstance(bias, Fp8MasterWeight):
        bias = bias._data
    if func is torch.ops.aten.addmm.default:
        beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
        alpha = kwargs.get("alpha", args[4] if len(args) > 4 else 1)
        if not (beta == 1 and alpha == 1):
            return torch.addmm(bias, (a.to_hp() if isinstance(a, ScaledFp8Tensor) else a),
                               (b.to_hp() if isinstance(b, ScaledFp8Tensor) else b), beta=beta, alpha=alpha)
    return fp8_mm(a, b, bias, op=str(func))
