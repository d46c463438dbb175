"""fp8 communication for sequence parallelism: the activation all-gathered in fp8 with per-token scales, after
TorchAO's ``PrepareFloat8ModuleInput`` with per-token instead of per-tensor scales (docs/sp_fp8.md)."""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput, PrepareModuleInputOutput

from ..core import compat
from ..numerics.quantize import E4M3, FLOAT8_DTYPES, check_float8_dtype, quantize_rowwise
from ..subclass.tensor import ScaledFp8Tensor, make_scaled, rowwise_dims

funcol = compat.functional_collectives()

__all__ = ["Fp8PrepareModuleInput", "fp8_sequence_parallel_plan", "fp8_sequence_all_gather"]

# torch >= 2.12 names them *_single; older releases only have *_tensor.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _wait(t: torch.Tensor) -> torch.Tensor:
    """Wait for an eager functional collective (a no-op under tracing, where the result is a plain tensor)."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _gather_payload(qdata: torch.Tensor, scale: torch.Tensor, dim: int, mesh: DeviceMesh):
    """All-gather fp8 ``qdata`` (as uint8) and float32 ``scale`` along ``dim`` over the 1-D ``mesh``."""
    group = (mesh, 0)
    q = _all_gather(qdata.contiguous().view(torch.uint8), dim, group)
    s = _all_gather(scale.contiguous(), dim, group)
    return _wait(q).view(qdata.dtype), _wait(s)


class _Fp8SequenceAllGather(torch.autograd.Function):
    """``Shard(d)`` high-precision DTensor -> ``Replicate`` DTensor of a per-token ScaledFp8Tensor; the backward
    redistributes the gradient to the input's placement and dtype."""

    @staticmethod
    def forward(ctx, x: DTensor, float8_dtype: torch.dtype):
        mesh = x.device_mesh
        dim = x.placements[0].dim
        ctx.mesh, ctx.placements, ctx.in_dtype = mesh, x.placements, x.dtype
        local = x.to_local()
        qdata, scale = quantize_rowwise(local, dim=-1, float8_dtype=float8_dtype)
        q_full, s_full = _gather_payload(qdata, scale, dim, mesh)
        y = make_scaled(q_full, s_full, x.dtype, True, rowwise_dims(q_full.dim(), -1))
        return DTensor.from_local(y, mesh, (Replicate(),), run_check=False, shape=x.shape, stride=x.stride())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not isinstance(grad, DTensor):  # a plain local gradient is that of the replicated tensor
            grad = DTensor.from_local(grad, ctx.mesh, (Replicate(),), run_check=False)
        g = grad.redistribute(ctx.mesh, ctx.placements)
        if g.dtype != ctx.in_dtype:
            g = g.to(ctx.in_dtype)
        return g, None


def _why_not_fp8(x: torch.Tensor) -> Optional[tuple[type, str]]:
    """None if :func:`fp8_sequence_all_gather` can take ``x``, else ``(exception type, reason)``."""
    if not isinstance(x, DTensor):
        return TypeError, f"expected a DTensor, got {type(x).__name__}"
    if x.dtype in FLOAT8_DTYPES or not x.dtype.is_floating_point:
        return TypeError, f"expected a high-precision floating-point DTensor, got dtype {x.dtype}"
    if isinstance(x.to_local(), ScaledFp8Tensor):
        return TypeError, "input is already fp8 (its local tensor is a ScaledFp8Tensor)"
    if x.ndim < 2:
        return ValueError, f"expected at least 2 dims (tokens x hidden), got shape {tuple(x.shape)}"
    p = x.placements[0] if x.device_mesh.ndim == 1 and len(x.placements) == 1 else None
    if type(p) is not Shard:  # (_StridedShard and friends are not plain row shards)
        return ValueError, (f"expected a DTensor on a 1-D mesh with placements (Shard(d),), got placements "
                            f"{x.placements} on a {x.device_mesh.ndim}-D mesh")
    d = p.dim % x.ndim
    if d == x.ndim - 1:
        return ValueError, (f"the input is sharded on its last (hidden) dim (Shard({d})): per-token scales need "
                            "whole rows; shard the sequence dim instead")
    if x.shape[d] % x.device_mesh.size():
        return ValueError, f"uneven sequence shards (dim {d} of size {x.shape[d]} over {x.device_mesh.size()} ranks)"
    return None


def fp8_sequence_all_gather(x: DTensor, *, float8_dtype: torch.dtype = E4M3) -> DTensor:
    """All-gather a sequence-sharded activation in fp8 with one scale per token.

    Each rank quantizes its rows over the last dim (:func:`fp8tensor.quantize.quantize_rowwise`); fp8 data (as uint8)
    and float32 scales are all-gathered along the sharded dim, so forward GEMMs are bit-identical to a
    high-precision gather's. Differentiable: the gradient is redistributed to ``x``'s placement.

    Args:
        x: DTensor ``(..., hidden)`` of a high-precision floating dtype on a 1-D (TP) mesh, placements
            ``(Shard(d),)`` with ``d`` not the last dim, evenly sharded.
        float8_dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.

    Returns:
        DTensor of ``x``'s global shape and dtype, placements ``(Replicate(),)``, of a
        :class:`~fp8tensor.ScaledFp8Tensor` with ``scale`` ``(..., 1)``.

    Raises:
        TypeError: ``x`` is not a high-precision floating-point DTensor; unsupported ``float8_dtype``.
        ValueError: ``x`` has fewer than 2 dims, is not ``(Shard(d),)`` on a 1-D mesh (``d`` not the last), or its
            shards are uneven.
    """
    op = "fp8_sequence_all_gather"
    check_float8_dtype(float8_dtype, op)
    why = _why_not_fp8(x)
    if why is not None:
        raise why[0](f"{op}: {why[1]}")
    return _Fp8SequenceAllGather.apply(x, float8_dtype)


def _is_sp_gather(input_layout: Optional[Placement], desired_layout: Optional[Placement]) -> bool:
    return isinstance(input_layout, Shard) and isinstance(desired_layout, Replicate)


class Fp8PrepareModuleInput(PrepareModuleInput):
    """``PrepareModuleInput`` whose ``Shard(d) -> Replicate()`` input gathers move fp8 data and per-token scales, for
    modules whose inputs feed column-parallel fp8 Linears under sequence parallelism (docs/sp_fp8.md). Each such
    input is gathered with :func:`fp8_sequence_all_gather` (one that cannot be: in high precision, with a warning);
    other inputs as ``PrepareModuleInput`` does. Consumers must be fp8 Linears.

    Args (keyword-only): those of ``PrepareModuleInput`` and ``float8_dtype`` (``torch.float8_e4m3fn``, default, or
    ``torch.float8_e5m2``). Raises ``TypeError`` (unsupported ``float8_dtype``) or ``PrepareModuleInput``'s
    ``AssertionError`` (inconsistent layouts).
    """

    def __init__(self, *, input_layouts=None, desired_input_layouts=None, input_kwarg_layouts: Optional[dict] = None,
                 desired_input_kwarg_layouts: Optional[dict] = None, use_local_output: bool = False,
                 float8_dtype: torch.dtype = E4M3):
        check_float8_dtype(float8_dtype, "Fp8PrepareModuleInput")
        super().__init__(input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
                         input_kwarg_layouts=input_kwarg_layouts,
                         desired_input_kwarg_layouts=desired_input_kwarg_layouts, use_local_output=use_local_output)
        self.float8_dtype = float8_dtype

    def _prepare_input_arg(self, input: Any, mesh: DeviceMesh, input_layout: Optional[Placement],
                           desired_layout: Optional[Placement]):
        if not _is_sp_gather(input_layout, desired_layout) or not isinstance(input, torch.Tensor):
            return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)
        dt = input if isinstance(input, DTensor) else DTensor.from_local(input, mesh, (input_layout,), run_check=False)
        why = _why_not_fp8(dt)
        if why is not None:
            warnings.warn(f"Fp8PrepareModuleInput: all-gathering in high precision: {why[1]}", stacklevel=2)
            return super()._prepare_input_arg(dt, mesh, input_layout, desired_layout)
        out = _Fp8SequenceAllGather.apply(dt, self.float8_dtype)
        return out.to_local() if self.use_local_output else out

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", float8_dtype={self.float8_dtype})"


def _to_fp8_input_style(style: PrepareModuleInput, float8_dtype: torch.dtype) -> Fp8PrepareModuleInput:
    new = Fp8PrepareModuleInput.__new__(Fp8PrepareModuleInput)
    new.__dict__.update(style.__dict__)  # the layouts, as already normalized by PrepareModuleInput.__init__
    new.float8_dtype = float8_dtype
    return new


def _has_sp_gather(style: PrepareModuleInput) -> bool:
    pairs = list(zip(style.input_layouts or (), style.desired_input_layouts or ()))
    pairs += [(v, style.desired_input_kwarg_layouts.get(k)) for k, v in style.input_kwarg_layouts.items()]
    return any(_is_sp_gather(a, b) for a, b in pairs)


def fp8_sequence_parallel_plan(plan: dict[str, ParallelStyle], *, float8_dtype: torch.dtype = E4M3
                               ) -> dict[str, ParallelStyle]:
    """Copy of a ``parallelize_module`` plan (same keys, same order) with fp8 sequence-parallel gathers.

    Every ``PrepareModuleInput`` entry (or input half of a ``PrepareModuleInputOutput``) with a ``Shard(d) ->
    Replicate()`` input becomes an :class:`Fp8PrepareModuleInput` with the same layouts; ``plan`` is not modified.

    ``plan``: dict from module FQN (or pattern) to ``ParallelStyle``; ``float8_dtype``: ``torch.float8_e4m3fn``
    (default) or ``torch.float8_e5m2``. Raises ``TypeError``: ``plan`` is not a dict, or unsupported ``float8_dtype``.
    """
    op = "fp8_sequence_parallel_plan"
    check_float8_dtype(float8_dtype, op)
    if not isinstance(plan, dict):
        raise TypeError(f"{op}: expected a dict of module name -> ParallelStyle, got {type(plan).__name__}")
    out: dict[str, ParallelStyle] = {}
    for name, style in plan.items():
        if type(style) is PrepareModuleInput and _has_sp_gather(style):
            style = _to_fp8_input_style(style, float8_dtype)
        elif type(style) is PrepareModuleInputOutput and _has_sp_gather(style.prepare_module_input):
            new = PrepareModuleInputOutput.__new__(PrepareModuleInputOutput)
            new.__dict__.update(style.__dict__)
            new.prepare_module_input = _to_fp8_input_style(style.prepare_module_input, float8_dtype)
            style = new
        out[name] = style
    return out
