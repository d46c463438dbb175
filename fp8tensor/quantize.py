"""Row-wise fp8 quantization: amax, scale and the saturating cast.

This module is the only place where fp8 rounding happens, and :func:`quantize` is the one entry point that decides
*how* a tensor is quantized: a Triton kernel of :mod:`fp8tensor.kernels` (eager CUDA), the plain ops below (CPU,
``torch.compile``, tensors the kernels do not take), or the ``fp8tensor::quantize_dim0_t`` custom op (GEMM operands
reduced over their outer dim, in the transposed layout ``torch._scaled_mm`` wants). ``from_hp``, the GEMM engine's
operand preparation, training, the FSDP2 pre-all-gather and ``copy_`` all go through it (or, for a scale layout
given by an existing tensor, through :func:`amax_to_scale` / :func:`cast_to_fp8`).

Scale convention (used everywhere in fp8tensor): ``scale`` is the *dequantization multiplier*, a float32
tensor with the same number of dims as the data, of size 1 on every dim it does not vary over::

    hp ≈ qdata.float() * scale            # scale broadcasts against qdata
    scale = amax(|x| over the scaled-over dim) / finfo(float8_dtype).max

A "row-wise" scale along dim ``d`` reduces over ``d`` (size 1 there) and is full-size on the other dims.
The method is the per-row ("axiswise") scaling of fp8 training recipes, e.g. Micikevicius et al., "FP8
Formats for Deep Learning" (2022) for the formats and PyTorch's ``torch._scaled_mm`` for the scale layout.
"""
from __future__ import annotations

import torch

from . import kernels

__all__ = [
    "quantize",
    "quantize_dim0_t",
    "FLOAT8_DTYPES",
    "E4M3",
    "E5M2",
    "check_float8_dtype",
    "amax_to_scale",
    "rowwise_scale",
    "cast_to_fp8",
    "quantize_rowwise",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
#: The fp8 formats supported for storage and GEMMs (OCP e4m3fn and e5m2).
FLOAT8_DTYPES = (E4M3, E5M2)

#: Smallest scale: float32's smallest normal number, 2^-126. ``scale = max(amax / fp8_max, SCALE_FLOOR)``.
#: An all-zero (or empty) row gets this scale, so its scale is finite and positive and the row dequantizes to exact
#: zeros. Any row with ``amax >= fp8_max * 2^-126`` (about 5.3e-36 for e4m3, 6.7e-34 for e5m2) gets exactly
#: ``amax / fp8_max`` and keeps fp8's relative precision. **Limit:** rows below that keep the floor scale, so their
#: values sit on a fixed absolute grid (2^-126 times the fp8 grid): they lose relative precision gradually and the
#: smallest flush to zero. A smaller (subnormal) float32 scale would itself carry fewer significant bits, and
#: ``x / scale`` could overflow; float32 inputs that small are themselves subnormal. (The floor used to be an
#: *amax* of 1e-12, which clamped every row below ~1e-12 and turned rows below ~1e-18 into zeros.) Traced code reads
#: it as ``torch.finfo(torch.float32).tiny``, a constant to ``torch.compile``: a module-level Python float would
#: become a symbolic input under ``dynamic=True``, which trips a dynamo bug (docs/pytorch_issues.md).
SCALE_FLOOR = torch.finfo(torch.float32).tiny


def check_float8_dtype(float8_dtype: torch.dtype, op: str) -> None:
    """Raise ``TypeError`` naming ``op`` unless ``float8_dtype`` is ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``."""
    if float8_dtype not in FLOAT8_DTYPES:
        raise TypeError(
            f"{op}: unsupported float8 dtype {float8_dtype}; expected torch.float8_e4m3fn or torch.float8_e5m2"
        )


def amax_to_scale(amax: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """Turn an amax tensor (any shape, any float dtype) into a float32 dequantization scale.

    ``scale = max(amax / finfo(float8_dtype).max, 2^-126)``, computed in float32 (:data:`SCALE_FLOOR`: the floor,
    and the limit for tiny rows). For every amax above the floor this is the division it always was, so ordinary
    rows quantize bit-identically. NaN/inf amax propagate into the scale (the row stays non-finite).
    """
    amax = amax.to(torch.float32)
    # clamp keeps NaN as NaN (torch.clamp propagates NaN), so a NaN row stays visibly NaN.
    return torch.clamp(amax / torch.finfo(float8_dtype).max, min=torch.finfo(torch.float32).tiny)


def rowwise_scale(x: torch.Tensor, dim: int, float8_dtype: torch.dtype) -> torch.Tensor:
    """Float32 scale of ``x`` reduced over ``dim`` (kept with size 1): ``amax(|x|, dim) / fp8_max``.

    An empty ``dim`` (a ``[7, 0]`` tensor) has amax 0, as an all-zero row: the floor scale."""
    if x.shape[dim] == 0:
        shape = list(x.shape)
        shape[dim] = 1
        return amax_to_scale(x.new_zeros(shape, dtype=torch.float32), float8_dtype)
    amax = torch.amax(torch.abs(x), dim=dim, keepdim=True)
    return amax_to_scale(amax, float8_dtype)


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast ``x / scale`` to ``float8_dtype`` (computed in float32; ``scale`` broadcasts).

    Values beyond the format's finite range are clamped to ±max; NaN stays NaN (e4m3fn and e5m2 both have
    NaN encodings), so a non-finite row remains non-finite after dequantization.
    """
    fmax = torch.finfo(float8_dtype).max
    y = x.to(torch.float32) / scale
    return torch.clamp(y, min=-fmax, max=fmax).to(float8_dtype)


def quantize(
    x: torch.Tensor, dim: int = -1, float8_dtype: torch.dtype = E4M3, *, gemm_layout: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantization entry point: ``(qdata, scale)`` of ``x`` with one scale per slice reduced over ``dim``.

    Which code runs (the values follow the scale convention of this module in every case):

    1. ``gemm_layout=True``, ``x`` a 2-D CUDA tensor whose ``dim`` is its outer (strided) dim — ``dim=0`` of a
       row-major ``x`` or ``dim=1`` of a transposed view — and :func:`fp8tensor.kernels.kernel_available`: the
       ``fp8tensor::quantize_dim0_t`` custom op; ``qdata`` is then a transposed view of a contiguous tensor (the
       column-major layout ``torch._scaled_mm`` wants for its second operand).
    2. ``dim`` is the last dim and :func:`fp8tensor.kernels.row_kernel_available` (eager, contiguous CUDA): the fused
       row-wise Triton kernel (same bits as the ops).
    3. Otherwise (CPU, ``torch.compile``, other layouts): :func:`rowwise_scale` and :func:`cast_to_fp8`.

    Raises:
        TypeError: ``float8_dtype`` is not one of the supported fp8 formats.
    """
    check_float8_dtype(float8_dtype, "quantize_rowwise")
    if x.is_cuda:
        if gemm_layout and x.dim() == 2:
            if dim % 2 == 0 and kernels.kernel_available(x):
                q, s = quantize_dim0_t(x, float8_dtype)
                return q.t(), s.t()
            if dim % 2 == 1 and kernels.kernel_available(x.t()):
                return quantize_dim0_t(x.t(), float8_dtype)
        if x.dim() and dim in (-1, x.dim() - 1) and kernels.row_kernel_available(x):
            return kernels.quantize_last_dim(x, float8_dtype, SCALE_FLOOR)
    scale = rowwise_scale(x, dim, float8_dtype)
    return cast_to_fp8(x, scale, float8_dtype), scale


def quantize_rowwise(
    x: torch.Tensor, dim: int = -1, float8_dtype: torch.dtype = E4M3
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


# ---------------------------------------------------------------------------------------------- dim-0 custom op
def _reference_dim0_t(x: torch.Tensor, float8_dtype: torch.dtype):
    q, s = quantize_rowwise(x.t(), dim=-1, float8_dtype=float8_dtype)
    return q.contiguous(), s


@torch.library.custom_op("fp8tensor::quantize_dim0_t", mutates_args=())
def quantize_dim0_t(x: torch.Tensor, float8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ``(M, K)`` along dim 0 and return it transposed.

    The fused Triton kernels of :mod:`fp8tensor.kernels` where they take ``x`` (CUDA, row-major), else the plain
    ops (:func:`quantize_rowwise` of ``x.T``).

    Returns:
        ``(q, scale)``: ``q`` is ``(K, M)`` row-major ``float8_dtype`` holding ``x.T`` quantized row-wise,
        ``scale`` is ``(K, 1)`` float32 (dequantization multiplier), i.e. ``q.float() * scale ≈ x.T``.
    """
    if not kernels.kernel_available(x):
        return _reference_dim0_t(x, float8_dtype)
    return kernels.launch_dim0_t(x, float8_dtype, SCALE_FLOOR)


@quantize_dim0_t.register_fake
def _(x, float8_dtype):
    M, K = x.shape
    return x.new_empty(K, M, dtype=float8_dtype), x.new_empty(K, 1, dtype=torch.float32)
