"""Row-wise fp8 quantization: amax, scale and the saturating cast.

This module is the only place where fp8 rounding happens.

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

__all__ = [
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

# Smallest amax used to build a scale. An all-zero row gets this amax, so its scale is finite and positive
# and the row dequantizes to exact zeros. 1e-12 / 448 is ~2e-15, far above fp32's smallest normal.
_AMAX_FLOOR = 1e-12


def check_float8_dtype(float8_dtype: torch.dtype, op: str) -> None:
    """Raise ``TypeError`` naming ``op`` unless ``float8_dtype`` is ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``."""
    if float8_dtype not in FLOAT8_DTYPES:
        raise TypeError(
            f"{op}: unsupported float8 dtype {float8_dtype}; expected torch.float8_e4m3fn or torch.float8_e5m2"
        )


def amax_to_scale(amax: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """Turn an amax tensor (any shape, any float dtype) into a float32 dequantization scale.

    ``scale = max(amax, 1e-12) / finfo(float8_dtype).max``, computed in float32 so that tiny fp16/bf16
    inputs never overflow a reciprocal. NaN/inf amax propagate into the scale (the row stays non-finite).
    """
    amax = amax.to(torch.float32)
    # clamp keeps NaN as NaN (torch.clamp propagates NaN), so a NaN row stays visibly NaN.
    return torch.clamp(amax, min=_AMAX_FLOOR) / torch.finfo(float8_dtype).max


def rowwise_scale(x: torch.Tensor, dim: int, float8_dtype: torch.dtype) -> torch.Tensor:
    """Float32 scale of ``x`` reduced over ``dim`` (kept with size 1): ``amax(|x|, dim) / fp8_max``."""
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


def quantize_rowwise(
    x: torch.Tensor, dim: int = -1, float8_dtype: torch.dtype = E4M3
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with one scale per slice reduced over ``dim``.

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
    check_float8_dtype(float8_dtype, "quantize_rowwise")
    if x.dim() and dim in (-1, x.dim() - 1) and x.is_cuda:
        from .kernels import quantize_last_dim, row_kernel_available

        if row_kernel_available(x):  # eager CUDA: one fused Triton kernel, same bits as the ops below
            return quantize_last_dim(x, float8_dtype)
    scale = rowwise_scale(x, dim, float8_dtype)
    return cast_to_fp8(x, scale, float8_dtype), scale
