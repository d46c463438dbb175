"""fp8 GEMM engine: operand preparation (on-the-fly quantization, scale folding), the backends (docs/design.md,
"GEMMs and scale folding") and the ``aten.mm`` / ``aten.addmm`` op table entries of ``ScaledFp8Tensor``."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..core import compat
from ..numerics.quantize import E4M3, E5M2, quantize
from ..core.settings import GEMM_BACKENDS, config, get_config, set_config
from .tensor import ScaledFp8Tensor, implements, make_scaled

__all__ = [
    "BACKENDS", "set_gemm_backend", "get_gemm_backend", "gemm_backend", "scaled_mm", "fp8_mm", "choose_backend",
]

aten = torch.ops.aten

BACKENDS = GEMM_BACKENDS


def _check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"fp8tensor gemm backend: unknown backend {name!r}; expected one of {BACKENDS}")
    return name


def set_gemm_backend(name: str) -> None:
    """Set the process-wide GEMM backend: ``"auto"`` (default), ``"rowwise"``, ``"tensorwise"`` or ``"emulated"``
    (``fp8tensor.set_config(gemm_backend=name)``). Raises ``ValueError``: unknown backend name."""
    set_config(gemm_backend=_check_backend(name))


def get_gemm_backend() -> str:
    """The backend in force in this thread (``fp8tensor.get_config().gemm_backend``)."""
    return get_config().gemm_backend


def gemm_backend(name: str):
    """Context manager choosing the GEMM backend in this thread (``fp8tensor.config(gemm_backend=name)``). Raises
    ``ValueError``: unknown backend name."""
    return config(gemm_backend=_check_backend(name))


# ---------------------------------------------------------------------------------------------- backends
def _pad_to(x: int, m: int = 16) -> int:
    return (x + m - 1) // m * m


@functools.lru_cache(maxsize=None)
def _cpu_scaled_mm_works(a_dtype: torch.dtype, b_dtype: torch.dtype, rowwise: bool) -> bool:
    """Probe once whether ``torch._scaled_mm`` runs on CPU for these fp8 dtypes (real tensors, no modes)."""
    try:
        with compat.disable_current_modes():
            # (every dtype and device explicit: the answer is cached for the process, so no transient setting such
            # as torch.set_default_dtype / set_default_device may shape it)
            f32, cpu = torch.float32, torch.device("cpu")
            a = torch.ones(16, 16, dtype=f32, device=cpu).to(a_dtype)
            b = torch.ones(16, 16, dtype=f32, device=cpu).to(b_dtype).t()
            sa = torch.ones(16, 1, dtype=f32, device=cpu) if rowwise else torch.ones((), dtype=f32, device=cpu)
            sb = torch.ones(1, 16, dtype=f32, device=cpu) if rowwise else torch.ones((), dtype=f32, device=cpu)
            out = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=f32)
            return bool(torch.equal(out, torch.full((16, 16), 16.0, dtype=f32, device=cpu)))
    except Exception:
        return False


@functools.lru_cache(maxsize=None)
def choose_backend(device: torch.device, a_dtype: torch.dtype, b_dtype: torch.dtype, out_dtype: torch.dtype,
                   backend: str = "auto") -> str:
    """Resolve ``backend`` (``"auto"`` or a name) into one that can run this GEMM on this device and dtypes."""
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (8, 9) or (a_dtype == E5M2 and b_dtype == E5M2):
            return "emulated"
        if backend == "auto":
            return "rowwise" if out_dtype == torch.bfloat16 else "tensorwise"
        if backend == "rowwise" and out_dtype != torch.bfloat16:
            return "tensorwise"  # cuBLAS row-wise scaling only writes bf16
        return backend
    if device.type == "cpu":
        if backend == "auto":
            backend = "rowwise"
        if backend == "rowwise" and not _cpu_scaled_mm_works(a_dtype, b_dtype, True):
            backend = "tensorwise"
        if backend == "tensorwise" and not _cpu_scaled_mm_works(a_dtype, b_dtype, False):
            backend = "emulated"
        return backend
    return "emulated"


@torch.compiler.assume_constant_result
def _traced_backend(device, a_dtype, b_dtype, out_dtype, backend) -> str:
    """:func:`choose_backend`, which dynamo runs as it is, its answer a constant of the graph (where dynamo traces
    :func:`scaled_mm`: the exported forward of a plain weight; the probe of a CPU ``torch._scaled_mm`` cannot be
    traced)."""
    return choose_backend(device, a_dtype, b_dtype, out_dtype, backend)


def scaled_mm(a8: torch.Tensor, sa: torch.Tensor, b8: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype,
              bias: Optional[torch.Tensor] = None, use_fast_accum: bool = False, backend: Optional[str] = None
              ) -> torch.Tensor:
    """``(a8 * sa) @ (b8 * sb) + bias`` with fp8 operands, on the chosen backend: ``(M, N)`` of ``out_dtype``.

    Args:
        a8: ``(M, K)`` float8 tensor (any layout; made row-major if needed).
        sa: ``(M, 1)`` float32 row scales of ``a8``.
        b8: ``(K, N)`` float8 tensor (any layout; made column-major if needed).
        sb: ``(1, N)`` float32 column scales of ``b8``.
        out_dtype: output dtype (float32, bfloat16 or float16).
        bias: optional ``(N,)`` tensor, added exactly once in ``out_dtype`` precision or better.
        use_fast_accum: fp8 fast accumulation on CUDA (``torch._scaled_mm(use_fast_accum=...)``).
        backend: ``"auto"``, ``"rowwise"``, ``"tensorwise"``, ``"emulated"``; None reads :func:`get_gemm_backend`.
    """
    M, K = a8.shape
    N = b8.shape[1]
    empty = M == 0 or N == 0 or K == 0
    name = None if empty else _traced_backend(a8.device, a8.dtype, b8.dtype, out_dtype,
                                              _check_backend(backend or get_gemm_backend()))
    if empty or name == "emulated":  # (empty: what the dense matmul gives; torch._scaled_mm rejects empty scales)
        out = (torch.zeros((M, N), dtype=torch.float32, device=a8.device) if empty
               else (a8.to(torch.float32) * sa) @ (b8.to(torch.float32) * sb))
        if bias is not None:
            out = out + bias.to(torch.float32)
        return out.to(out_dtype)

    # Layout: A row-major, B column-major (stride (1, ld) with ld >= K).
    if not (a8.stride(1) == 1 and a8.stride(0) >= max(K, 1)):
        a8 = a8.contiguous()
    if not (b8.stride(0) == 1 and b8.stride(1) >= max(K, 1)):
        b8 = b8.t().contiguous().t()
    # K == 1: the bytes are both row- and column-major, but inductor's lowering checks the strides (A: stride(1) ==
    # 1, B: stride(0) == 1), which contiguous() leaves as they were on a size-1 dim.
    if K == 1:
        if a8.stride(1) != 1:
            a8 = a8.as_strided((M, 1), (a8.stride(0), 1), a8.storage_offset())
        if b8.stride(0) != 1:
            b8 = b8.as_strided((1, N), (1, b8.stride(1)), b8.storage_offset())
    # (M, 1) / (1, N) float32 contiguous, as torch._scaled_mm wants (usually already so: test first)
    if not (sa.dtype == torch.float32 and sa.shape == (M, 1) and sa.is_contiguous()):
        sa = sa.to(torch.float32).expand(M, 1).contiguous()
    if not (sb.dtype == torch.float32 and sb.shape == (1, N) and sb.is_contiguous()):
        sb = sb.to(torch.float32).expand(1, N).contiguous()

    # cuBLAS needs K and N multiples of 16 and 16-byte aligned leading dims: zero-pad (zeros add nothing).
    Np = N
    if a8.is_cuda:
        Kp, Np = _pad_to(K), _pad_to(N)
        if Kp != K or a8.stride(0) % 16:
            a_p = torch.zeros(M, Kp, dtype=a8.dtype, device=a8.device)
            a_p[:, :K] = a8
            a8 = a_p
        if Kp != K or Np != N or b8.stride(1) % 16:
            b_p = torch.zeros(Np, Kp, dtype=b8.dtype, device=b8.device)
            b_p[:N, :K] = b8.t()
            b8 = b_p.t()
        if Np != N:
            sb = torch.cat([sb, sb.new_ones(1, Np - N)], dim=1)

    fused_bias = (name == "rowwise" and bias is not None and bias.dim() == 1
                  and bias.dtype == out_dtype == torch.bfloat16)
    if name == "rowwise":
        b_arg = None if not fused_bias else bias if Np == N else torch.cat([bias, bias.new_zeros(Np - N)])
        out = torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, bias=b_arg, out_dtype=out_dtype,
                               use_fast_accum=use_fast_accum)
    else:  # tensorwise: unit scales, float32 output, then the row/column scale fix-up
        one = torch.ones((), dtype=torch.float32, device=a8.device)
        out = torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.float32,
                               use_fast_accum=use_fast_accum) * sa * sb
    if Np != N:
        out = out[:, :N]
    if bias is not None and not fused_bias:
        out = out.to(torch.float32) + bias.to(torch.float32)
    return out if out.dtype == out_dtype else out.to(out_dtype)  # (no no-op .to: docs/pytorch_issues.md)


# ---------------------------------------------------------------------------------------------- operands
def fp8_mm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None, *, op: str = "fp8tensor.mm",
           float8_dtype: torch.dtype = E4M3, checked: bool = False) -> torch.Tensor:
    """``a @ b (+ bias)`` where ``a`` ``(M, K)`` and/or ``b`` ``(K, N)`` is a ScaledFp8Tensor.

    A high-precision operand is quantized row-wise along K (``float8_dtype``); an fp8 operand scaled on K is folded.
    Output: the promoted high-precision dtype; fast accumulation iff every ScaledFp8Tensor operand has it.
    ``checked=True`` skips the argument checks.

    Raises ``RuntimeError`` naming ``op``: operands not 2-D, inner dims differ, devices differ.
    """
    # A ScaledFp8Tensor's metadata read from its parts, plain attributes (``qdata``: its shape and device;
    # ``orig_dtype``: its dtype): the wrapper's own cost a ``__torch_function__`` lookup each.
    fa, fb = isinstance(a, ScaledFp8Tensor), isinstance(b, ScaledFp8Tensor)
    ma, mb = a.qdata if fa else a, b.qdata if fb else b
    da, db = a.orig_dtype if fa else a.dtype, b.orig_dtype if fb else b.dtype
    if not checked:
        if ma.dim() != 2 or mb.dim() != 2:
            raise RuntimeError(f"{op}: expected 2-D operands, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
        if ma.shape[1] != mb.shape[0]:
            raise RuntimeError(f"{op}: mat1 and mat2 shapes cannot be multiplied "
                               f"({a.shape[0]}x{a.shape[1]} and {b.shape[0]}x{b.shape[1]})")
        if ma.device != mb.device:
            raise RuntimeError(f"{op}: operands are on different devices ({a.device} and {b.device})")
        for dt in (da, db):
            if not dt.is_floating_point:
                raise RuntimeError(f"{op}: expected floating-point operands, got {dt}")
    fast = (not fa or a.fast_accum) and (not fb or b.fast_accum)
    out_dtype = torch.promote_types(da, db)

    # Resolve fp8 operands that cannot be used as they are into high precision, or fold their K scale.
    if isinstance(a, ScaledFp8Tensor):
        if a.scale.shape[1] != 1:  # scaled along K
            if a.scale.shape[0] == 1 and not isinstance(b, ScaledFp8Tensor):
                # A = A8 diag(s)  =>  A @ B = A8 @ (diag(s) B): fold into B, use A8 with unit row scales.
                b = b.to(torch.float32) * a.scale.reshape(-1, 1)
                a = make_scaled(a.qdata, a.scale.new_ones(a.shape[0], 1), a.orig_dtype, a.fast_accum, (True, False))
            else:
                a = a.to_hp(torch.float32)
    fold = None
    if isinstance(b, ScaledFp8Tensor):
        if b.scale.shape[0] != 1:  # scaled along K
            if b.scale.shape[1] == 1 and not isinstance(a, ScaledFp8Tensor):
                # B = diag(s) B8  =>  A @ B = (A diag(s)) @ B8: fold into A (as A is quantized: quantize's col_scale).
                fold = b.scale.reshape(1, -1)
                b = make_scaled(b.qdata, b.scale.new_ones(1, b.shape[1]), b.orig_dtype, b.fast_accum, (False, True))
            else:
                b = b.to_hp(torch.float32)

    a8, sa = ((a.qdata, a.scale) if isinstance(a, ScaledFp8Tensor)
              else quantize(a, 1, float8_dtype, gemm_layout=True, col_scale=fold))
    b8, sb = (b.qdata, b.scale) if isinstance(b, ScaledFp8Tensor) else quantize(b, 0, float8_dtype, gemm_layout=True)
    if isinstance(bias, ScaledFp8Tensor):
        bias = bias.to_hp()
    return scaled_mm(a8, sa, b8, sb, out_dtype, bias=bias, use_fast_accum=fast)


# ---------------------------------------------------------------------------------------------- op table entries
@implements([aten.mm.default])
def _mm(func, args, kwargs):
    return fp8_mm(args[0], args[1], op="aten.mm")


@implements([aten.addmm.default])
def _addmm(func, args, kwargs):
    bias, a, b = args[0], args[1], args[2]
    beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
    alpha = kwargs.get("alpha", args[4] if len(args) > 4 else 1)
    if isinstance(bias, ScaledFp8Tensor):
        bias = bias.to_hp()
    if beta == 1 and alpha == 1 and bias.dim() == 1:
        return fp8_mm(a, b, bias, op="aten.addmm")
    out = fp8_mm(a, b, op="aten.addmm")
    res = alpha * out.to(torch.float32)
    if beta != 0:  # (beta == 0: the input is ignored, its NaN / inf included, as torch.addmm does)
        res = res + beta * bias.to(torch.float32)
    return res.to(out.dtype)
