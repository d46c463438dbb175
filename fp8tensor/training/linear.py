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
import torch.autograd.forward_ad as _forward_ad

from ..core import compat
from ..subclass.gemm import _check_mm_args, scaled_mm
from ..numerics.cache import OPERANDS
from ..numerics.quantize import (E4M3, FLOAT8_DTYPES, quantize, quantize_dim0_t_after, quantize_rows_and_tokens,
                                 quantize_tokens, transpose_after, weight_only_mm)
from .recipes import Recipe, get_recipe
from ..core.settings import get_config, scope_token, swap_scope
from ..subclass.tensor import ScaledFp8Tensor, _is_dtensor, make_scaled, map_local, rowwise_dims

__all__ = ["QuantizeOnUse", "fp8_linear", "tp_export_message"]


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
    return make_scaled(q, s, t.dtype, fast_accum, rowwise_dims(t.dim(), dim))


def _quantize(t: torch.Tensor, dim: int, fast_accum: bool, float8_dtype=E4M3) -> torch.Tensor:
    """:func:`_quantize_local` on a tensor or on each DTensor shard (sub-row-wise when ``dim`` is sharded)."""
    return map_local(t, lambda lt: _quantize_local(lt, dim, fast_accum, float8_dtype))


def _dequantize(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (a tensor, ScaledFp8Tensor or DTensor of either) as a high-precision tensor of ``dtype``."""
    return map_local(t, lambda lt: lt.to_hp(dtype) if isinstance(lt, ScaledFp8Tensor) else lt.to(dtype))


def _is_fp8(t: torch.Tensor) -> bool:
    if _is_dtensor(t):  # (eager: the local tensor itself, without to_local's autograd Function)
        local = t.to_local() if compat.is_compiling() else compat.local_tensor(t)
    else:
        local = t
    shards = getattr(local, "_local_tensors", None)  # LocalTensorMode: one tensor per simulated rank
    if isinstance(shards, dict) and shards:
        local = next(iter(shards.values()))
    return isinstance(local, ScaledFp8Tensor)


# ---------------------------------------------------------------------------------------------- plain operands
#: Plain tensor types (what the eager plain-tensor path takes).
_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: High-precision dtypes the eager plain-tensor path takes (anything else goes to the general path, which names the
#: problem: integer, complex or fp8 operands).
_HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# ---------------------------------------------------------------------------------------------- saved for backward
#: ``scaled_dims`` of an input quantized over its tokens: one scale per feature.
_TOKEN_DIMS = rowwise_dims(2, 0)


def _tokens_fp8(t: torch.Tensor, t2: torch.Tensor, fast: bool, float8_dtype) -> torch.Tensor:
    """``t2 = t.reshape(-1, K)`` quantized per feature over the tokens (dim 0), as a ScaledFp8Tensor (or a DTensor of
    one). A plain CUDA ``t`` goes to the dim-0 kernels as it is (:func:`fp8tensor.quantize.quantize_tokens`: no view
    for inductor to write out once per kernel argument); same bits either way."""
    if not _is_dtensor(t) and not isinstance(t, ScaledFp8Tensor) and t.dim() >= 2:
        hit = quantize_tokens(t, float8_dtype)
        if hit is not None:
            return make_scaled(hit[0], hit[1], t.dtype, fast, rowwise_dims(2, 0))
    return _quantize(t2, 0, fast, float8_dtype)


def _x_for_grad_weight(x: torch.Tensor, x2: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """The grad_weight operand of the ``rowwise`` recipe, computed in forward: ``x2`` ``(M, K)`` quantized per input
    feature over the tokens (dim 0), as a ScaledFp8Tensor (or a DTensor of one). Backward would compute exactly this
    from the high-precision ``x``; saving it instead of ``x`` halves (bf16) or quarters (fp32) what the Linear keeps.

    An ``x2`` that is already fp8 scaled per token (fp8 sequence-parallel all-gather) is kept as it is: ``fp8_mm``
    folds its token scales into ``gy^T``."""
    fast = recipe.fast_accum_backward
    plain = type(x2) in _PLAIN  # (a plain tensor is never fp8: no _is_fp8 / map_local round trip)
    if not plain and _is_fp8(x2):
        return _quantize(x2, 0, fast)
    if compat.is_compiling() or x.is_inference():  # (inference tensors have no version counter)
        return _tokens_fp8(x, x2, fast, recipe.float8_dtype)

    def make():
        if plain and type(x) in _PLAIN:  # _tokens_fp8 of a plain tensor, without its DTensor / subclass checks
            hit = quantize_tokens(x, recipe.float8_dtype) if x.dim() >= 2 else None
            q, s = hit if hit is not None else quantize(x2, 0, recipe.float8_dtype, gemm_layout=True)
            return make_scaled(q, s, x2.dtype, fast, _TOKEN_DIMS)
        return _tokens_fp8(x, x2, fast, recipe.float8_dtype)

    # shared by the Linears reading ``x`` (q/k/v, w1/w3), as long as a backward holds it
    return OPERANDS.get(("x_tokens", recipe.float8_dtype, fast), x, make, weak=True)


def _x_rows(x: Optional[torch.Tensor], x2: torch.Tensor) -> tuple:
    """``x2`` (``x`` as ``(M, K)``) quantized row-wise in e4m3, shared with the previous Linear's forward when it read
    the same ``x`` (held in :data:`fp8tensor.numerics.cache.OPERANDS` until a backward starts)."""
    make = lambda: quantize(x2, 1, E4M3, gemm_layout=True)  # noqa: E731
    return make() if x is None else OPERANDS.get("x_rows", x, make)


def _weight_for_grad_input(weight: torch.Tensor, gy: torch.Tensor, fast: bool, recipe: Recipe) -> torch.Tensor:
    """The weight operand of ``grad_x = gy @ W``, made in backward after ``gy`` (``grad_out``, any shape: it is only an
    ordering input) exists (plain tensors; DTensor shards are prepared as they come).

    * fp8 weight scaled per row (the FSDP2-gathered weight, a frozen fp8 weight): scale folding, ``fp8_mm`` folds the
      row scales (on the contraction dim N) into ``gy``; the weight's column-major copy is made by
      :func:`fp8tensor.quantize.transpose_after`.
    * a master / high-precision weight: re-quantized along N (per input column),
      :func:`fp8tensor.quantize.quantize_dim0_t_after`."""
    if _is_fp8(weight):
        if (
            isinstance(weight, ScaledFp8Tensor)
            and weight.dim() == 2
            and weight.scale.shape[1] == 1
            and weight.qdata.stride(1) == 1
            and not _is_dtensor(gy)
        ):
            qt = transpose_after(weight.qdata, gy)
            return make_scaled(qt.t(), weight.scale, weight.orig_dtype, fast, weight.scaled_dims)
        return _quantize(weight, -1, fast)
    if not _is_dtensor(weight) and not _is_dtensor(gy):
        w = weight._data if isinstance(weight, QuantizeOnUse) else weight
        if w.dim() == 2 and w.dtype.is_floating_point:
            qt, st = quantize_dim0_t_after(w, gy, recipe.float8_dtype)
            return make_scaled(qt.t(), st.t(), w.dtype, fast, rowwise_dims(2, 0))
    return _quantize(weight, 0, fast, recipe.float8_dtype)


# ---------------------------------------------------------------------------------------------- eager plain path
# Eager Linears on plain tensors run through the ``*_parts`` functions below (the same quantizations
# and ``scaled_mm`` calls as the general path, on ``(qdata, scale)`` pairs: no transient ScaledFp8Tensors and no
# dispatch through ``fp8_mm``): less host time per Linear, measured on the host
# (``benchmarks/e2e.py --profile``). ``fp8tensor.config(eager_fast_path=False)``: always the general path
# (same bits).

def _eager_plain(t: torch.Tensor) -> bool:
    """``t`` is a plain tensor and nothing traces or intercepts ops (no compile, no dispatch or torch-function mode,
    autograd not recording), and the eager fast path is on (``fp8tensor.config(eager_fast_path=...)``): what the
    pairs path needs of the whole Linear."""
    return (
        not compat.is_compiling()  # first: dynamo folds it
        and type(t) in _PLAIN
        and not torch.is_grad_enabled()
        and not compat.dispatch_modes_active()
        and not compat.function_modes_active()
        and get_config().eager_fast_path
    )


def _rowwise_fp8_weight(weight: torch.Tensor) -> bool:
    """A 2-D ScaledFp8Tensor scaled per row (scale ``(N, 1)``, or one ``(1, 1)`` scale): the FSDP2-gathered or
    frozen fp8 weight the plain path takes."""
    return type(weight) is ScaledFp8Tensor and weight.dim() == 2 and weight.scale.shape[1] == 1 and \
        type(weight.qdata) is torch.Tensor


def _forward_parts(x2: torch.Tensor, weight: torch.Tensor, wd: torch.Tensor, recipe: Recipe,
                   x: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The output GEMM ``x2 @ W^T`` ``(M, N)`` of an eager Linear on plain tensors, or None where the general path
    must run (DTensors, subclasses other than the master / a row-scaled fp8 weight, tracing, modes). ``x``: the
    input ``x2`` is a view of (its row-wise operand may be shared between Linears, :func:`_x_rows`).

    Same bits as the general path: ``W`` quantized per row (a row-scaled fp8 weight used as it is), ``x2`` per row
    in e4m3 (what ``fp8_mm`` does with a high-precision operand), one ``scaled_mm`` with the forward's fast
    accumulation and the promoted dtype of ``x2`` and the weight."""
    if not (_eager_plain(x2) and x2.dtype in _HP_DTYPES):  # (other dtypes: the general path and its errors)
        return None
    if type(weight) is ScaledFp8Tensor:
        if not _rowwise_fp8_weight(weight):
            return None
        wq_t, ws_t, w_dtype = weight.qdata.t(), weight.scale.t(), weight.dtype
    elif type(wd) in _PLAIN and wd.dtype in _HP_DTYPES and (wd is weight or isinstance(weight, QuantizeOnUse)):
        q, s = quantize(wd, -1, recipe.float8_dtype, gemm_layout=True)
        wq_t, ws_t, w_dtype = q.t(), s.t(), wd.dtype
    else:
        return None
    _check_mm_args("aten.mm", x2, wq_t)
    xq, xs = _x_rows(x, x2)
    return scaled_mm(xq, xs, wq_t, ws_t, torch.promote_types(x2.dtype, w_dtype),
                     use_fast_accum=recipe.fast_accum_forward)


def _grad_input_parts(g2: torch.Tensor, grad_out: torch.Tensor, weight: torch.Tensor, recipe: Recipe,
                      a: Optional[tuple] = None) -> Optional[torch.Tensor]:
    """``grad_x = g2 @ W`` ``(M, K)`` of an eager Linear on plain tensors, or None (general path). Same bits as
    :func:`_weight_for_grad_input` + ``fp8_mm``: a high-precision weight quantized per input column after
    ``grad_out``; a row-scaled fp8 weight transposed after ``grad_out`` with its row scales folded into ``g2``.

    ``a``: ``g2``'s operand ``(q, scale)`` already quantized row-wise (with the fp8 weight's row scales folded in),
    from :func:`_grad_out_both`."""
    fast = recipe.fast_accum_backward
    if type(weight) is ScaledFp8Tensor:
        if not (_rowwise_fp8_weight(weight) and weight.qdata.stride(1) == 1):
            return None
        s = weight.scale
        b8 = transpose_after(weight.qdata, grad_out).t()
        out_dtype = torch.promote_types(g2.dtype, weight.dtype)
        if s.shape[0] != 1:  # scale folding, as fp8_mm: (g2 diag(s)) @ W8
            if a is None:
                g2 = g2.to(torch.float32) * s.reshape(1, -1)
            s = s.new_ones(1, b8.shape[1])
    else:
        w = weight._data if isinstance(weight, QuantizeOnUse) else weight
        if not (type(w) in _PLAIN and w.dim() == 2 and w.dtype.is_floating_point):
            return None
        qt, st = quantize_dim0_t_after(w, grad_out, recipe.float8_dtype)
        b8, s, out_dtype = qt.t(), st.t(), torch.promote_types(g2.dtype, w.dtype)
    a8, sa = a if a is not None else quantize(g2, 1, E4M3, gemm_layout=True)
    return scaled_mm(a8, sa, b8, s, out_dtype, use_fast_accum=fast)


def _grad_out_both(grad_out: torch.Tensor, weight: torch.Tensor, x_saved: torch.Tensor) -> Optional[tuple]:
    """``grad_out``'s two fp8 GEMM operands from two reads of it (:func:`fp8tensor.quantize.quantize_rows_and_tokens`)
    when an eager backward on plain tensors needs both (grad_input and an fp8 grad_weight) and the parts functions take
    the weight and the saved input, and the weight is row-scaled fp8 (its scales folded in by the pass: the one case
    where it measured faster, ``benchmarks/linear.py --quant``), unless ``fp8tensor.config(fused_grad_out="never")``;
    else None (each quantized on its own, same bits).

    Returns:
        ``((a8, sa), (gt8, sgt))``: the grad_input operand ``g2`` (times the fp8 weight's row scales, when it has them)
        quantized row-wise, and the grad_weight operand quantized per output feature over the tokens."""
    if not (get_config().fused_grad_out == "eager" and _saved_tokens_fp8(x_saved)
            and grad_out.shape[-1] > 1):  # (N == 1: the separate path quantizes g2 with the dim-0 kernels)
        return None
    col_mul = None
    if type(weight) is ScaledFp8Tensor:
        if not (_rowwise_fp8_weight(weight) and weight.qdata.stride(1) == 1):
            return None
        if weight.scale.shape[0] != 1:
            col_mul = weight.scale.reshape(-1)
    else:
        w = weight._data if isinstance(weight, QuantizeOnUse) else weight
        if not (type(w) in _PLAIN and w.dim() == 2 and w.dtype.is_floating_point):
            return None
    if col_mul is None:  # (slower than the separate kernels without scales to fold)
        return None
    return quantize_rows_and_tokens(grad_out, E4M3, col_mul=col_mul)


def _saved_tokens_fp8(x_saved) -> bool:
    """The saved input is the plain-path grad_weight operand: a 2-D ScaledFp8Tensor scaled per input feature."""
    return (type(x_saved) is ScaledFp8Tensor and x_saved.dim() == 2 and x_saved.scale.shape[0] == 1
            and type(x_saved.qdata) is torch.Tensor)


def _grad_weight_parts(g2: torch.Tensor, grad_out: torch.Tensor, x_saved: torch.Tensor, recipe: Recipe,
                       gt: Optional[tuple] = None) -> Optional[torch.Tensor]:
    """``grad_w = g2^T @ x`` ``(N, K)`` of the ``rowwise`` recipe on plain tensors, from the saved fp8 ``x`` (scaled
    per input feature), or None (general path). Same bits as the general path: ``grad_out`` quantized per output
    feature over the tokens (the dim-0 kernels, else ``fp8_mm``'s quantization of ``g2^T``).

    ``gt``: that operand already computed, ``(q, scale)`` as :func:`fp8tensor.quantize.quantize_tokens` returns it
    (from :func:`_grad_out_both`)."""
    if not _saved_tokens_fp8(x_saved):
        return None
    hit = gt if gt is not None else (quantize_tokens(grad_out, E4M3) if grad_out.dim() >= 2 else None)
    if hit is not None:
        a8, sa = hit[0].t(), hit[1].t()
    else:
        a8, sa = quantize(g2.t(), 1, E4M3, gemm_layout=True)
    return scaled_mm(a8, sa, x_saved.qdata, x_saved.scale, torch.promote_types(grad_out.dtype, x_saved.dtype),
                     use_fast_accum=recipe.fast_accum_backward and x_saved.fast_accum)


class _Fp8Linear(torch.autograd.Function):
    """``y = x @ W^T + b`` with all GEMMs in fp8 per the recipe; see the module docstring.

    Saved for backward (the minimum each gradient needs; bit-identical gradients to quantizing in backward):

    * for grad_weight (only when the weight requires grad): ``rowwise``: ``x`` already quantized per input feature over
      the tokens (fp8 + one float32 per feature), shared by the Linears that consume the same input;
      ``rowwise_gw_hp``: ``x`` in high precision;
    * for grad_input (only when ``x`` requires grad): the weight as the forward received it (the master, or the fp8
      weight FSDP2 gathered; no quantized copy of it);
    * shapes and dtypes (no tensors)."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Recipe):
        wd = weight._data if isinstance(weight, QuantizeOnUse) else weight  # shape / dtype without torch_function
        N = wd.shape[0]
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (a reshape to itself still costs a DTensor dispatch)
        out = _forward_parts(x2, weight, wd, recipe, x)
        if out is None:  # the subclass path: torch.mm of the quantized operands (DTensor, compile, export, modes)
            out = torch.mm(x2, _quantize(weight, -1, recipe.fast_accum_forward, recipe.float8_dtype).t())
        if bias is not None:
            out = out + bias
        ctx.recipe = recipe
        ctx.has_bias = bias is not None
        ctx.x_shape = x.shape
        ctx.n_out = N
        ctx.w_dtype = wd.dtype
        # the settings in force now are the ones the backward runs under (it may run in another thread)
        ctx.settings = None if compat.is_compiling() else scope_token()
        x_saved = None
        if ctx.needs_input_grad[1]:
            x_saved = _x_for_grad_weight(x, x2, recipe) if recipe.grad_weight_fp8 else x
        ctx.save_for_backward(x_saved, weight if ctx.needs_input_grad[0] else None)
        # Not a view of ``out`` (as F.linear's output is not): FSDP2 hooks the module output for backward, and an
        # in-place op on a view output would drop that hook (torch warns about it).
        if x.dim() == 2 and not compat.is_compiling() and not out._is_view():  # already (M, N), no view
            return out
        return torch.ops.aten._unsafe_view(out, (*x.shape[:-1], N))

    @staticmethod
    def backward(ctx, grad_out):
        if compat.is_compiling():
            return _backward(ctx, grad_out)
        prev = swap_scope(ctx.settings)
        try:
            return _backward(ctx, grad_out)
        finally:
            swap_scope(prev)


def _backward(ctx, grad_out):
    """:meth:`_Fp8Linear.backward` under the settings of its forward."""
    if torch.is_grad_enabled() and not compat.is_compiling():
        # create_graph=True: the GEMM operands below are quantized copies with no autograd link to the weight
        # (and _scaled_mm has no derivative), so a graph recorded here would silently drop terms.
        raise NotImplementedError(
            "fp8_linear: double backward (create_graph=True, e.g. a gradient penalty) is not supported: the fp8 "
            "gradient GEMMs are not differentiable. Leave this Linear in high precision (convert_to_fp8's "
            "module_filter_fn) or compute that loss without create_graph"
        )
    x_saved, weight = ctx.saved_tensors
    recipe: Recipe = ctx.recipe
    if not compat.is_compiling():  # the forward is over: no input's row-wise operand is needed again
        OPERANDS.clear("x_rows")
    g2 = grad_out if grad_out.dim() == 2 else grad_out.reshape(-1, ctx.n_out)
    fast = recipe.fast_accum_backward
    grad_x = grad_w = grad_b = None
    parts = _eager_plain(grad_out)  # the (fp8 data, scale) pairs path, else the subclass path
    both = None  # grad_out's two fp8 operands from one fused pass, when both GEMMs need them
    if parts and ctx.needs_input_grad[0] and ctx.needs_input_grad[1] and recipe.grad_weight_fp8:
        both = _grad_out_both(grad_out, weight, x_saved)
    if ctx.needs_input_grad[0]:
        grad_x = _grad_input_parts(g2, grad_out, weight, recipe, both and both[0]) if parts else None
        if grad_x is None:
            # ``grad_out`` itself (not its reshape) orders the weight operand after it: see fp8tensor.quantize.transpose_after
            grad_x = torch.mm(g2, _weight_for_grad_input(weight, grad_out, fast, recipe))
        if grad_x.shape != ctx.x_shape:
            grad_x = grad_x.reshape(ctx.x_shape)
    if ctx.needs_input_grad[1]:
        grad_w = (_grad_weight_parts(g2, grad_out, x_saved, recipe, both and both[1])
                  if parts and recipe.grad_weight_fp8 else None)
        if grad_w is None and recipe.grad_weight_fp8:
            # gy^T (N, M) quantized per output feature over the tokens: from grad_out itself on CUDA (as x in
            # forward, see _tokens_fp8), else by fp8_mm; the same bits. Nothing derived from grad_out goes through
            # map_local: under torch.compile the backward of an autograd.Function is traced with grad placements
            # guessed from the forward output (Partial), which need not be the runtime ones.
            gt = g2.t()
            hit = quantize_tokens(grad_out, E4M3) if not _is_dtensor(grad_out) and grad_out.dim() >= 2 else None
            if hit is not None:  # q (N, M) row-major, scale (N, 1): fp8_mm uses them as they are
                gt = make_scaled(hit[0].t(), hit[1].t(), grad_out.dtype, fast, rowwise_dims(2, 1))
            grad_w = torch.mm(gt, x_saved)
        elif grad_w is None:
            x2 = x_saved.reshape(-1, ctx.x_shape[-1])
            grad_w = torch.mm(g2.t(), _dequantize(x2, g2.dtype))
        grad_w = grad_w.to(ctx.w_dtype)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = g2.sum(0)
    return grad_x, grad_w, grad_b, None


def fp8_linear(
    input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *, recipe="rowwise"
) -> torch.Tensor:
    """fp8 ``F.linear``: ``input @ weight.T + bias`` with the output, grad_input and grad_weight GEMMs in fp8.

    Under ``torch.autocast`` (on ``input``'s device type) the operands are cast to the autocast dtype first, as
    autocast does for ``F.linear`` (``weight.to(dtype)`` of a master weight is a master of that dtype, its gradient
    flows back to the high-precision master; of an fp8 weight it only changes the output dtype), and the fp8 Linear
    runs with autocast off inside.

    Args:
        input: ``(*, K)`` floating-point tensor (plain or DTensor).
        weight: ``(N, K)`` high-precision tensor, :class:`Fp8MasterWeight`, :class:`ScaledFp8Tensor`, or a
            DTensor of any of these.
        bias: optional ``(N,)`` tensor.
        recipe: ``"rowwise"`` (default), ``"rowwise_gw_hp"`` or a :class:`Recipe`.

    Returns:
        ``(*, N)`` tensor of the promoted dtype of ``input`` and ``weight`` (their common dtype in the usual case of
        one dtype; under autocast the autocast dtype).

    Raises:
        ValueError: unknown recipe.
        TypeError: ``input`` or ``weight`` is a plain float8 tensor (no scales to read it by).
        NotImplementedError: called under a ``torch.func`` transform (``grad``, ``vmap``, ...) or with a
            forward-mode AD tangent, which this ``autograd.Function`` does not support; also, raised by the backward,
            double backward (``create_graph=True``).
        RuntimeError: ``input.shape[-1] != weight.shape[1]``, or ``weight`` is not 2-D; the GEMM's errors naming
            ``aten.mm`` for an integer or complex operand or operands on different devices.
    """
    r = get_recipe(recipe)
    wd = weight._data if isinstance(weight, QuantizeOnUse) else weight  # (its metadata without torch_function)
    if wd.dim() != 2:
        raise RuntimeError(f"fp8_linear: weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
    if input.dim() < 1 or input.shape[-1] != wd.shape[1]:
        raise RuntimeError(
            f"fp8_linear: input's last dim {tuple(input.shape)[-1:]} does not match weight's in_features "
            f"{weight.shape[1]} (weight shape {tuple(weight.shape)})"
        )
    if input.dtype in FLOAT8_DTYPES or wd.dtype in FLOAT8_DTYPES:  # (a ScaledFp8Tensor reads as its high precision)
        which = "input" if input.dtype in FLOAT8_DTYPES else "weight"
        raise TypeError(
            f"fp8_linear: {which} is a plain {(input if which == 'input' else wd).dtype} tensor, which has no scales "
            "to read it by; pass a high-precision tensor or a ScaledFp8Tensor (ScaledFp8Tensor.from_hp)"
        )
    if not compat.is_compiling() and compat.functorch_active():
        raise NotImplementedError(
            "fp8_linear: torch.func transforms (grad, vmap, jacrev, ...) are not supported by the fp8 Linear; "
            "use ordinary autograd (loss.backward() / torch.autograd.grad), or leave this Linear in high precision "
            "(convert_to_fp8's module_filter_fn)"
        )
    if not compat.is_compiling() and compat.forward_ad_active():  # (a dual level is open: rare)
        _check_no_tangents(input, weight, bias)
    if compat.is_exporting():
        return _exported_forward(input, weight, bias, r)
    dev = input.device.type
    if (dev in _AUTOCAST_TYPES or torch.amp.is_autocast_available(dev)) and torch.is_autocast_enabled(dev):
        return _autocast_linear(input, weight, bias, r, dev)  # (meta and the like have no autocast state to ask)
    if not torch.is_grad_enabled():  # inference: no autograd Function where the pairs path runs
        out = _inference_forward(input, weight, bias, r)
        if out is not None:
            return out
    return _Fp8Linear.apply(input, weight, bias, r)


def _inference_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       recipe: Recipe) -> Optional[torch.Tensor]:
    """The fp8 Linear's forward with autograd off, in eager on plain tensors: the pairs path's GEMM
    (:func:`_forward_parts`) and the bias, without the ``autograd.Function`` (no context, nothing saved, less host
    time per call). Same ops and bits as :class:`_Fp8Linear`'s forward; None where it needs the subclass path.

    Decode-sized inputs (up to 32 tokens, bf16 / fp16, CUDA) with a row-scaled fp8 weight of their dtype take
    :func:`fp8tensor.quantize.weight_only_mm` instead, eager and compiled (``fp8tensor.config(weight_only_decode=...)``):
    ``x`` stays in its precision and the fp8 weight is read once (the step is bound by the weight's bytes)."""
    wd = weight._data if isinstance(weight, QuantizeOnUse) else weight
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if (type(weight) is ScaledFp8Tensor and weight.dtype == x.dtype and type(x2) in _PLAIN and weight.dim() == 2
            and get_config().weight_only_decode):
        out = weight_only_mm(x2, weight.qdata, weight.scale, bias)
        if out is not None:
            return out if x.dim() == 2 else out.view(*x.shape[:-1], wd.shape[0])
    out = _forward_parts(x2, weight, wd, recipe, x)
    if out is None:
        return None
    if bias is not None:
        out = out + bias
    return out if x.dim() == 2 else out.view(*x.shape[:-1], wd.shape[0])


def tp_export_message(where: str) -> str:
    """The error of ``torch.export`` reaching a tensor-parallel (DTensor) fp8 Linear."""
    return (
        f"{where}: torch.export of a tensor-parallel fp8 Linear (DTensor weight) is not supported: torch.export "
        "does not trace DTensor's parallel styles on the torch versions fp8tensor supports (a high-precision TP "
        "model fails the same way, in DTensor.from_local). Export the model before parallelize_module (one "
        "unsharded program: quantize_weights, then torch.export.export), or serve the TP model eagerly or with "
        "torch.compile"
    )


def _exported_forward(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      recipe: Recipe) -> torch.Tensor:
    """The fp8 Linear's forward as ``torch.export`` traces it: the ops of :class:`_Fp8Linear`'s general forward path
    (the weight quantized per row, or an fp8 weight used as it is; ``x`` quantized per row; one fp8 GEMM; the bias
    added to its output), outside the ``autograd.Function``.

    ``torch.export`` cannot trace a tensor subclass inside an ``autograd.Function`` (its ``autograd_function_apply``
    body fails on the subclass's first op), and an exported program is a forward graph: the backward of the Function
    is never part of it. The same quantizations and the same ``torch._scaled_mm`` call as the eager forward, so the
    exported program's outputs equal eager ones to the bit. Under ``torch.autocast`` the operands are cast as
    :func:`_autocast_linear` casts them.

    Returns:
        ``(*, N)``, as :func:`fp8_linear`.
    """
    dev = input.device.type
    if (dev in _AUTOCAST_TYPES or torch.amp.is_autocast_available(dev)) and torch.is_autocast_enabled(dev):
        input, weight, bias = _autocast_operands(input, weight, bias, dev)
        with torch.autocast(dev, enabled=False):
            return _exported_forward(input, weight, bias, recipe)
    if _is_dtensor(weight) or _is_dtensor(input):
        raise NotImplementedError(tp_export_message("fp8tensor.fp8_linear"))
    wd = weight._data if isinstance(weight, QuantizeOnUse) else weight
    K, N = input.shape[-1], wd.shape[0]
    x2 = input if input.dim() == 2 else input.reshape(-1, K)
    if _is_fp8(weight):
        out = torch.mm(x2, weight.t())  # the op table's GEMM, traced below the subclass (where export unwraps it)
    elif isinstance(weight, QuantizeOnUse):
        # the master's GEMM: it quantizes the weight per row, as the Function's forward does. Without grad mode: an
        # exported program has no backward (and the master's mm warns about one recorded outside fp8_linear).
        with torch.no_grad():
            out = torch.mm(x2, weight.t())
    else:
        raise NotImplementedError(
            "fp8tensor.fp8_linear: torch.export of an fp8 Linear whose weight is a plain high-precision tensor "
            f"(shape {tuple(weight.shape)}, {weight.dtype}) is not supported: the weight would be quantized inside "
            "the exported graph. Store it in fp8 first (fp8tensor.quantize_weights(model), or "
            "nn.Parameter(ScaledFp8Tensor.from_hp(w), requires_grad=False)), or keep an Fp8MasterWeight "
            "(fp8tensor.convert_to_fp8)"
        )
    if bias is not None:
        out = out + bias
    return out if input.dim() == 2 else out.reshape(*input.shape[:-1], N)


def _check_no_tangents(*tensors) -> None:
    """Raise if forward-mode AD carries a tangent into the fp8 Linear (it has no ``jvp``)."""
    for t in tensors:
        if t is not None and _forward_ad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                "fp8_linear: forward-mode AD (torch.autograd.forward_ad, torch.func.jvp) is not supported by the fp8 "
                "Linear; use reverse mode (backward / torch.autograd.grad), or leave this Linear in high precision "
                "(convert_to_fp8's module_filter_fn)"
            )


#: Device types that always have an autocast state (others are asked ``torch.amp.is_autocast_available`` first).
_AUTOCAST_TYPES = ("cuda", "cpu")
#: The dtypes autocast casts to its lower precision (it leaves float64 as it is).
_AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)


def _autocast_operands(input, weight, bias, device_type: str) -> tuple:
    """``(input, weight, bias)`` cast to the autocast dtype of ``device_type`` as autocast casts ``F.linear``'s
    operands (float32 / float16 / bfloat16 ones; autocast leaves float64 alone)."""
    dt = torch.get_autocast_dtype(device_type)
    cast = lambda t: t.to(dt) if t is not None and t.dtype != dt and t.dtype in _AUTOCAST_CASTS else t  # noqa: E731
    return cast(input), cast(weight), cast(bias)


def _autocast_linear(input, weight, bias, recipe: Recipe, device_type: str) -> torch.Tensor:
    """:func:`fp8_linear` under autocast: operands cast to the autocast dtype (as autocast casts ``F.linear``'s),
    then the fp8 Linear with autocast off (its own ops must not be re-cast: autocast would dequantize the fp8
    operands of ``mm`` into a high-precision GEMM)."""
    input, weight, bias = _autocast_operands(input, weight, bias, device_type)
    with torch.autocast(device_type, enabled=False):
        return _Fp8Linear.apply(input, weight, bias, recipe)
