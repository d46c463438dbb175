"""The fp8 Linear: an ``autograd.Function`` running the output, grad_input and grad_weight GEMMs in fp8 per the
recipe (:mod:`fp8tensor.recipes`), and its functional form :func:`fp8_linear`.

When the weight is already fp8 (a frozen :class:`ScaledFp8Tensor`, or the fp8 weight FSDP2 all-gathered), grad_input
uses *scale folding* instead of re-quantizing W: ``gy @ (diag(s) W8) = (gy diag(s)) @ W8``.

The mechanism is an ``autograd.Function`` (:func:`fp8_linear`) that receives the input and the weight as they come —
plain tensors or DTensors — and only calls tensor ops (``reshape``, ``t``, ``mm``) plus :func:`map_local` for
quantization. DTensor's own sharding rules place the GEMMs; each rank quantizes its own shard. No placement is ever
inspected here.
"""
from __future__ import annotations

from typing import Optional

import torch

from .quantize import E4M3, quantize
from .recipes import Recipe, get_recipe
from .tensor import ScaledFp8Tensor, _is_dtensor, map_local

__all__ = ["QuantizeOnUse", "fp8_linear"]


class QuantizeOnUse:
    """Marker base of tensor subclasses that wrap a high-precision tensor ``_data`` which is quantized on each use
    (:class:`fp8tensor.master.Fp8MasterWeight`): the fp8 Linear quantizes ``_data`` itself."""

    _data: torch.Tensor


# ---------------------------------------------------------------------------------------------- quantization
def _quantize_local(t: torch.Tensor, dim: int, fast_accum: bool, float8_dtype=E4M3) -> torch.Tensor:
    """Quantize a plain tensor or a master weight along ``dim`` into a ScaledFp8Tensor.

    A ScaledFp8Tensor is returned as is (only its fast-accumulation flag set): it is never re-quantized, and
    :func:`fp8tensor.gemm.fp8_mm` folds its scale when it lies on the contraction dim."""
    if isinstance(t, ScaledFp8Tensor):
        return t.with_fast_accum(fast_accum)
    if isinstance(t, QuantizeOnUse):
        t = t._data
    q, s = quantize(t, dim, float8_dtype, gemm_layout=True)  # fused kernel + GEMM layout where it applies
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
