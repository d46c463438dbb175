"""Row-wise fp8 quantization: amax, scale and the saturating cast.

The only place where fp8 rounding happens. :func:`quantize` decides *how*: a Triton kernel of
:mod:`fp8tensor.kernels` (eager CUDA), the plain ops below (CPU, ``torch.compile``, other layouts), or the
``fp8tensor::quantize_dim0_t`` triton op (operands reduced over their outer dim, transposed as ``torch._scaled_mm``
wants). A scale layout given by an existing tensor goes through :func:`amax_to_scale` / :func:`cast_to_fp8`.

Scale convention (used everywhere in fp8tensor): ``scale`` is the *dequantization multiplier*, a float32
tensor with the same number of dims as the data, of size 1 on every dim it does not vary over::

    hp ≈ qdata.float() * scale            # scale broadcasts against qdata
    scale = amax(|x| over the scaled-over dim) / finfo(float8_dtype).max

A "row-wise" scale along dim ``d`` reduces over ``d`` (size 1 there) and is full-size on the other dims.
The method is the per-row ("axiswise") scaling of fp8 training recipes, e.g. Micikevicius et al., "FP8
Formats for Deep Learning" (2022) for the formats and PyTorch's ``torch._scaled_mm`` for the scale layout.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..core import compat
from ..core.settings import get_config
from . import kernels

__all__ = [
    "quantize", "quantize_group_cols", "quantize_expert_cols", "group_ids", "quantize_rows_into", "transpose_after",
    "cast_rows_t_after",
    "quantize_group", "quantize_dim0_t", "quantize_dim0_t_after", "after_dep", "quantize_tokens",
    "quantize_token_layouts", "decode_mm", "weight_only_mm",
    "FLOAT8_DTYPES", "E4M3", "E5M2", "check_float8_dtype", "amax_to_scale", "rowwise_scale", "cast_to_fp8",
    "quantize_rowwise",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
#: The fp8 formats supported for storage and GEMMs (OCP e4m3fn and e5m2).
FLOAT8_DTYPES = (E4M3, E5M2)

#: Smallest scale: float32's smallest normal number, 2^-126 (``scale = max(amax / fp8_max, SCALE_FLOOR)``): an all-zero
#: row dequantizes to zeros; rows with ``amax < fp8_max * 2^-126`` keep this fixed grid (lose relative precision, the
#: smallest flush to zero). Traced code spells it ``torch.finfo(torch.float32).tiny`` (a module-level float becomes a
#: symbolic input under ``dynamic=True``, docs/pytorch_issues.md).
SCALE_FLOOR = torch.finfo(torch.float32).tiny


def check_float8_dtype(float8_dtype: torch.dtype, op: str) -> None:
    """Raise ``TypeError`` naming ``op`` unless ``float8_dtype`` is ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``."""
    if float8_dtype not in FLOAT8_DTYPES:
        raise TypeError(f"{op}: unsupported float8 dtype {float8_dtype}; expected torch.float8_e4m3fn or "
                        "torch.float8_e5m2")


def amax_to_scale(amax: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """Turn an amax tensor (any shape, any float dtype) into a float32 dequantization scale.

    ``scale = max(amax / finfo(float8_dtype).max, 2^-126)``, computed in float32 (:data:`SCALE_FLOOR`). NaN/inf
    amax propagate into the scale (torch.clamp keeps NaN: the row stays non-finite).
    """
    amax = amax.to(torch.float32)
    return torch.clamp(amax / torch.finfo(float8_dtype).max, min=torch.finfo(torch.float32).tiny)


def rowwise_scale(x: torch.Tensor, dim: int, float8_dtype: torch.dtype) -> torch.Tensor:
    """Float32 scale of ``x`` reduced over ``dim`` (kept with size 1): ``amax(|x|, dim) / fp8_max``.

    An empty ``dim`` (a ``[7, 0]`` tensor) has amax 0, as an all-zero row: the floor scale."""
    return amax_to_scale(_amax(x, dim), float8_dtype)


def _amax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Float32 ``amax(|x|)`` over ``dim`` (kept with size 1); 0 over an empty ``dim``."""
    if x.shape[dim] == 0:
        shape = list(x.shape)
        shape[dim] = 1
        return x.new_zeros(shape, dtype=torch.float32)
    return torch.amax(torch.abs(x), dim=dim, keepdim=True).to(torch.float32)


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast ``x / scale`` to ``float8_dtype`` (computed in float32; ``scale`` broadcasts).

    Values beyond the format's finite range are clamped to ±max; NaN stays NaN (e4m3fn and e5m2 both have
    NaN encodings), so a non-finite row remains non-finite after dequantization.
    """
    fmax = torch.finfo(float8_dtype).max
    y = x.to(torch.float32) / scale
    return torch.clamp(y, min=-fmax, max=fmax).to(float8_dtype)


def quantize(x: torch.Tensor, dim: int = -1, float8_dtype: torch.dtype = E4M3, *, gemm_layout: bool = False,
             col_scale: Optional[torch.Tensor] = None,
             col_scale_ends: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantization entry point: ``(qdata, scale)`` of ``x`` with one scale per slice reduced over ``dim``.

    Which code runs (the values follow the scale convention of this module in every case):

    1. ``gemm_layout=True``, ``x`` a 2-D CUDA tensor whose ``dim`` is its outer (strided) dim and
       :func:`fp8tensor.kernels.kernel_available`: the ``fp8tensor::quantize_dim0_t`` triton op (eager: its kernels
       launched directly); ``qdata`` is a transposed view of a contiguous tensor (column-major, as
       ``torch._scaled_mm`` wants its second operand).
    2. ``dim`` is the last dim and :func:`fp8tensor.kernels.row_kernel_available` (eager, contiguous CUDA): the fused
       row-wise Triton kernel (same bits as the ops).
    3. Otherwise (CPU, ``torch.compile``, other layouts): :func:`rowwise_scale` and :func:`cast_to_fp8`.

    ``col_scale`` (float32 ``(1, K)``; ``x`` 2-D, ``dim`` its last): quantizes ``x.float() * col_scale`` (an fp8
    weight's row scales folded in, ``(x diag(c)) @ B8``), in the kernel of case 2 without writing the product out.
    With ``col_scale_ends`` (int32 ``(G,)`` cumulative ends of groups of ``x``'s rows, as the ``offs`` of a grouped
    GEMM; ``G >= 1``), ``col_scale`` is float32 ``(G, K)`` and row ``m`` is multiplied by its group's row
    ``col_scale[g(m)]`` (rows past the last end by the last group's): expert weights' row scales folded into
    ``grad_out``, one expert per group, in the same kernel.

    Raises:
        TypeError: ``float8_dtype`` is not one of the supported fp8 formats.
    """
    check_float8_dtype(float8_dtype, "quantize_rowwise")
    if col_scale is not None:
        if (x.dim() == 2 and dim in (-1, 1) and x.is_cuda and kernels.row_kernel_available(x)
                and kernels.eager_launch_ok(col_scale) and col_scale.is_contiguous()
                and (col_scale_ends is None or (kernels.eager_launch_ok(col_scale_ends)
                                                and col_scale_ends.is_contiguous()))):
            return kernels.quantize_last_dim(x, float8_dtype, SCALE_FLOOR, checked=True,
                                             col_scale=col_scale.reshape(-1) if col_scale_ends is None else col_scale,
                                             col_scale_ends=col_scale_ends)
        if col_scale_ends is not None:
            G = col_scale_ends.numel()
            col_scale = col_scale[group_ids(col_scale_ends, x.shape[0]).clamp(max=G - 1)]
        x = x.to(torch.float32) * col_scale
    if x.is_cuda:
        if gemm_layout and x.dim() == 2 and not _inductor_quantizes(x):
            if dim % 2 == 0 and kernels.kernel_available(x):
                q, s = _dim0_t(x, float8_dtype)
                return q.t(), s.t()
            # (x.t() only where the kernels can take it: a unit row stride; a row-major weight has none)
            if dim % 2 == 1 and x.stride(0) == 1 and kernels.kernel_available(x.t()):
                return _dim0_t(x.t(), float8_dtype)
        if x.dim() and dim in (-1, x.dim() - 1) and kernels.row_kernel_available(x):
            return kernels.quantize_last_dim(x, float8_dtype, SCALE_FLOOR, checked=True)
    scale = rowwise_scale(x, dim, float8_dtype)
    return cast_to_fp8(x, scale, float8_dtype), scale


def quantize_group(xs, float8_dtype: torch.dtype = E4M3) -> list:
    """``[quantize(x, -1, float8_dtype) for x in xs]``, in one kernel launch when every ``x`` takes the row-wise kernel
    (eager CUDA, contiguous) and all share dtype and device; same values either way. Used by the FSDP2
    pre-all-gather to quantize a parameter group's master weights together.

    Raises:
        TypeError: ``float8_dtype`` is not one of the supported fp8 formats.
    """
    check_float8_dtype(float8_dtype, "quantize_group")
    xs = list(xs)
    if (len(xs) > 1 and kernels.HAS_TRITON and all(x.dtype == xs[0].dtype and x.device == xs[0].device for x in xs)
            and all(kernels.row_kernel_available(x) for x in xs)):
        return kernels.quantize_last_dim_group(xs, float8_dtype, SCALE_FLOOR)
    return [quantize(x, -1, float8_dtype) for x in xs]


def quantize_rowwise(x: torch.Tensor, dim: int = -1, float8_dtype: torch.dtype = E4M3
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with one scale per slice reduced over ``dim`` (:func:`quantize` with ``qdata`` in ``x``'s layout).

    Args:
        x: floating-point tensor of any shape (fp32, bf16, fp16, fp64).
        dim: the dim the amax is taken over (the GEMM's contraction dim for a GEMM operand).
        float8_dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.

    Returns:
        ``(qdata, scale)``: ``qdata`` has ``x``'s shape and ``float8_dtype``; ``scale`` is float32 with
        ``x.ndim`` dims, size 1 on ``dim``, such that ``qdata.float() * scale ≈ x``.

    Raises:
        TypeError: ``float8_dtype`` is not one of the supported fp8 formats.
    """
    return quantize(x, dim, float8_dtype)


# ---------------------------------------------------------------------------------------------- dim-0 triton op
def _inductor_quantizes(x: torch.Tensor) -> bool:
    """Whether a traced graph quantizes the token-dim operand ``x`` as plain ops for inductor to fuse
    (``compiled_quantization="inductor"``) instead of fp8tensor's kernels; traced includes the op table's code that
    AOTAutograd runs below the subclass (:func:`fp8tensor.compat.is_traced`)."""
    return get_config().compiled_quantization == "inductor" and compat.is_traced(x)


def _reference_dim0_t(x: torch.Tensor, float8_dtype: torch.dtype):
    K = x.shape[-1]
    q, s = quantize_rowwise(x.reshape(math.prod(x.shape[:-1]), K).t(), dim=-1, float8_dtype=float8_dtype)
    return q.contiguous(), s


def _dim0_t_body(x: torch.Tensor, float8_dtype: torch.dtype, traced: bool = True):
    if not kernels.kernel_available(x):
        return _reference_dim0_t(x, float8_dtype)
    return kernels.launch_dim0_t(x, float8_dtype, SCALE_FLOOR, traced=traced)


# triton ops (compiled graphs launch the kernels inline); CPU-only builds have no kernels to expose
_register_op = torch.library.triton_op if kernels.HAS_TRITON else torch.library.custom_op


@_register_op("fp8tensor::quantize_dim0_t", mutates_args=())
def quantize_dim0_t(x: torch.Tensor, float8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ``(M, K)`` (or ``(..., K)``, as ``x.reshape(M, K)``) along dim 0 and return it transposed.

    The Triton kernels of :mod:`fp8tensor.kernels` where they take ``x`` (CUDA, row-major), else the plain ops
    (:func:`quantize_rowwise` of ``x.T``). A ``triton_op``: under ``torch.compile`` inductor launches its kernels
    from the generated code (no Python per call).

    Returns:
        ``(q, scale)``: ``q`` is ``(K, M)`` row-major ``float8_dtype`` holding ``x.T`` quantized row-wise,
        ``scale`` is ``(K, 1)`` float32 (dequantization multiplier), i.e. ``q.float() * scale ≈ x.T``.
    """
    return _dim0_t_body(x, float8_dtype)


@_register_op("fp8tensor::quantize_dim0_t_shared", mutates_args=())
def _quantize_dim0_t_shared(x: torch.Tensor, float8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # quantize_dim0_t whose results a compiled graph may share between calls on the same data (_trace_memo)
    memo, key, inner = _trace_memo(x, float8_dtype)
    if memo is not None:
        hit = memo.get(key)
        if hit is not None:
            return hit[1]
    out = _dim0_t_body(x, float8_dtype)
    if memo is not None:
        memo[key] = (inner, out)  # inner: keeps the storage of the key alive (its address is not reused)
    return out


def _trace_memo(x: torch.Tensor, float8_dtype: torch.dtype):
    """``(memo, key, inner)`` while ``torch.compile`` traces ``quantize_dim0_t_shared`` or ``quantize_both``, else
    ``(None,) * 3``: one fp8 copy per graph for Linears reading one input (inductor does not deduplicate triton-op kernels). ``key``: the
    functional tensor's data now (storage, offset, shape, strides); the memo lives on the tracer (one graph)."""
    found = compat.functional_data(x)
    if found is None:
        return None, None, None
    tracer, inner, storage = found
    dims = (*inner.shape, *inner.stride(), inner.storage_offset())
    if not all(type(d) is int for d in dims):  # SymInts: not hashable, and their values are not known
        return None, None, None
    key = (storage, dims, inner.dim(), x.dtype, float8_dtype)
    return tracer.__dict__.setdefault("_fp8tensor_dim0_memo", {}), key, inner


def quantize_tokens(x: torch.Tensor, float8_dtype: torch.dtype = E4M3):
    """``x`` ``(..., K)`` quantized per feature over all its tokens in the GEMM layout, from ``x`` itself (under
    ``torch.compile`` a reshaped view would be written out per kernel argument), or None where the dim-0 kernels do
    not take ``x``: the caller then uses :func:`quantize` on ``x.reshape(-1, K)`` (same values). A compiled graph may
    return the *same* tensors for two calls on the same data (``_trace_memo``): treat them as read-only.

    Returns:
        ``(q, scale)``: ``q`` ``(M, K)`` float8, a transposed view of a row-major ``(K, M)`` tensor (column-major, as
        ``torch._scaled_mm`` wants its second operand); ``scale`` ``(1, K)`` float32, ``q.float() * scale ≈
        x.reshape(-1, K)``. Same bits as ``quantize(x.reshape(-1, K), 0, float8_dtype, gemm_layout=True)``.
    """
    if (not (x.is_cuda and kernels.kernel_available(x) and (x.dim() == 2 or x.is_contiguous()))
            or _inductor_quantizes(x)):
        return None
    q, s = _dim0_t(x, float8_dtype, shared=True)
    return q.t(), s.t()


def _both_body(x: torch.Tensor, float8_dtype: torch.dtype):
    if not kernels.both_kernels_available(x):
        K = x.shape[-1]
        return (*quantize(x.reshape(-1, K), -1, float8_dtype), *_reference_dim0_t(x, float8_dtype))
    return kernels.launch_both(x, float8_dtype, SCALE_FLOOR, traced=True)


@_register_op("fp8tensor::quantize_both", mutates_args=())
def _quantize_both(x: torch.Tensor, float8_dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # quantize_token_layouts' op; results shared within a compiled graph as quantize_dim0_t_shared's. (The row amax
    # by plain ops, for inductor to fuse into x's producer, measured slower: its reductions slowed those kernels.)
    memo, key, inner = _trace_memo(x, float8_dtype)
    key = key and ("both", key)
    if memo is not None and key in memo:
        return memo[key][1]
    out = _both_body(x, float8_dtype)
    if memo is not None:
        memo[key] = (inner, out)
    return out


def quantize_token_layouts(x: torch.Tensor, float8_dtype: torch.dtype = E4M3):
    """``x`` ``(..., K)`` as ``(M, K)`` quantized both ways a Linear uses a token-major operand, from two reads of
    ``x``: per row (the ``a`` operand of ``torch._scaled_mm``) and per feature over all tokens (the grad_weight
    operand). None where the kernels do not take ``x`` (CPU, other layouts, ``compiled_quantization="inductor"``):
    then use :func:`quantize` and :func:`quantize_tokens` (same values). Shared within a compiled graph like
    :func:`quantize_tokens`' results: treat them as read-only.

    Returns:
        ``(q, s, qt, st)``: ``q`` ``(M, K)`` row-major float8 with ``s`` ``(M, 1)`` float32 (per row, as
        ``quantize(x.reshape(-1, K), -1)``), and ``qt`` ``(M, K)``, a transposed view of a row-major ``(K, M)``
        tensor, with ``st`` ``(1, K)`` (:func:`quantize_tokens`); equal scales, fp8 values equal to theirs except
        at or next to rounding ties (``x`` times the scale's reciprocal, within an fp32 ulp of ``x / scale``).

    Raises:
        TypeError: ``float8_dtype`` is not one of the supported fp8 formats.
    """
    check_float8_dtype(float8_dtype, "quantize_token_layouts")
    if (not (x.is_cuda and kernels.both_kernels_available(x) and (x.dim() == 2 or x.is_contiguous()))
            or _inductor_quantizes(x)):
        return None
    if kernels.eager_launch_ok(x) and not (x.requires_grad and torch.is_grad_enabled()):
        q, s, qt, st = kernels.launch_both(x, float8_dtype, SCALE_FLOOR)
    else:
        q, s, qt, st = torch.ops.fp8tensor.quantize_both(x, float8_dtype)
    return q, s, qt.t(), st.t()


def _dim0_t(x: torch.Tensor, float8_dtype: torch.dtype, *, shared: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_dim0_t` of a CUDA ``x`` the kernels take: launched directly in eager mode, else through the
    op (``shared``: ``quantize_dim0_t_shared``, whose results a compiled graph may share)."""
    if kernels.eager_launch_ok(x) and not (x.requires_grad and torch.is_grad_enabled()):
        return kernels.launch_dim0_t(x, float8_dtype, SCALE_FLOOR)
    if shared:
        return torch.ops.fp8tensor.quantize_dim0_t_shared(x, float8_dtype)
    return torch.ops.fp8tensor.quantize_dim0_t(x, float8_dtype)


# ---------------------------------------------------------------------------------------------- both layouts
#: The library of fp8tensor's opaque ops (a schema and one Python kernel for every backend: ``custom_op``'s wrappers
#: cost more than these ops' launches, run once per Linear in every compiled backward).
_LIB = torch.library.Library("fp8tensor", "FRAGMENT")


def _quantize_columns_after_impl(w: torch.Tensor, after: torch.Tensor, float8_dtype: torch.dtype
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return _dim0_t_body(w, float8_dtype, traced=False)  # quantize_dim0_t(w), eagerly; `after` is not read


_LIB.define("quantize_columns_after(Tensor w, Tensor after, ScalarType float8_dtype) -> (Tensor, Tensor)")
_LIB.impl("quantize_columns_after", _quantize_columns_after_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("fp8tensor::quantize_columns_after", lib=_LIB)
def _(w, after, float8_dtype):
    N, K = w.shape
    return w.new_empty(K, N, dtype=float8_dtype), w.new_empty(K, 1, dtype=torch.float32)


def after_dep(after: torch.Tensor) -> torch.Tensor:
    """A float32 ``(1,)`` +0.0 computed from one element of ``after`` (a view: nothing written out): a traced op
    reading it runs after ``after`` exists, which keeps a weight's backward operand in the backward graph."""
    first = after[(slice(0, 1),) * after.dim()]  # (1, ..., 1), a view
    if after.numel() == 0:
        return after.float().sum().reshape(1)  # 0.0 (NaN and inf are impossible: nothing is summed)
    return torch.nan_to_num((first.reshape(1).float() * 0.0).abs(), nan=0.0)  # +0.0 for NaN / inf entries too


def _dim0_t_dep_plain(w: torch.Tensor, dep: torch.Tensor, float8_dtype: torch.dtype):
    # _reference_dim0_t(w) with the column amax also max-ed with dep (+0.0: amax >= +0.0 or NaN, unchanged).
    x = w.t()
    scale = amax_to_scale(torch.maximum(_amax(x, -1), dep.reshape(1, 1)), float8_dtype)
    return cast_to_fp8(x, scale, float8_dtype).contiguous(), scale


def quantize_dim0_t_after(w: torch.Tensor, after: torch.Tensor, float8_dtype: torch.dtype = E4M3
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_dim0_t` of ``w`` ``(N, K)`` — ``(K, N)`` row-major fp8, ``(K, 1)`` float32 scales — ordered
    after ``after`` when traced (a master's grad_input operand, else hoisted into the forward and kept). Eager: direct;
    under a mode: the op ``fp8tensor::quantize_columns_after``; compiled: plain ops reading :func:`after_dep`."""
    if (kernels.eager_launch_ok(w) and kernels.eager_launch_ok(after)
            and not (w.requires_grad and torch.is_grad_enabled())):
        return _quantize_columns_after_impl(w, after, float8_dtype)  # eager: the op's body, no dispatcher trip
    if kernels.kernel_available(w) and not compat.is_compiling():
        return torch.ops.fp8tensor.quantize_columns_after(w, after, float8_dtype)
    return _dim0_t_dep_plain(w, after_dep(after), float8_dtype)


if not kernels.HAS_TRITON:  # a triton_op is its own fake kernel; the plain custom op needs one

    def _dim0_fake(x, float8_dtype):
        K = x.shape[-1]
        return x.new_empty(K, math.prod(x.shape[:-1]), dtype=float8_dtype), x.new_empty(K, 1, dtype=torch.float32)

    quantize_dim0_t.register_fake(_dim0_fake)
    _quantize_dim0_t_shared.register_fake(_dim0_fake)

    @_quantize_both.register_fake
    def _(x, float8_dtype):
        K = x.shape[-1]
        M = math.prod(x.shape[:-1])
        return (x.new_empty(M, K, dtype=float8_dtype), x.new_empty(M, 1, dtype=torch.float32),
                *_dim0_fake(x, float8_dtype))


# ---------------------------------------------------------------------------------------------- small-M GEMM
def decode_mm(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
              bias: Optional[torch.Tensor] = None, *, fp8_x: bool = True) -> Optional[torch.Tensor]:
    """``x @ (w8 * scale).T + bias`` ``(..., N)`` in ``x``'s dtype for a decode-sized ``x`` ``(..., K)`` (bf16 / fp16,
    CUDA with Triton): the no-grad Linear's decode route, by the small-M fp8-weight GEMM of
    :mod:`fp8tensor.kernels`, split over K where cuBLAS's row-scaled fp8 GEMM is not. None where it does not run
    (``kernels.w8_mm_available``), and the caller takes the ordinary fp8 Linear.

    * Up to ``W8_MM_CONFIG["max_m"]`` (16) rows: weight-only. ``x`` stays in its precision and the fp8 weight is
      widened in registers (exact), so the only rounding is the output's; the GEMM reads the weight once.
    * Up to ``W8_MM_CONFIG["max_m_fp8x"]`` (64) rows, e4m3 weights and ``fp8_x`` (the caller's recipe quantizes
      ``x`` for this GEMM): ``x`` quantized per row to e4m3 (as the ordinary fp8 Linear quantizes it) and the dot
      fp8 x fp8, the sum over K times each row's scale.

    ``w8`` ``(N, K)`` fp8, ``scale`` ``(N, 1)`` float32, ``bias`` ``(N,)`` of ``x``'s dtype (a bias of another dtype
    promotes the output, as the other routes' ``out + bias`` does: None here). The row limits are measured
    crossovers (:data:`fp8tensor.kernels.W8_MM_CONFIG`). Float32 accumulation; scale and bias applied in float32
    before the one rounding; fixed summation order (deterministic). Eager: direct launches (the row quantization,
    then the kernel, which adds a K split's slices itself, or under CUDA graph capture the kernel and its reduce
    launch: the same bits); traced: the ``triton_op`` ``fp8tensor::w8_mm`` (or
    ``fp8tensor::w8_mm_fp8x`` after the quantization's plain ops, which inductor fuses into ``x``'s producer), whose
    traced body adds a K split's partial sums in the graph."""
    if not (kernels.w8_mm_available(x, w8) and scale.dtype == torch.float32 and scale.shape == (w8.shape[0], 1)
            and scale.device == x.device
            and (bias is None or (bias.dim() == 1 and bias.shape[0] == w8.shape[0] and bias.dtype == x.dtype
                                  and bias.device == x.device))):  # (another dtype: promoted by ``out + bias``)
        return None
    K = x.shape[-1]
    M = x.shape[0] if x.dim() == 2 else math.prod(x.shape[:-1])
    plain = kernels.PLAIN_TYPES  # (a bias is usually an nn.Parameter)
    eager = (type(w8) in plain and type(scale) in plain and (bias is None or type(bias) in plain)
             and kernels.eager_launch_ok(x))
    if M <= kernels.W8_MM_CONFIG["max_m"]:
        if eager:
            return kernels.launch_w8_mm(x, w8, scale.contiguous(), None if bias is None else bias.contiguous())
        if x.dim() == 2:
            return torch.ops.fp8tensor.w8_mm(x, w8, scale, bias)
        return torch.ops.fp8tensor.w8_mm(x.reshape(-1, K), w8, scale, bias).view(*x.shape[:-1], w8.shape[0])
    if not fp8_x:
        return None
    x2 = x if x.dim() == 2 else x.reshape(-1, K)
    xq, xs = quantize(x2, -1, E4M3)  # (eager: the row kernel; traced: plain ops for inductor to fuse)
    if eager:
        out = kernels.launch_w8_mm(xq, w8, scale.contiguous(), None if bias is None else bias.contiguous(),
                                   x_scale=xs, out_dtype=x.dtype)
    else:
        out = torch.ops.fp8tensor.w8_mm_fp8x(xq, xs, w8, scale, bias, x.dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], w8.shape[0])


#: The former name of :func:`decode_mm` (weight-only up to 16 rows; the fp8 x form beyond).
weight_only_mm = decode_mm


def _w8_mm_epilogue(partials: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                    dtype: torch.dtype, x_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The decode GEMM's output from its K split's float32 partial sums ``(split, M, N)`` (traced): added in slice
    order, times an fp8 x's row scales ``x_scale`` ``(M, 1)`` if given, times the weight's row scales, plus the
    bias, in float32, rounded once to ``dtype`` (the reduce kernel's operations in its order). Plain ops, which inductor fuses into the output's consumer where it can; a
    fused consumer reads the float32 value before that rounding (inductor's treatment of a cast between fused ops,
    as in any compiled bf16 model), so a compiled model's later layers may differ from eager's by bf16 roundings."""
    acc = partials[0]
    for s in range(1, partials.shape[0]):
        acc = acc + partials[s]
    if x_scale is not None:  # an fp8 x's row scales (M, 1), after the sum as the reduce kernel applies them
        acc = acc * x_scale
    acc = acc * scale.reshape(1, -1)
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(dtype)


if kernels.HAS_TRITON:

    @torch.library.triton_op("fp8tensor::w8_mm", mutates_args=())
    def _w8_mm_op(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
                  bias: Optional[torch.Tensor]) -> torch.Tensor:
        # decode_mm's weight-only form under torch.compile (and under a mode, vmap or a subclass). Traced (AOTAutograd traces a
        # triton_op's body into the graph) with a K split: the kernel's partial sums and their epilogue as plain ops,
        # which inductor fuses into the output's consumer instead of a reduce launch. (Decided here, at AOT time:
        # dynamo would guard on the launch-plan memo.)
        if (compat.is_traced(x) and x.dim() == 2 and 1 <= int(x.shape[0]) <= kernels.W8_MAX_M and w8.shape[0] > 0
                and kernels.w8_mm_split(int(x.shape[0]), int(w8.shape[0]), int(x.shape[1]), x.device) > 1):
            return _w8_mm_epilogue(kernels.launch_w8_mm_partials(x, w8, traced=True), scale, bias, x.dtype)
        return kernels.launch_w8_mm(x, w8, scale.contiguous(), None if bias is None else bias.contiguous(),
                                    traced=True)

    @torch.library.triton_op("fp8tensor::w8_mm_fp8x", mutates_args=())
    def _w8_mm_fp8x_op(xq: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
                       bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
        # decode_mm's fp8 x form under torch.compile (and under a mode, vmap or a subclass): xq (M, K) fp8 with row
        # scales xs (M, 1); traced with a K split, the kernel's partial sums (each row's times its scale) and the
        # epilogue as plain ops, as fp8tensor::w8_mm.
        xs = xs.contiguous()
        if (compat.is_traced(xq) and 1 <= int(xq.shape[0]) <= kernels.W8_MAX_M and w8.shape[0] > 0
                and kernels.w8_mm_split(int(xq.shape[0]), int(w8.shape[0]), int(xq.shape[1]), xq.device) > 1):
            return _w8_mm_epilogue(kernels.launch_w8_mm_partials(xq, w8, traced=True), scale, bias, out_dtype,
                                   x_scale=xs)
        return kernels.launch_w8_mm(xq, w8, scale.contiguous(), None if bias is None else bias.contiguous(),
                                    traced=True, x_scale=xs, out_dtype=out_dtype)


# ---------------------------------------------------------------------------------------------- grouped (MoE) layouts
def group_ids(offs: torch.Tensor, M: int) -> torch.Tensor:
    """The group of each token row (int64 ``(M,)``; ``E`` for rows past ``offs[-1]``)."""
    rows = torch.arange(M, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, rows, right=True)


def quantize_group_cols(x: torch.Tensor, offs: torch.Tensor, M_pad: int, pad_starts: torch.Tensor,
                        float8_dtype: torch.dtype = E4M3, *, align: int = 16):
    """``x`` ``(M, C)`` quantized per column over each token group, transposed into the padded token layout.

    Args:
        x: ``(M, C)`` floating-point tensor (unit column stride on the Triton path).
        offs: int32 ``(E,)`` cumulative group ends.
        M_pad, pad_starts: from :func:`padded_offsets`.

    Returns:
        ``(q, scale)``: ``q`` ``(C, M_pad)`` row-major ``float8_dtype``, where group ``e``'s ``r``-th row is column
        ``pad_starts[e] + r`` (zeros in each group's padding — ``align`` zero columns for an empty group; on CUDA the
        columns past the last group's padding are unspecified, except for zeros in the spare block at the end in
        eager mode), and ``scale`` float32 ``(E, C)``:
        ``q[:, pad_starts[e] + r].float() * scale[e] ≈ x[offs[e-1] + r]``. A group of no rows gets the floor scale.

    On CUDA the per-group column kernel: launched directly in eager mode, through the ``triton_op``
    ``fp8tensor::quantize_group_cols_t`` when traced (compiled backwards, whatever ``compiled_quantization`` says);
    else (CPU, a dispatch mode, vmap, a tensor subclass, autograd recording) the plain ops.
    """
    M, C = x.shape
    E = offs.numel()
    if kernels.group_col_layout_ok(x) and offs.is_cuda and pad_starts.is_cuda:
        if (kernels.group_col_kernel_available(x) and kernels.eager_launch_ok(offs)
                and kernels.eager_launch_ok(pad_starts)):
            return _group_cols_body(x, offs.contiguous(), pad_starts.contiguous(), M_pad, align, float8_dtype,
                                    traced=False)
        if compat.is_traced(x):  # (under a mode, vmap, a subclass or with autograd on: the plain ops below)
            return torch.ops.fp8tensor.quantize_group_cols_t(x, offs, pad_starts, M_pad, align, float8_dtype)
    gid = group_ids(offs, M)  # E for rows outside every group
    xf = x.to(torch.float32)
    amax = xf.new_zeros(E + 1, C)
    if M:
        amax.scatter_reduce_(0, gid[:, None].expand(M, C), xf.abs(), "amax", include_self=True)
    scale = amax_to_scale(amax[:E], float8_dtype)
    scale_rows = torch.cat([scale, scale.new_ones(1, C)])[gid]  # rows outside every group: any finite scale
    y = cast_to_fp8(xf, scale_rows, float8_dtype)
    q = torch.zeros(C, M_pad, dtype=torch.uint8, device=x.device)
    if M and E:  # (no experts: no group start to read)
        starts = torch.cat([offs.new_zeros(1), offs[:-1]]).to(torch.int64)
        gid_c = gid.clamp(max=E - 1)
        dest = torch.arange(M, device=x.device) - starts[gid_c] + pad_starts.to(torch.int64)[gid_c]
        dest = torch.where(gid < E, dest, torch.full_like(dest, M_pad - 1))  # outside every group: the spare block
        q.index_copy_(1, dest, y.view(torch.uint8).t().contiguous())
        q[:, M_pad - align:] = 0
    return q.view(float8_dtype), scale


def quantize_expert_cols(w: torch.Tensor, float8_dtype: torch.dtype = E4M3):
    """Expert weights ``w`` ``(E, N, K)`` quantized per expert and input column (over ``N``), in the layout the
    grad_input GEMM takes.

    Returns:
        ``(q, scale)``: ``q`` ``(E, K, N)`` row-major ``float8_dtype`` (``q[e].t()`` quantizes ``w[e]``), ``scale``
        float32 ``(E, K)``: ``q[e].float() * scale[e][:, None] ≈ w[e].t()``.

    On CUDA the per-group column kernel (traced: the ``triton_op`` ``fp8tensor::quantize_expert_cols_t``, as
    :func:`quantize_group_cols` takes ``fp8tensor::quantize_group_cols_t``), else the plain ops.
    """
    E, N, K = w.shape
    if N and K and kernels.group_col_layout_ok(w.reshape(E * N, K)) and w.is_contiguous():
        if kernels.group_col_kernel_available(w.reshape(E * N, K)):
            return _expert_cols_body(w, float8_dtype, traced=False)
        if compat.is_traced(w):
            return torch.ops.fp8tensor.quantize_expert_cols_t(w, float8_dtype)
    q, s = quantize(w, -2, float8_dtype)  # (E, N, K), (E, 1, K)
    return q.transpose(-2, -1).contiguous(), s.reshape(E, K)


def _group_cols_body(x, offs, pad_starts, M_pad, align, float8_dtype, traced=True):
    """:func:`quantize_group_cols` by the per-group column kernel (``traced``: the body of its ``triton_op``)."""
    C = x.shape[1]
    q = torch.empty(C, M_pad, dtype=float8_dtype, device=x.device)
    scale = torch.empty(offs.numel(), C, dtype=torch.float32, device=x.device)
    if M_pad and not traced:  # the spare block, read by nothing: kept defined in eager mode (inductor cannot lower
        q.view(torch.uint8)[:, M_pad - align:].zero_()  # a write through an fp8 tensor's uint8 view)
    kernels.launch_group_cols_t(x, offs, pad_starts, q, scale, stride_qg=0, stride_qc=M_pad, q_cols=M_pad,
                                align=align, float8_dtype=float8_dtype, scale_floor=SCALE_FLOOR, min_pad=align,
                                traced=traced)
    # the columns between the last group's padded end and the spare block are never read by the GEMM
    return q, scale


def _expert_cols_body(w, float8_dtype, traced=True):
    """:func:`quantize_expert_cols` of a contiguous ``w`` by the per-group column kernel, one group per expert."""
    E, N, K = w.shape
    q = torch.empty(E, K, N, dtype=float8_dtype, device=w.device)
    scale = torch.empty(E, K, dtype=torch.float32, device=w.device)
    ends = torch.arange(1, E + 1, device=w.device, dtype=torch.int32) * N
    dst = torch.zeros(E, device=w.device, dtype=torch.int32)
    kernels.launch_group_cols_t(w.reshape(E * N, K), ends, dst, q, scale, stride_qg=K * N, stride_qc=N, q_cols=N,
                                align=1, float8_dtype=float8_dtype, scale_floor=SCALE_FLOOR, traced=traced)
    return q, scale


# Compiled grouped-GEMM backwards launch the per-group column kernel through these ops (the plain ops' scatter-amax
# and index copy, which inductor cannot fuse into one pass, measured 5-10x slower).
@_register_op("fp8tensor::quantize_group_cols_t", mutates_args=())
def _quantize_group_cols_t(x: torch.Tensor, offs: torch.Tensor, pad_starts: torch.Tensor, M_pad: int, align: int,
                           float8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # quantize_group_cols on CUDA when traced (compiled graphs)
    return _group_cols_body(x, offs.contiguous(), pad_starts.contiguous(), M_pad, align, float8_dtype)


@_register_op("fp8tensor::quantize_expert_cols_t", mutates_args=())
def _quantize_expert_cols_t(w: torch.Tensor, float8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # quantize_expert_cols on CUDA when traced (compiled graphs)
    return _expert_cols_body(w.contiguous(), float8_dtype)


if not kernels.HAS_TRITON:  # (the ops are only called on CUDA with Triton; a custom op needs a fake kernel)

    @_quantize_group_cols_t.register_fake
    def _(x, offs, pad_starts, M_pad, align, float8_dtype):
        return (x.new_empty(x.shape[1], M_pad, dtype=float8_dtype),
                x.new_empty(offs.numel(), x.shape[1], dtype=torch.float32))

    @_quantize_expert_cols_t.register_fake
    def _(w, float8_dtype):
        E, N, K = w.shape
        return w.new_empty(E, K, N, dtype=float8_dtype), w.new_empty(E, K, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- FSDP2 payloads
def quantize_rows_into(datas: list, q_ptrs: list, s_ptrs: list, float8_dtype: torch.dtype) -> bool:
    """Quantize each 2-D weight of ``datas`` per row, writing its fp8 bytes and float32 scales to the device addresses
    ``q_ptrs[i]`` / ``s_ptrs[i]`` (one launch of the row kernel for all: FSDP2's packed all-gather payload).

    Returns:
        True when the kernel ran (CUDA with Triton, every weight taken by it); False when nothing was written (the
        caller quantizes weight by weight with :func:`quantize`, the same bytes)."""
    if not (kernels.HAS_TRITON and all(kernels.row_kernel_available(d) for d in datas)):
        return False
    kernels.quantize_last_dim_group_into(datas, q_ptrs, s_ptrs, float8_dtype, SCALE_FLOOR)
    return True


# ---------------------------------------------------------------------------------------------- fp8 layout copies
def _transpose_after_impl(q: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """``fp8tensor::transpose_after``: ``q.transpose(-2, -1).contiguous()`` (always a copy; ``after`` unread), by the
    transpose kernel on CUDA fp8."""
    if kernels.transpose_available(q):
        return kernels.launch_transpose(q)
    return q.transpose(-2, -1).clone(memory_format=torch.contiguous_format)  # a copy: never aliases its input


_LIB.define("transpose_after(Tensor q, Tensor after) -> Tensor")
_LIB.impl("transpose_after", _transpose_after_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("fp8tensor::transpose_after", lib=_LIB)
def _(q, after):
    return q.new_empty((*q.shape[:-2], q.shape[-1], q.shape[-2]))


def cast_rows_t_after(x: torch.Tensor, scale: torch.Tensor, after: torch.Tensor,
                      float8_dtype: torch.dtype = E4M3) -> torch.Tensor:
    """The rows of ``x`` quantized with given row scales and stored transposed: ``(N, M)`` / ``(B, N, M)`` contiguous
    ``float8_dtype`` for a high-precision ``x`` ``(M, N)`` / ``(B, M, N)`` and float32 ``scale`` ``(M,)`` /
    ``(B, M)`` (the dequantization multipliers): ``cast_to_fp8(x, scale[..., None]).transpose(-2, -1)``, with the
    row kernel's bits when ``scale`` is what it computed (the grad_input operand of expert weights quantized per row
    in the forward, re-cast in the backward from the forward's scales without another amax pass).

    Eager on CUDA: one tiled Triton kernel (read once, written once); otherwise (CPU, compiled graphs, a mode, a
    subclass) the plain ops, which inductor fuses into one kernel; compiled, they read :func:`after_dep` of
    ``after`` (the gradient the result meets), so the cast stays in the backward graph instead of being hoisted into
    the forward and kept. Values beyond the format's range saturate (an ``x`` changed after its scales were taken is
    clamped, never non-finite unless it is).

    Raises:
        ValueError: ``scale`` not of shape ``x.shape[:-1]``, or ``x`` not 2-D or 3-D.
        TypeError: ``float8_dtype`` not an fp8 dtype."""
    check_float8_dtype(float8_dtype, "cast_rows_t_after")
    if x.dim() not in (2, 3) or tuple(scale.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"cast_rows_t_after: expected x (M, N) or (B, M, N) and scale of x.shape[:-1], got "
                         f"{tuple(x.shape)} and {tuple(scale.shape)}")
    if kernels.cast_rows_t_available(x, scale) and kernels.eager_launch_ok(after):
        return kernels.launch_cast_rows_t(x, scale, float8_dtype)
    if compat.is_compiling():
        scale = scale + after_dep(after)  # +0.0: the same scales
    return cast_to_fp8(x, scale[..., None], float8_dtype).transpose(-2, -1).contiguous()


def transpose_after(q: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """``q.transpose(-2, -1).contiguous()`` (a copy) of an fp8 ``q`` ``(N, K)`` or ``(E, N, K)``: the weight(s)
    column-major for grad_input, ordered after ``after`` when traced (else hoisted into the forward and kept). Eager:
    direct (one tiled Triton kernel on CUDA); compiled: plain ops reading :func:`after_dep`; under a mode: the op
    ``fp8tensor::transpose_after``."""
    if kernels.eager_launch_ok(q) and kernels.eager_launch_ok(after):
        return _transpose_after_impl(q, after)  # eager: the op's body (the kernel on CUDA), no dispatcher trip
    if compat.is_compiling():  # plain ops inductor fuses (an opaque op costs a Python call per Linear per step)
        dep = after_dep(after).reshape(1, 1).to(torch.int16)  # 0: the bytes are unchanged
        return (q.transpose(-2, -1).view(torch.uint8).to(torch.int16) + dep).to(torch.uint8).view(q.dtype).contiguous()
    return torch.ops.fp8tensor.transpose_after(q, after)


