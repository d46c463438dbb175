"""fp8tensor: row-wise scaled fp8 matmuls as a tensor subclass that lives inside DTensor and FSDP2.

Public API:

* :class:`ScaledFp8Tensor` — fp8 data + float32 row-wise scales; ``ScaledFp8Tensor.from_hp(w)``.
* :func:`convert_to_fp8` — training: high-precision master weights quantized on use (recipes
  ``"rowwise"`` and ``"rowwise_gw_hp"``).
* :func:`quantize_weights` — inference / frozen weights stored in fp8.
* :func:`fp8_linear` — the functional form of an fp8 Linear.
* :func:`set_gemm_backend` / :func:`gemm_backend` — GEMM backend choice.
"""
from .quantize import E4M3, E5M2, quantize_rowwise
from .tensor import ScaledFp8Tensor, dequantize
from .gemm import BACKENDS, gemm_backend, get_gemm_backend, set_gemm_backend
from . import ops as _ops  # noqa: F401  (registers the op table)
from .training import Fp8MasterWeight, Recipe, RECIPES, fp8_linear
from .convert import convert_to_fp8, quantize_weights

__all__ = [
    "Fp8MasterWeight",
    "Recipe",
    "RECIPES",
    "fp8_linear",
    "convert_to_fp8",
    "quantize_weights",
    "ScaledFp8Tensor",
    "dequantize",
    "quantize_rowwise",
    "E4M3",
    "E5M2",
    "BACKENDS",
    "gemm_backend",
    "get_gemm_backend",
    "set_gemm_backend",
]
__version__ = "0.1.0"
