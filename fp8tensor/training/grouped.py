"""Row-wise fp8 grouped GEMMs for mixture-of-experts weights: :func:`fp8_grouped_mm`, the 2-D x 3-D
``torch._grouped_mm(a, b, offs)`` with every operand scaled along its GEMM's contraction dim (docs/moe.md, "Recipes
and numerics", "Compiled")."""
from __future__ import annotations

from typing import Optional

import torch

from ..core import compat
from .linear import _AUTOCAST_TYPES, QuantizeOnUse, autocast_enabled
from ..numerics.quantize import (E4M3, FLOAT8_DTYPES, cast_rows_t_after, quantize, quantize_expert_cols,
                                 quantize_group_cols, transpose_after)
from .recipes import Recipe, get_recipe
from ..core.settings import get_config, read_traced_settings
from ..subclass.gemm import scaled_mm
from ..subclass.tensor import ScaledFp8Tensor, implements

__all__ = ["fp8_grouped_mm", "Fp8GroupedMMMode", "quantize_group_cols", "quantize_expert_cols", "padded_offsets",
           "grouped_2d3d", "grouped_2d2d", "ALIGN"]

#: Token alignment of the groups of the fp8 2-D x 2-D grouped GEMM (16-byte aligned groups on CUDA).
ALIGN = 16


# ---------------------------------------------------------------------------------------------- offsets
def padded_offsets(offs: torch.Tensor, M: int, align: int = ALIGN):
    """The padded token layout of the 2-D x 2-D grouped GEMM, without a host sync, for int32 ``(E,)`` cumulative group
    ends ``offs`` (non-decreasing, ``offs[-1] <= M``) of ``M`` token rows and the group alignment ``align``.

    Returns:
        ``(M_pad, pad_ends, pad_starts)``: ``M_pad`` a Python int (room for every group rounded up to ``align``, at
        least ``align``, plus one spare block), ``pad_ends`` / ``pad_starts`` int32 ``(E,)`` the padded cumulative
        ends / starts (an empty group gets ``align`` zero columns).
    """
    E = offs.numel()
    ends = offs.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    sizes = (ends - starts).clamp(min=0)
    psizes = ((sizes + align - 1) // align * align).clamp(min=align)
    pends = torch.cumsum(psizes, 0)
    M_pad = (M + (2 * align - 1) * E + align - 1) // align * align + align
    return M_pad, pends.to(torch.int32), (pends - psizes).to(torch.int32)


# ---------------------------------------------------------------------------------------------- quantization
def _quantize_rows(x: torch.Tensor, float8_dtype: torch.dtype = E4M3):
    """``(q, scale (..., 1))`` of ``x`` ``(..., C)`` quantized per row, ``q`` contiguous."""
    return quantize(x.contiguous(), -1, float8_dtype)


# ---------------------------------------------------------------------------------------------- GEMMs
def _fused_ok(*mats) -> bool:
    return (get_config().grouped_gemm_kernel and all(m.is_cuda and m.dtype == E4M3 for m in mats)
            and hasattr(torch, "_scaled_grouped_mm"))


def _mm_dtype(t: torch.Tensor, out_dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if t.is_cuda else out_dtype  # (CUDA's row-wise scaled GEMMs write bf16 only)


def _as(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # (no no-op ``.to``: torch 2.11's dynamo zeroes the grad of a Function returning one, docs/pytorch_issues.md)
    return out if out.dtype == dtype else out.to(dtype)


def _groups(ends: torch.Tensor, n: int):
    """``(e, start, end)`` of every non-empty group ``e`` of cumulative ``ends`` (read on the host), within ``n``."""
    start = 0
    for e, end in enumerate(ends.tolist()):
        end = min(end, n)
        if end > start:
            yield e, start, end
        start = max(start, end)


def _group_mm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype,
              fast_accum: bool) -> torch.Tensor:
    """One group's fp8 GEMM ``(a * sa) @ (b * sb)``: ``torch._scaled_mm`` with row-wise scales on CUDA (bf16 out);
    elsewhere the GEMM engine's :func:`fp8tensor.gemm.scaled_mm`, which runs that same call where this torch has a
    row-wise CPU ``_scaled_mm`` (torch >= 2.13) and a backend that has one where it does not (torch 2.11's CPU
    ``_scaled_mm`` takes tensor-wise scales only: an internal assert otherwise)."""
    if a.is_cuda:
        return torch._scaled_mm(a, b, sa, sb, out_dtype=_mm_dtype(a, out_dtype), use_fast_accum=fast_accum)
    return scaled_mm(a, sa, b, sb, out_dtype, use_fast_accum=fast_accum)


def _rows_to_16(a: torch.Tensor, scale: torch.Tensor):
    """On CUDA, ``a`` (fp8 rows) and its row scales padded to a multiple of 16 rows (cuBLAS needs it)."""
    pad = -a.shape[0] % 16
    if not a.is_cuda or pad == 0:
        return a, scale
    a = torch.cat([a, a.new_zeros(pad, a.shape[1])])
    return a, torch.cat([scale, scale.new_ones(pad, scale.shape[1])])


def _traced(offs: torch.Tensor) -> bool:
    """Whether the host cannot read ``offs`` now (traced, or a fake / functional tensor): the masked GEMMs then."""
    return compat.is_compiling() or type(offs) is not torch.Tensor


def _group_masks(ends: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(E, n)`` of ``dtype``: 1 where index ``i`` lies in group ``e`` (``ends[e-1] <= i < ends[e]``), else 0."""
    ends = ends.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    i = torch.arange(n, device=ends.device)
    return ((i >= starts[:, None]) & (i < ends[:, None])).to(dtype)


def grouped_2d3d(aq, a_scale, bq, b_scale, offs, out_dtype, *, fast_accum: bool) -> torch.Tensor:
    """``out[rows of e] = (aq * a_scale)[rows of e] @ (bq[e] * b_scale[e])``.

    Args: ``aq`` ``(M, K)`` row-major fp8 and float32 ``a_scale`` ``(M,)``; ``bq`` ``(E, K, N)`` fp8, column-major
    per expert, and float32 ``b_scale`` ``(E, N)``; ``offs`` int32 ``(E,)`` cumulative group ends.

    Returns:
        ``(M, N)`` of ``out_dtype`` (rows past ``offs[-1]`` unspecified). ``torch._scaled_grouped_mm`` where it runs
        (``Config.grouped_gemm_kernel``), else a per-group ``torch._scaled_mm`` loop (traced: one masked GEMM).
    """
    M, K = aq.shape
    E, _, N = bq.shape
    if _fused_ok(aq, bq) and K % 16 == 0 and N % 16 == 0 and M > 0:
        return _as(torch._scaled_grouped_mm(aq, bq, a_scale, b_scale, offs=offs, out_dtype=torch.bfloat16,
                                            use_fast_accum=fast_accum), out_dtype)
    if _traced(offs):  # no per-group host loop: every expert's GEMM on all rows, masked (E times the flops)
        a = aq.float() * a_scale[:, None]
        return _as((torch.matmul(a, bq.float() * b_scale[:, None, :]) * _group_masks(offs, M)[:, :, None]).sum(0),
                   out_dtype)
    out = torch.zeros(M, N, dtype=out_dtype, device=aq.device)
    for e, start, end in _groups(offs, M):
        a, sa = _rows_to_16(aq[start:end], a_scale[start:end, None])
        y = _group_mm(a, bq[e], sa, b_scale[e][None, :], out_dtype, fast_accum)
        out[start:end] = y[: end - start]
    return out


def grouped_2d2d(aq_t, a_scale, bq_t, b_scale, pad_ends, out_dtype, *, fast_accum: bool) -> torch.Tensor:
    """``out[e] = (aq_t * a_scale[e])[:, group e] @ ((bq_t * b_scale[e])[:, group e])^T`` (padded token groups).

    Args:
        aq_t, bq_t: ``(N, M_pad)``, ``(K, M_pad)`` row-major fp8; a_scale, b_scale: float32 ``(E, N)``, ``(E, K)``.
        pad_ends: int32 ``(E,)`` cumulative group ends in the padded layout (multiples of 16 for the fused kernel).

    Returns ``(E, N, K)`` of ``out_dtype`` (zeros for an expert without tokens).
    """
    N, M_pad = aq_t.shape
    K = bq_t.shape[0]
    E = pad_ends.numel()
    if _fused_ok(aq_t, bq_t) and K % 16 == 0 and N % 16 == 0 and E > 0:
        return _as(torch._scaled_grouped_mm(aq_t, bq_t.t(), a_scale.reshape(-1), b_scale.reshape(-1),
                                            offs=pad_ends, out_dtype=torch.bfloat16, use_fast_accum=fast_accum),
                   out_dtype)
    if _traced(pad_ends):  # each expert's GEMM over all (padded) tokens, the others masked out
        # (by where, not a product: columns past the last group's padding are unspecified bytes, NaN included)
        masks = _group_masks(pad_ends, M_pad, torch.bool)
        a = torch.where(masks[:, None, :], aq_t.float(), 0.0)
        b = torch.where(masks.any(0)[None, :], bq_t.float(), 0.0)
        return _as(torch.matmul(a, b.t()) * a_scale[:, :, None] * b_scale[:, None, :], out_dtype)
    out = torch.zeros(E, N, K, dtype=out_dtype, device=aq_t.device)
    for e, start, end in _groups(pad_ends, M_pad):
        a = aq_t[:, start:end].contiguous()
        b = bq_t[:, start:end].contiguous().t()
        out[e] = _group_mm(a, b, a_scale[e][:, None], b_scale[e][None, :], out_dtype, fast_accum)
    return out


def _grouped_hp_weight_grad(gy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, E: int) -> torch.Tensor:
    """``out[e] = gy[group e]^T @ x[group e]`` ``(E, N, K)`` in high precision."""
    if gy.dtype == torch.bfloat16 and x.dtype == torch.bfloat16 and E > 0 and gy.shape[0] > 0:
        # row-major operands, as in eager (traced, inductor's own (N, M) layout of gy.t() breaks 16-byte strides)
        return torch._grouped_mm(compat.one_buffer(gy).t(), compat.one_buffer(x), offs=offs)
    if _traced(offs):  # masked, as grouped_2d2d
        return torch.matmul(gy.t() * _group_masks(offs, gy.shape[0], gy.dtype)[:, None, :], x)
    out = gy.new_zeros(E, gy.shape[1], x.shape[1])
    for e, start, end in _groups(offs, gy.shape[0]):
        out[e] = gy[start:end].t() @ x[start:end]
    return out


# ---------------------------------------------------------------------------------------------- weights
def _weight_parts(b: torch.Tensor):
    """``(W, fp8)`` of the ``(E, K, N)`` operand ``b``: ``(None, (qdata (E, N, K), scale (E, N)))`` for one scale per
    expert row, else ``(high-precision (E, N, K) weight, None)``."""
    if isinstance(b, ScaledFp8Tensor):
        E, K, N = b.shape
        if tuple(b.scale.shape) == (E, 1, N):
            return None, (b.qdata.transpose(-2, -1).contiguous(), b.scale.reshape(E, N))
        return b.to_hp().transpose(-2, -1), None  # another scale layout: re-quantized from its values
    if isinstance(b, QuantizeOnUse):
        b = b._data
    return b.transpose(-2, -1), None


def _check(a, b, offs, op: str) -> None:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"{op}: expected tensors, got {type(a).__name__} and {type(b).__name__}")
    bd = b._data if isinstance(b, QuantizeOnUse) else b
    if a.dim() != 2 or bd.dim() != 3:
        raise ValueError(
            f"{op}: fp8 grouped GEMM takes a 2-D input (tokens, K) and 3-D expert weights (E, K, N) (the transpose "
            f"of (E, N, K)), got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != bd.shape[1]:
        raise ValueError(f"{op}: contraction dims differ: input {tuple(a.shape)}, weights {tuple(b.shape)} "
                         "(expected (M, K) and (E, K, N))")
    if (a.dtype in FLOAT8_DTYPES or not a.dtype.is_floating_point or bd.dtype in FLOAT8_DTYPES
            or not bd.dtype.is_floating_point):
        raise TypeError(f"{op}: expected a high-precision input and weights (or a ScaledFp8Tensor), got {a.dtype} "
                        f"and {bd.dtype}")
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32:
        raise TypeError(f"{op}: offs must be a 1-D int32 tensor of cumulative group ends, got "
                        f"{getattr(offs, 'dtype', type(offs))} of shape {tuple(getattr(offs, 'shape', ()))}")
    if offs.dim() != 1:
        raise ValueError(f"{op}: offs must be a 1-D int32 tensor of cumulative group ends, got shape "
                         f"{tuple(offs.shape)}")
    if offs.numel() != bd.shape[0]:
        raise ValueError(f"{op}: offs has {offs.numel()} groups but the weights have {bd.shape[0]} experts")
    if offs.device != a.device or bd.device != a.device:
        raise RuntimeError(f"{op}: input, weights and offs must be on one device, got {a.device}, {bd.device} "
                           f"and {offs.device}")
    if not offs.is_cuda and offs.numel() and not _traced(offs):  # (a check on CUDA would be a host sync per GEMM)
        o = offs.to(torch.int64)
        if bool((o[1:] < o[:-1]).any()) or int(o[0]) < 0 or int(o[-1]) > a.shape[0]:
            raise ValueError(f"{op}: offs must be non-decreasing cumulative group ends within [0, {a.shape[0]}], "
                             f"got {offs.tolist()}")
    elif offs.device.type == "cpu" and offs.numel():  # traced on CPU: the same check in the graph, run with it
        o = offs.to(torch.int64)
        ok = (o[1:] >= o[:-1]).all() & (o[0] >= 0) & (o[-1] <= a.shape[0])
        compat.assert_async(ok, f"{op}: offs must be non-decreasing cumulative group ends within [0, M] (M the "
                                "input's rows)")


class _SharedTokens:
    """One input ``a`` of the grouped GEMMs run inside one :class:`Fp8GroupedMMMode` (one forward of a converted
    experts module), quantized once for the GEMMs that read it in a row (SwiGLU's w1 and w3 read the same tokens):
    the forward's row-wise fp8, computed by the first GEMM and reused by the next, and the backward's per-group
    column quantization, computed by the first backward and reused by the others (``pending``: backwards still to
    take it; the last drops it)."""

    __slots__ = ("a", "version", "ptr", "offs", "offs_version", "rows", "cols", "pending")

    def __init__(self, a, offs, rows):
        self.a, self.version, self.ptr = a, a._version, a.data_ptr()
        self.offs, self.offs_version = offs, offs._version
        self.rows, self.cols, self.pending = rows, None, 0

    def matches(self, a, offs) -> bool:
        """Whether ``a`` and ``offs`` are this entry's tensors, unchanged since (version counters, storage)."""
        return (self.a is a and self.offs is offs and a._version == self.version and a.data_ptr() == self.ptr
                and offs._version == self.offs_version)

    def close(self) -> None:
        """Drop what only the forward reads (the input, its row-wise fp8); the backward's share stays."""
        self.a = self.offs = self.rows = None


class _TokenMemo:
    """The :class:`_SharedTokens` of the last input of the grouped GEMMs of one active :class:`Fp8GroupedMMMode`,
    found by identity, version counter and data pointer (an in-place op makes a new one; the mode forgets it on any
    ``.data`` access, which can change values without a version bump). A GEMM of another input replaces it; its
    owner closes it (:meth:`Fp8GroupedMMMode.forget_inputs`, which a converted experts forward calls at its end)."""

    def __init__(self):
        self.last: Optional[_SharedTokens] = None

    def find(self, a, offs) -> Optional[_SharedTokens]:
        """The entry of ``a`` and ``offs``, or None."""
        e = self.last
        return e if e is not None and e.matches(a, offs) else None

    def add(self, a, offs, rows) -> _SharedTokens:
        """A new entry for ``a`` and ``offs`` with their row-wise fp8 ``rows``, replacing the last one."""
        self.forget()
        self.last = _SharedTokens(a, offs, rows)
        return self.last

    def forget(self) -> None:
        """Close and drop the entry."""
        if self.last is not None:
            self.last.close()
            self.last = None


class _Fp8GroupedMM(torch.autograd.Function):
    """``torch._grouped_mm(a, b, offs)`` (2-D x 3-D) with fp8 GEMMs per the recipe."""

    @staticmethod
    def forward(ctx, a, b, offs, recipe: Recipe, out_dtype, grad_on: bool = True,
                tokens: Optional[_TokenMemo] = None):
        E, K, N = b.shape
        M = a.shape[0]
        w, fp8 = _weight_parts(b)
        if fp8 is None:
            wq, ws = _quantize_rows(w, recipe.float8_dtype)  # (E, N, K), (E, N, 1)
            ws = ws.reshape(E, N)
        else:
            wq, ws = fp8
        # (grad_on: grad mode where the op was called, off inside forward; without it no backward takes a share)
        gw_fp8 = grad_on and ctx.needs_input_grad[1] and recipe.grad_weight_fp8
        shared = None if tokens is None else tokens.find(a, offs)
        if shared is not None:
            aq, as_ = shared.rows  # (quantized by an earlier GEMM of this forward)
        else:
            aq, as_ = _quantize_rows(a, E4M3)
            if tokens is not None:
                shared = tokens.add(a, offs, (aq, as_))
        ctx.shared = shared if gw_fp8 else None
        if ctx.shared is not None:
            shared.pending += 1  # (backwards still to take its column quantization)
        out = grouped_2d3d(aq, as_.reshape(M), wq.transpose(-2, -1), ws, offs, out_dtype,
                           fast_accum=recipe.fast_accum_forward)
        ctx.recipe = recipe
        ctx.a_dtype, ctx.b_dtype = a.dtype, b.dtype
        gi = ctx.needs_input_grad[0]
        # a high-precision weight's row scales (E, N): grad_input re-casts the weight with them (the forward's bits)
        ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, b if gi else None, offs,
                              ws if gi and fp8 is None else None)
        return out

    @staticmethod
    def backward(ctx, gy):
        dev = gy.device.type
        if autocast_enabled(dev) or (compat.is_compiling() and dev in _AUTOCAST_TYPES):
            # backward() called inside an autocast block (CPU autograd runs in the caller's thread), or traced
            # (torch.compile traces the backward under the autocast state around the compiled call, whatever dynamo
            # saw when it traced this backward): autocast off, as in the forward (autocast would cast
            # torch._scaled_mm's float32 scales, and the traced GEMMs' dequantized operands, to its dtype)
            with torch.autocast(dev, enabled=False):
                return _Fp8GroupedMM._backward(ctx, gy)
        return _Fp8GroupedMM._backward(ctx, gy)

    @staticmethod
    def _backward(ctx, gy):
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "fp8_grouped_mm: double backward (create_graph=True) is not supported: the fp8 gradient GEMMs are "
                "not differentiable")
        a, b, offs, ws_hp = ctx.saved_tensors
        recipe: Recipe = ctx.recipe
        gy = gy.contiguous()
        M, N = gy.shape
        E = offs.numel()
        fast_gi = recipe.grouped_fast_accum or recipe.grad_input.fast_accum
        fast_gw = recipe.grouped_fast_accum or recipe.grad_weight.fast_accum
        grad_a = grad_b = None
        gw_fp8 = ctx.needs_input_grad[1] and recipe.grad_weight_fp8
        shared = getattr(ctx, "shared", None)
        if ctx.needs_input_grad[0]:
            w, fp8 = _weight_parts(b)
            K = b.shape[1]
            # scale folding: gy[e] @ (diag(s_e) W8_e) = (gy[e] diag(s_e)) @ W8_e, the product in the row kernel; W8
            # the forward's fp8 weight (E, K, N) column-major: a stored one transposed, a high-precision one cast
            # again with the forward's row scales (the same bits, one pass: no column amax)
            if fp8 is None:
                ws = ws_hp
                wq_t = cast_rows_t_after(w.contiguous(), ws, gy, recipe.float8_dtype)
            else:
                w8, ws = fp8
                wq_t = transpose_after(w8, gy)  # one tiled kernel on CUDA, in the backward graph
            ws_t = torch.ones(E, K, dtype=torch.float32, device=gy.device)
            if E:
                gq, gs = quantize(gy, -1, E4M3, col_scale=ws.contiguous(), col_scale_ends=offs)
            else:
                gq, gs = _quantize_rows(gy.to(torch.float32), E4M3)
            grad_a = grouped_2d3d(gq, gs.reshape(M), wq_t.transpose(-2, -1), ws_t, offs, ctx.a_dtype,
                                  fast_accum=fast_gi)
        if ctx.needs_input_grad[1]:
            if gw_fp8:
                M_pad, pad_ends, pad_starts = padded_offsets(offs, M)
                gq_t, gs = quantize_group_cols(gy, offs, M_pad, pad_starts, E4M3)
                if shared is not None and shared.cols is not None:  # (another backward of this input made them)
                    xq_t, xs = shared.cols
                else:
                    xq_t, xs = quantize_group_cols(a.contiguous(), offs, M_pad, pad_starts, E4M3)
                if shared is not None:  # kept for the input's other backwards, dropped by the last
                    shared.pending -= 1
                    shared.cols = (xq_t, xs) if shared.pending > 0 else None
                grad_w = grouped_2d2d(gq_t, gs, xq_t, xs, pad_ends, torch.promote_types(gy.dtype, a.dtype),
                                      fast_accum=fast_gw)
            else:
                dt = torch.promote_types(gy.dtype, a.dtype)
                grad_w = _grouped_hp_weight_grad(gy.to(dt), a.to(dt), offs, E)
            grad_b = grad_w.transpose(-2, -1).to(ctx.b_dtype)
        return grad_a, grad_b, None, None, None, None, None


def fp8_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, *, recipe="rowwise",
                   out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """fp8 ``torch._grouped_mm(a, b, offs=offs)`` ``(M, N)`` for expert weights: row-wise scaled fp8 output,
    grad_input and grad_weight GEMMs (operand scalings: docs/moe.md, "Recipes and numerics").

    Args:
        a: ``(M, K)`` high-precision tokens sorted by expert (plain tensor).
        b: ``(E, K, N)`` expert weights, the ``transpose(-2, -1)`` of ``(E, N, K)`` ones: a plain high-precision
            tensor, an :class:`~fp8tensor.Fp8MasterWeight` or a :class:`ScaledFp8Tensor` (used as stored).
        offs: int32 ``(E,)`` cumulative ends of the token groups (any sizes including 0; rows past ``offs[-1]``
            belong to no expert).
        recipe: ``"rowwise"``, ``"rowwise_gw_hp"`` or a :class:`Recipe`.
        out_dtype: the output dtype (default: the promoted dtype of ``a`` and ``b``; CUDA fp8 GEMMs write bf16).

    Raises:
        ValueError: wrong ranks or shapes, unknown recipe, ``offs`` with another number of groups than experts, or
            (on CPU, eager) decreasing offsets or offsets outside ``[0, M]``.
        TypeError: ``offs`` not int32, an fp8 or non-float input or ``out_dtype``.
        RuntimeError: operands on different devices; (on CPU, in a compiled or exported graph, when it runs) the
            offsets check above (``torch._assert_async``).
        NotImplementedError: double backward.
    """
    return _grouped_mm_call(a, b, offs, recipe, out_dtype, None)


def _grouped_mm_call(a, b, offs, recipe, out_dtype, tokens: Optional[_TokenMemo]) -> torch.Tensor:
    """:func:`fp8_grouped_mm`; ``tokens``: the memo of the :class:`Fp8GroupedMMMode` it runs under (eager, plain
    tensors: inputs quantized once per forward), else None."""
    op = "fp8_grouped_mm"
    r = get_recipe(recipe)
    if tokens is not None and (compat.is_traced(a) or type(a) is not torch.Tensor or type(offs) is not torch.Tensor
                               or compat.dispatch_modes_active() or torch.is_inference_mode_enabled()
                               or a.is_inference() or offs.is_inference()):
        tokens = None  # (inference tensors have no version counter)
    grad_on = torch.is_grad_enabled()
    if compat.is_compiling():
        read_traced_settings()  # (dynamo guards on them: a later change recompiles)
    _check(a, b, offs, op)
    bd = b._data if isinstance(b, QuantizeOnUse) else b
    if out_dtype is None:
        out_dtype = torch.promote_types(a.dtype, bd.dtype)
    elif not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point or out_dtype in FLOAT8_DTYPES:
        raise TypeError(f"{op}: out_dtype must be a high-precision floating-point dtype (bfloat16, float16, "
                        f"float32), got {out_dtype}")
    if compat.is_exporting() and isinstance(b, QuantizeOnUse):
        return _exported_master_grouped_mm(a, b, offs, out_dtype)
    if autocast_enabled(a.device.type):
        # the operands as they are, the fp8 GEMMs with autocast off (it would cast their float32 scales)
        with torch.autocast(a.device.type, enabled=False):
            return _Fp8GroupedMM.apply(a, b, offs, r, out_dtype, grad_on, tokens)
    return _Fp8GroupedMM.apply(a, b, offs, r, out_dtype, grad_on, tokens)


def _exported_master_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                                out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`fp8_grouped_mm` of a master weight ``b`` as ``torch.export`` traces it: ``torch._grouped_mm`` applied to
    the master itself (below ``__torch_function__``), whose op table quantizes it per expert row when the program
    runs, as the Linear's master ``mm`` (:func:`fp8tensor.linear._exported_forward`). Strict export would otherwise
    trace the Function's read of the master's data into a constant of the program (a fake tensor), not the
    parameter. Without grad mode: an exported program has no backward."""
    with torch.no_grad(), compat.disable_torch_function():
        return torch._grouped_mm(a, b, offs=offs, out_dtype=out_dtype)


def grouped_mm_args(args, kwargs):
    """``(a, b, offs, bias, out_dtype)`` of a ``torch._grouped_mm`` / ``F.grouped_mm`` / ``aten._grouped_mm`` call."""
    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    vals = dict(zip(names, args))
    for k, v in kwargs.items():
        vals[{"self": "mat_a", "input": "mat_a", "mat2": "mat_b"}.get(k, k)] = v
    return tuple(vals.get(n) for n in names)


# ---------------------------------------------------------------------------------------------- op table
@implements([torch.ops.aten._grouped_mm.default])
def _grouped_mm_fp8(func, args, kwargs):
    """``aten._grouped_mm`` with a :class:`ScaledFp8Tensor` operand: 2-D x 3-D row-scaled in fp8, else dequantized."""
    a, b, offs, bias, out_dtype = grouped_mm_args(args, kwargs)
    if (not isinstance(a, ScaledFp8Tensor) and isinstance(b, ScaledFp8Tensor) and a.dim() == 2 and b.dim() == 3
            and bias is None and offs is not None):
        _, fp8 = _weight_parts(b)
        if fp8 is not None:
            E, K, N = b.shape
            _check(a, b, offs, "aten._grouped_mm")
            aq, as_ = _quantize_rows(a, E4M3)
            od = out_dtype or torch.promote_types(a.dtype, b.dtype)
            return grouped_2d3d(aq, as_.reshape(-1), fp8[0].transpose(-2, -1), fp8[1], offs, od, fast_accum=True)
    a, b = (t.to_hp() if isinstance(t, ScaledFp8Tensor) else t for t in (a, b))
    return func(a, b, offs, bias, out_dtype)


# ---------------------------------------------------------------------------------------------- modules
_GROUPED_FUNCS = frozenset({torch._grouped_mm, getattr(torch.nn.functional, "grouped_mm", torch._grouped_mm)})
#: Dtype casts of a master inside a grouped-experts forward, and the dtype of each fixed one.
_CAST_DTYPES = ((torch.Tensor.bfloat16, torch.bfloat16), (torch.Tensor.half, torch.float16),
                (torch.Tensor.float, torch.float32))
_CASTS = frozenset({torch.Tensor.to, torch.Tensor.type_as, *(f for f, _ in _CAST_DTYPES)})
#: ``t.data`` and ``t.data = ...`` as a torch function mode sees them.
_DATA_ACCESS = frozenset({torch.Tensor.data.__get__, torch.Tensor.data.__set__})


def is_grouped_mm(func) -> bool:
    """Whether ``func`` is ``torch._grouped_mm`` or ``torch.nn.functional.grouped_mm``."""
    return func in _GROUPED_FUNCS


def fp8_weight_call(args, kwargs, recipe=None) -> Optional[tuple]:
    """``(a, b, offs, out_dtype, recipe)`` when this ``torch._grouped_mm`` call should run :func:`fp8_grouped_mm`
    (plain 2-D tokens, 3-D master or ScaledFp8Tensor weights, no bias; a master's recipe wins), else None."""
    a, b, offs, bias, out_dtype = grouped_mm_args(args, kwargs)
    if bias is not None or offs is None or not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None
    if isinstance(a, (ScaledFp8Tensor, QuantizeOnUse)) or a.dim() != 2 or b.dim() != 3:
        return None
    if isinstance(b, QuantizeOnUse):
        return a, b, offs, out_dtype, b.recipe
    if isinstance(b, ScaledFp8Tensor):
        return a, b, offs, out_dtype, recipe or "rowwise"
    return None


class _CastMaster(torch.autograd.Function):
    """``master.to(dtype)`` as a master of ``dtype`` (its gradient cast back)."""

    @staticmethod
    def forward(ctx, m, dtype):
        ctx.dtype = m.dtype
        return type(m)(m._data.to(dtype), m.recipe)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.dtype), None


def _cast_target(func, args, kwargs) -> Optional[torch.dtype]:
    """The dtype a cast call on a master converts to, when it only changes the (floating) dtype; else None."""
    for f, dtype in _CAST_DTYPES:
        if func is f:
            return dtype
    if func is torch.Tensor.type_as:
        other = args[1] if len(args) > 1 else kwargs.get("other")
        return other.dtype if isinstance(other, torch.Tensor) and other.device == args[0].device else None
    try:
        device, dtype, _, memory_format = compat.parse_to(*args[1:], **kwargs)
    except Exception:
        return None
    if dtype is None or (device is not None and torch.device(device) != args[0].device):
        return None
    return dtype


class Fp8GroupedMMMode(torch.overrides.TorchFunctionMode):
    """While active, ``torch._grouped_mm`` / ``F.grouped_mm`` of 2-D tokens with 3-D master or ScaledFp8Tensor expert
    weights runs :func:`fp8_grouped_mm`, and a dtype cast of a master (``w.bfloat16()``) keeps it a master.
    Converted grouped-experts modules run their ``forward`` under it. ``recipe``: the recipe of ScaledFp8Tensor
    weights (a master uses its own).

    ``share_inputs=True`` (converted experts modules, one mode per forward call, :meth:`forget_inputs` at its end):
    in eager mode consecutive GEMMs that read the same input tensor (a SwiGLU's w1 and w3) quantize it once: its
    row-wise fp8 in the forward, its per-group column fp8 in the backward. The shared quantization is found by the
    input's identity, version counter and data pointer, so an in-place op in between makes a new one, and the mode
    forgets it on any ``.data`` access (values changed without a version bump). Writes through an alias with a
    version counter of its own (``set_`` on the input's storage, ``untyped_storage()``, DLPack or NumPy views, a raw
    pointer) are not seen. Off under ``torch.compile``, dispatch modes and inference mode; the backward's part lives
    until the last backward that takes it."""

    def __init__(self, recipe="rowwise", *, share_inputs: bool = False):
        super().__init__()
        self.recipe = get_recipe(recipe)
        # (dynamo supports graph breaks under a mode only with TorchFunctionMode's own __enter__ / __exit__: the
        # memo is made here and closed by its owner, forget_inputs)
        self._tokens: Optional[_TokenMemo] = _TokenMemo() if share_inputs else None

    def forget_inputs(self) -> None:
        """Drop the shared quantization of the last input (``share_inputs=True``; what a backward shares stays)."""
        tokens = getattr(self, "_tokens", None)
        if tokens is not None:
            tokens.forget()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tokens = getattr(self, "_tokens", None)
        if func in _DATA_ACCESS and tokens is not None:
            tokens.forget()  # (a .data alias can change values without a version bump)
        if func in _GROUPED_FUNCS:
            call = fp8_weight_call(args, kwargs, self.recipe)
            if call is not None:
                a, b, offs, out_dtype, recipe = call
                return _grouped_mm_call(a, b, offs, recipe, out_dtype, tokens)
        elif func in _CASTS and args and isinstance(args[0], QuantizeOnUse):
            dtype = _cast_target(func, args, kwargs)
            if dtype is not None and dtype.is_floating_point and dtype not in FLOAT8_DTYPES:
                m = args[0]
                return m if dtype == m.dtype else _CastMaster.apply(m, dtype)
        return func(*args, **kwargs)
