"""The fp8 Linear: one forward and one backward running the output, grad_input and grad_weight GEMMs per the
recipe (:mod:`fp8tensor.recipes`: each in fp8 or high precision), and its functional form :func:`fp8_linear`.

The forward and backward receive the input and the weight as they come — plain tensors or DTensors — and only call
tensor ops (``reshape``, ``t``, ``mm``) plus :func:`map_local` for quantization: DTensor's own sharding rules place
the GEMMs, each rank quantizes its own shard, no placement is ever inspected here. An fp8 weight (frozen, or
FSDP2-gathered) is never re-quantized: grad_input folds its row scales, ``gy @ (diag(s) W8) = (gy diag(s)) @ W8``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.autograd.forward_ad as _forward_ad

from ..core import compat
from ..subclass.gemm import fp8_mm, scaled_mm
from ..subclass.ops import t_view
from ..numerics.quantize import (E4M3, FLOAT8_DTYPES, quantize, quantize_dim0_t_after, quantize_token_layouts,
                                 quantize_tokens, transpose_after, decode_mm)
from .recipes import Gemm, Recipe, get_recipe
from ..core.settings import get_config, read_traced_settings, scope_token, swap_scope
from ..subclass.tensor import ScaledFp8Tensor, _is_dtensor, make_scaled, map_local, map_local_each, rowwise_dims

__all__ = ["QuantizeOnUse", "fp8_linear", "tp_export_message"]


class QuantizeOnUse:
    """Marker base of tensor subclasses that wrap a high-precision tensor ``_data`` which is quantized on each use
    (:class:`fp8tensor.master.Fp8MasterWeight`): the fp8 Linear quantizes ``_data`` itself."""

    _data: torch.Tensor


# ---------------------------------------------------------------------------------------------- quantization
def _quantize_local(t: torch.Tensor, dim: int, fast_accum: bool, float8_dtype=E4M3) -> torch.Tensor:
    """A plain tensor or a master weight quantized along ``dim`` into a ScaledFp8Tensor; a ScaledFp8Tensor as it is
    (its fast-accumulation flag set; :func:`fp8tensor.gemm.fp8_mm` folds a scale that lies on the contraction dim)."""
    if isinstance(t, ScaledFp8Tensor):
        return t if t.fast_accum == fast_accum else t.with_fast_accum(fast_accum)
    if isinstance(t, QuantizeOnUse):
        t = t._data
    q, s = quantize(t, dim, float8_dtype, gemm_layout=True)  # fused kernel + GEMM layout where it applies
    return make_scaled(q, s, t.dtype, fast_accum, rowwise_dims(t.dim(), dim))


def _quantize(t: torch.Tensor, dim: int, fast_accum: bool, float8_dtype=E4M3) -> torch.Tensor:
    """:func:`_quantize_local` on a tensor or on each DTensor shard (sub-row-wise when ``dim`` is sharded)."""
    return map_local(t, lambda lt: _quantize_local(lt, dim, fast_accum, float8_dtype))


def _dequantize(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (a tensor, master, ScaledFp8Tensor or DTensor of these) as a high-precision tensor of ``dtype``."""
    def hp(lt):
        if isinstance(lt, ScaledFp8Tensor):
            return lt.to_hp(dtype)
        return (lt._data if isinstance(lt, QuantizeOnUse) else lt).to(dtype)
    return map_local(t, hp)


def _k_scaled(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (or, eager, a DTensor's local tensor) is an fp8 weight scaled along K, which ``fp8_mm``
    folds into its own row-wise quantization of ``x`` (given an ``x`` already in fp8 it dequantizes such a weight:
    right, slower)."""
    local = compat.local_tensor(weight) if _is_dtensor(weight) and not compat.is_compiling() else weight
    return isinstance(local, ScaledFp8Tensor) and local.scale.shape[-1] != 1


def _is_fp8(t: torch.Tensor) -> bool:
    if _is_dtensor(t):  # (eager: the local tensor itself, without to_local's autograd Function)
        local = t.to_local() if compat.is_compiling() else compat.local_tensor(t)
    else:
        local = t
    shards = compat.local_tensor_shards(local)  # LocalTensorMode: one tensor per simulated rank
    if shards:
        local = next(iter(shards.values()))
    return isinstance(local, ScaledFp8Tensor)


# ---------------------------------------------------------------------------------------------- the GEMM
def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with an fp8 operand: :func:`fp8tensor.gemm.fp8_mm` directly in eager on plain operands (no dispatcher
    round trip), else ``torch.mm`` (DTensor's rules, compile, export, modes)."""
    if (type(a) in (torch.Tensor, ScaledFp8Tensor) and type(b) in (torch.Tensor, ScaledFp8Tensor)
            and not compat.is_compiling() and not compat.dispatch_modes_active()):
        return fp8_mm(a, b, op="aten.mm")
    return torch.mm(a, b)


# ---------------------------------------------------------------------------------------------- operands
def _x_for_grad_weight(x: torch.Tensor, x2: torch.Tensor, gemm: Gemm) -> torch.Tensor:
    """The grad_weight operand, made in forward: ``x2 = x.reshape(-1, K)`` quantized per input feature over the
    tokens (a plain CUDA ``x`` as it is: :func:`fp8tensor.quantize.quantize_tokens`), saved instead of ``x``. Nothing
    is kept between calls. An ``x2`` already fp8 per token (fp8 sequence parallelism) is kept: ``fp8_mm`` folds it."""
    fast, float8_dtype = gemm.fast_accum, gemm.b.float8_dtype
    if type(x2) is not torch.Tensor and _is_fp8(x2):
        return _quantize(x2, 0, fast)
    if not _is_dtensor(x) and not isinstance(x, ScaledFp8Tensor) and x.dim() >= 2:
        hit = quantize_tokens(x, float8_dtype)
        if hit is not None:
            return make_scaled(hit[0], hit[1], x.dtype, fast, (False, True))
    return _quantize(x2, 0, fast, float8_dtype)


def _token_layouts(t: torch.Tensor):
    """:func:`fp8tensor.quantize.quantize_token_layouts` of a plain ``t`` (input or ``grad_out``), else None."""
    if _is_dtensor(t) or isinstance(t, ScaledFp8Tensor) or t.dim() < 2:
        return None
    return quantize_token_layouts(t, E4M3)


def _input_layouts(x: torch.Tensor, x2: torch.Tensor, recipe: Recipe):
    """The forward's ``x`` in both fp8 layouts from :func:`fp8tensor.quantize.quantize_token_layouts`: per row for the
    output GEMM and per input feature over the tokens for grad_weight, as ScaledFp8Tensors; for a DTensor ``x``, of
    its local tensor, each wrapped with ``x2``'s spec (per-shard scales, as :func:`_quantize` makes them). None where
    the kernels do not take it: then the GEMM engine and :func:`_x_for_grad_weight` quantize ``x`` (same values)."""
    if isinstance(x, ScaledFp8Tensor) or x.dim() < 2:
        return None
    row_fast, col_fast = recipe.output.fast_accum, recipe.grad_weight.fast_accum

    def both(t):
        if isinstance(t, ScaledFp8Tensor):  # (a DTensor's local already in fp8: fp8 sequence parallelism)
            return None
        hit = quantize_token_layouts(t, E4M3)
        if hit is None:
            return None
        return (make_scaled(hit[0], hit[1], t.dtype, row_fast, (True, False)),
                make_scaled(hit[2], hit[3], t.dtype, col_fast, (False, True)))
    if not _is_dtensor(x):
        return both(x)
    if not (type(x2) is type(x) and x2.dim() == 2):  # (a 2-D DTensor view of x, as the GEMM reads it)
        return None
    return map_local_each(x2, both)


def _weight_for_grad_input(weight: torch.Tensor, gy: torch.Tensor, gemm: Gemm) -> torch.Tensor:
    """The weight operand of ``grad_x = gy @ W``, made after ``gy`` exists: an fp8 weight transposed (its row scales
    folded into ``gy`` by ``fp8_mm``), a master quantized per input column (DTensor shards as they come)."""
    fast, float8_dtype = gemm.fast_accum, gemm.b.float8_dtype
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
            qt, st = quantize_dim0_t_after(w, gy, float8_dtype)
            return make_scaled(qt.t(), st.t(), w.dtype, fast, rowwise_dims(2, 0))
    return _quantize(weight, 0, fast, float8_dtype)


# ---------------------------------------------------------------------------------------------- the one path
def _rows(t: torch.Tensor, C) -> torch.Tensor:
    """``t`` ``(..., C)`` as ``(rows, C)``: ``reshape(-1, C)``, with the row count spelled out where ``C`` is 0 (an
    ``nn.Linear(0, N)`` input, or the gradient of an ``nn.Linear(K, 0)`` output), for which ``-1`` is ambiguous."""
    return t.reshape(-1, C) if C != 0 else t.reshape(math.prod(t.shape[:-1]), 0)


def _hp_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in high precision (a recipe's ``"hp"`` GEMM) in the promoted dtype. ``a`` (input or ``grad_out``) is
    only cast, never through ``map_local`` (see :func:`_backward`); ``b`` (weight, saved input) is dequantized."""
    dt = torch.promote_types(a.dtype, b.dtype)
    if type(a) is not torch.Tensor and _is_fp8(a):  # (an input gathered in fp8 by fp8 sequence parallelism)
        a = _dequantize(a, dt)
    return torch.mm(a if a.dtype == dt else a.to(dt), _dequantize(b, dt))


def _forward(x2: torch.Tensor, weight: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """The output GEMM ``x2 @ W^T`` ``(M, N)`` per ``recipe.output``: the weight quantized per row (an fp8 weight used
    as it is), ``x2`` per row in e4m3 by the GEMM engine; or in high precision. The one forward of the fp8 Linear:
    run inside :class:`_Fp8Linear` when autograd records, directly when it does not."""
    g = recipe.output
    if not g.fp8:
        return _hp_mm(x2, weight.t())
    w8 = _quantize(weight, -1, g.fast_accum, g.b.float8_dtype)
    # (eager: the op table's aten.t entry called directly, without the dispatcher round trip)
    return _mm(x2, t_view(w8) if type(w8) is ScaledFp8Tensor and not compat.is_compiling() else w8.t())


def _add_bias(out: torch.Tensor, bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``out`` ``(M, N)`` (the GEMM of ``x`` as ``(M, K)``) plus ``bias``, which broadcasts to the output shape
    ``(*x.shape[:-1], N)`` (:func:`fp8_linear` checks it): a bias of two or more dims broadcasts over ``x``'s leading
    dims, not over the ``M`` rows of ``out``."""
    if bias.dim() <= 1:
        return out + bias
    N = out.shape[-1]
    return out + _rows(bias.expand(*x.shape[:-1], N), N)


class _Fp8Linear(torch.autograd.Function):
    """``y = x @ W^T + b`` per the recipe. Saved for backward (the minimum each gradient needs): for grad_weight, ``x``
    quantized per input feature over the tokens (fp8 grad_weight) or ``x`` itself; for grad_input, the weight as the
    forward received it (the master, or the fp8 weight FSDP2 gathered; no quantized copy); shapes and dtypes."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Recipe):
        wd = weight._data if isinstance(weight, QuantizeOnUse) else weight  # shape / dtype without torch_function
        N = wd.shape[0]
        x2 = x if x.dim() == 2 else _rows(x, x.shape[-1])  # (a reshape to itself still costs a DTensor dispatch)
        x_saved = None
        # (an fp8 weight scaled along K keeps its scale folded into x's row-wise quantization: fp8_mm)
        both = (_input_layouts(x, x2, recipe) if ctx.needs_input_grad[1] and recipe.output.fp8
                and recipe.grad_weight.fp8 and recipe.grad_weight.b.float8_dtype == E4M3 and not _k_scaled(weight)
                else None)
        if both is not None:  # x per row for this GEMM and per feature for grad_weight, from two reads of x
            x2, x_saved = both
        out = _forward(x2, weight, recipe)
        if bias is not None:
            out = _add_bias(out, bias, x)
        ctx.recipe = recipe
        ctx.has_bias = bias is not None
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.x_shape = x.shape
        ctx.n_out = N
        ctx.w_dtype = wd.dtype
        # the settings in force now are the ones the backward runs under (it may run in another thread)
        ctx.settings = None if compat.is_compiling() else scope_token()
        if ctx.needs_input_grad[1] and x_saved is None:
            x_saved = _x_for_grad_weight(x, x2, recipe.grad_weight) if recipe.grad_weight.fp8 else x
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
            dev = "cuda" if grad_out.is_cuda else grad_out.device.type
            if autocast_enabled(dev):
                # backward() called inside an autocast block (CPU autograd runs in the caller's thread): autocast
                # off, as in the forward (CPU autocast casts torch._scaled_mm's float32 scales to its dtype)
                with torch.autocast(dev, enabled=False):
                    return _backward(ctx, grad_out)
            return _backward(ctx, grad_out)
        finally:
            swap_scope(prev)


def _backward(ctx, grad_out):
    """:meth:`_Fp8Linear.backward` under the settings of its forward: grad_input ``gy @ W`` and grad_weight
    ``gy^T @ x`` per the recipe."""
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
    g2 = grad_out if grad_out.dim() == 2 else _rows(grad_out, ctx.n_out)
    grad_x = grad_w = grad_b = None
    both = (_token_layouts(grad_out) if ctx.needs_input_grad[0] and ctx.needs_input_grad[1]
            and recipe.grad_input.fp8 and recipe.grad_weight.fp8 and not _is_fp8(weight) else None)
    if ctx.needs_input_grad[0]:
        if recipe.grad_input.fp8:
            # ``grad_out`` itself (not its reshape) orders the weight operand after it: see quantize.transpose_after
            w8 = _weight_for_grad_input(weight, grad_out, recipe.grad_input)
            if both is not None:  # grad_out per row here, per output feature for grad_weight (two reads)
                grad_x = _mm(make_scaled(both[0], both[1], grad_out.dtype, recipe.grad_input.fast_accum,
                                         (True, False)), w8)
            else:
                grad_x = _mm(g2, w8)
        else:
            grad_x = _hp_mm(g2, weight)
        if grad_x.shape != ctx.x_shape:
            grad_x = grad_x.reshape(ctx.x_shape)
    if ctx.needs_input_grad[1]:
        fast = recipe.grad_weight.fast_accum
        if recipe.grad_weight.fp8:
            # gy^T (N, M) quantized per output feature over the tokens: from grad_out itself on CUDA (as x in
            # forward), else by fp8_mm; same bits. Nothing derived from grad_out goes through map_local: a compiled
            # backward is traced with grad placements guessed from the forward output (Partial), not the runtime ones.
            gt = g2.t()
            hit = both[2:] if both is not None else (
                quantize_tokens(grad_out, E4M3) if not _is_dtensor(grad_out) and grad_out.dim() >= 2 else None)
            if hit is not None:  # q (N, M) row-major, scale (N, 1): fp8_mm uses them as they are
                gt = make_scaled(hit[0].t(), hit[1].t(), grad_out.dtype, fast, rowwise_dims(2, 1))
            grad_w = _mm(gt, x_saved)
        else:
            grad_w = _hp_mm(g2.t(), _rows(x_saved, ctx.x_shape[-1]))
        grad_w = grad_w.to(ctx.w_dtype)
    if ctx.has_bias and ctx.needs_input_grad[2]:  # (a bias of 2+ dims: summed over the dims it broadcasts over)
        grad_b = g2.sum(0) if len(ctx.bias_shape) <= 1 else grad_out.sum_to_size(ctx.bias_shape)
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
        bias: optional ``(N,)`` tensor (or any shape that broadcasts to the output's, e.g. ``(1, N)``).
        recipe: ``"rowwise"`` (default), ``"rowwise_gw_hp"`` or a :class:`Recipe`.

    Returns:
        ``(*, N)`` tensor of the promoted dtype of ``input`` and ``weight`` (their common dtype in the usual case of
        one dtype; under autocast the autocast dtype).

    Raises:
        ValueError: unknown recipe.
        TypeError: ``input`` is not a dense (strided, not nested) tensor, ``weight`` is not a tensor, or ``input``
            or ``weight`` is a plain float8 tensor (no scales to read it by).
        NotImplementedError: called under a ``torch.func`` transform (``grad``, ``vmap``, ...) or with a
            forward-mode AD tangent, which this ``autograd.Function`` does not support; also, raised by the backward,
            double backward (``create_graph=True``).
        RuntimeError: ``input.shape[-1] != weight.shape[1]``, ``weight`` is not 2-D, or ``bias``'s last dim is neither
            ``weight.shape[0]`` nor 1 or ``bias`` does not broadcast to the output shape ``(*, N)`` (a bias of
            several dims broadcasts over ``input``'s leading dims); the GEMM's errors naming ``aten.mm`` for an
            integer or complex operand or operands on different devices.
    """
    r = get_recipe(recipe)
    if compat.is_compiling():
        read_traced_settings()  # (dynamo guards on them: a later change recompiles)
    elif type(weight) is ScaledFp8Tensor and type(input) is torch.Tensor and (
            not torch.is_grad_enabled()):
        if _eager_no_grad(input, weight, bias):  # (the decode step's route: its checks in one pass)
            return _inference_forward(input, weight, bias, r)
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"fp8_linear: input must be a Tensor, got {type(input).__name__}")
    if input.layout is not torch.strided or input.is_nested:
        raise TypeError(f"fp8_linear: input must be a dense (strided) tensor, got "
                        f"{'a nested tensor' if input.is_nested else f'layout {input.layout}'}; densify it first "
                        "(input.to_dense(), or torch.nested.to_padded_tensor)")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"fp8_linear: weight must be a Tensor, got {type(weight).__name__}")
    wd = weight._data if isinstance(weight, QuantizeOnUse) else weight  # (its metadata without torch_function)
    if wd.dim() != 2:
        raise RuntimeError(f"fp8_linear: weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
    if input.dim() < 1 or input.shape[-1] != wd.shape[1]:
        raise RuntimeError(
            f"fp8_linear: input's last dim {tuple(input.shape)[-1:]} does not match weight's in_features "
            f"{weight.shape[1]} (weight shape {tuple(weight.shape)})"
        )
    if bias is not None and bias.dim() >= 1 and bias.shape[-1] not in (1, wd.shape[0]):
        raise RuntimeError(f"fp8_linear: bias shape {tuple(bias.shape)} does not match the weight's out_features "
                           f"{wd.shape[0]} (weight shape {tuple(wd.shape)})")
    if bias is not None and bias.dim() >= 2 and not _broadcasts_to(bias.shape, (*input.shape[:-1], wd.shape[0])):
        raise RuntimeError(f"fp8_linear: bias shape {tuple(bias.shape)} does not broadcast to the output shape "
                           f"{(*input.shape[:-1], wd.shape[0])} (input shape {tuple(input.shape)}, weight shape "
                           f"{tuple(wd.shape)})")
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
    if not compat.is_compiling() and compat.forward_ad_active() and any(  # (a dual level is open: rare)
            t is not None and _forward_ad.unpack_dual(t).tangent is not None for t in (input, weight, bias)):
        raise NotImplementedError(
            "fp8_linear: forward-mode AD (torch.autograd.forward_ad, torch.func.jvp) is not supported by the fp8 "
            "Linear; use reverse mode (backward / torch.autograd.grad), or leave this Linear in high precision "
            "(convert_to_fp8's module_filter_fn)")
    dev = "cuda" if input.is_cuda else input.device.type  # (is_cuda first: device.type costs µs)
    if autocast_enabled(dev):
        # (meta and the like have no autocast state to ask.) Operands cast as autocast casts F.linear's (float64 is
        # left alone), then the fp8 Linear with autocast off: autocast would dequantize the fp8 operands of mm into a
        # high-precision GEMM.
        dt = torch.get_autocast_dtype(dev)
        input, weight, bias = (t.to(dt) if t is not None and t.dtype != dt and t.dtype in _AUTOCAST_CASTS else t
                               for t in (input, weight, bias))
        with torch.autocast(dev, enabled=False):
            return (_exported_forward if compat.is_exporting() else _Fp8Linear.apply)(input, weight, bias, r)
    if compat.is_exporting():
        return _exported_forward(input, weight, bias, r)
    if not torch.is_grad_enabled():
        return _inference_forward(input, weight, bias, r)  # (nothing to record: no autograd Function)
    return _Fp8Linear.apply(input, weight, bias, r)


def _eager_no_grad(x: torch.Tensor, weight: ScaledFp8Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether :func:`fp8_linear`'s checks all pass and it goes straight to :func:`_inference_forward` for this eager
    no-grad call (the caller checked: not compiling, autograd off, ``x`` a plain tensor, ``weight`` a
    ScaledFp8Tensor), tested in one pass for the common case (``x`` of the weight's dtype, a ``(N,)`` bias or none);
    False sends the call through the full route, which raises what it raises. The weight's metadata is read from
    ``qdata`` (its logical shape) and ``orig_dtype`` (its ``dtype``), plain attributes: the subclass's own cost a
    ``__torch_function__`` lookup each. Nothing is kept between calls."""
    w8 = weight.qdata
    return (not x.is_nested and x.layout is torch.strided and x.dim() >= 1 and w8.dim() == 2
            and weight.orig_dtype == x.dtype and x.shape[-1] == w8.shape[1]
            and (bias is None or (bias.dim() == 1 and bias.shape[0] == w8.shape[0]))
            and not (compat.is_exporting() or compat.functorch_active() or compat.forward_ad_active()
                     or autocast_enabled("cuda" if x.is_cuda else x.device.type)))


def _broadcasts_to(shape, target) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``target`` without changing it (``expand``'s rule)."""
    return len(shape) <= len(target) and all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def _inference_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       recipe: Recipe) -> torch.Tensor:
    """The fp8 Linear with autograd off: :func:`_forward` and the bias, without the ``autograd.Function`` (no context,
    nothing saved). Same ops and bits as :class:`_Fp8Linear`'s forward.

    Decode-sized inputs (up to 64 tokens: ``kernels.W8_MM_CONFIG``; bf16 / fp16, CUDA) with a row-scaled fp8 weight of
    their dtype take :func:`fp8tensor.quantize.decode_mm` instead, eager and compiled
    (``fp8tensor.config(weight_only_decode=...)``): up to 16 tokens ``x`` stays in its precision and the fp8 weight
    is read once (the step is bound by the weight's bytes); up to 64, ``x`` quantized per row and the small-M GEMM's
    fp8 x fp8 form, split over K."""
    if (type(weight) is ScaledFp8Tensor and type(x) is torch.Tensor and weight.orig_dtype == x.dtype  # (its dtype)
            and get_config().weight_only_decode):
        # (..., K) as it is: no reshape in eager; x quantized past 16 rows only where the recipe quantizes it
        out = decode_mm(x, weight.qdata, weight.scale, bias, fp8_x=recipe.output.fp8)
        if out is not None:
            return out
    wd = weight._data if isinstance(weight, QuantizeOnUse) else weight
    x2 = x if x.dim() == 2 else _rows(x, x.shape[-1])
    out = _forward(x2, weight, recipe)
    if bias is not None:
        out = _add_bias(out, bias, x)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], wd.shape[0])


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
    """The fp8 Linear's forward as ``torch.export`` traces it, outside the ``autograd.Function`` (export cannot
    trace a subclass inside one; an exported program has no backward): the quantizations and ``torch._scaled_mm``
    call of the eager forward, through the op table for fp8 and master weights and as plain ops for a plain
    high-precision weight, so the program's outputs equal eager ones to the bit. Returns
    ``(*, N)``, as :func:`fp8_linear` (which casts the operands under ``torch.autocast``)."""
    if _is_dtensor(weight) or _is_dtensor(input):
        raise NotImplementedError(tp_export_message("fp8tensor.fp8_linear"))
    wd = weight._data if isinstance(weight, QuantizeOnUse) else weight
    K, N = input.shape[-1], wd.shape[0]
    x2 = input if input.dim() == 2 else _rows(input, K)
    if _is_fp8(weight):
        out = torch.mm(x2, weight.t())  # the op table's GEMM, traced below the subclass (where export unwraps it)
    elif isinstance(weight, QuantizeOnUse):
        # the master's GEMM: it quantizes the weight per row, as the Function's forward does. Without grad mode: an
        # exported program has no backward (and the master's mm warns about one recorded outside fp8_linear).
        with torch.no_grad():
            out = torch.mm(x2, weight.t())
    elif not recipe.output.fp8:
        out = _hp_mm(x2, weight.t())
    else:
        # a plain high-precision weight (convert_to_fp8 without fp8_all_gather, a tied output head): the eager
        # forward's quantizations and GEMM on plain tensors, the weight quantized per row inside the program as each
        # eager call quantizes it
        g = recipe.output
        wq, ws = quantize(weight, -1, g.b.float8_dtype, gemm_layout=True)
        xq, xs = quantize(x2, 1, E4M3, gemm_layout=True)
        out = scaled_mm(xq, xs, wq.t(), ws.t(), torch.promote_types(x2.dtype, weight.dtype),
                        use_fast_accum=g.fast_accum)
    if bias is not None:
        out = _add_bias(out, bias, input)
    return out if input.dim() == 2 else out.reshape(*input.shape[:-1], N)


#: Device types that always have an autocast state (others are asked ``torch.amp.is_autocast_available`` first).
_AUTOCAST_TYPES = ("cuda", "cpu")


def autocast_enabled(device_type: str) -> bool:
    """Whether ``torch.autocast`` is on for ``device_type`` (meta and the like have no autocast state to ask)."""
    return ((device_type in _AUTOCAST_TYPES or torch.amp.is_autocast_available(device_type))
            and torch.is_autocast_enabled(device_type))


#: The dtypes autocast casts to its lower precision (it leaves float64 as it is).
_AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)
