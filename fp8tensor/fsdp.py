"""FSDP2 fp8 all-gather payload: what goes on the wire (row-wise fp8 data plus row scales instead of high-precision
weights), computed on plain ``qdata`` / ``scale`` tensors.

FSDP2 (``torch.distributed.fsdp.fully_shard``) shards every parameter on dim 0, i.e. by whole rows. A row-wise scale
(one float32 per row, the amax taken over the last dim) computed on a rank's shard is therefore *the* global row
scale of those rows, and an all-gather of the fp8 rows plus their scales reproduces, bit for bit, what quantizing the
unsharded weight would give. It moves ``K + 4`` bytes per row of ``K`` elements instead of ``2 K`` (bf16) or ``4 K``
(fp32).

The hooks are FSDP2's all-gather extension protocol (see ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``,
"[Note: FSDP tensors]"): ``fsdp_pre_all_gather`` on the *sharded local tensor* returns the all-gather inputs plus
metadata, ``fsdp_post_all_gather`` turns the all-gather outputs into the unsharded tensor the forward sees.

The hook methods live on the classes and call the functions here (this module sits below both classes and builds
no subclass; the class wraps what it returns):

* :class:`~fp8tensor.master.Fp8MasterWeight` (training): quantizes its local high-precision rows
  (:func:`master_pre_all_gather`); the forward receives a :class:`~fp8tensor.tensor.ScaledFp8Tensor` whose logical
  dtype is the mixed-precision ``param_dtype``; ``fp8_linear`` then uses it as is (scale folding for grad_input),
  and the weight gradient (a plain high-precision tensor) is reduce-scattered by FSDP2 in ``reduce_dtype`` into the
  high-precision master shard.
* :class:`~fp8tensor.tensor.ScaledFp8Tensor` (frozen fp8 weights): gathers its data and scales as they are
  (:func:`scaled_pre_all_gather`).
* both: :func:`gathered` / :func:`refill` / :func:`unsharded_buffers` turn the all-gather outputs into the unsharded
  data and scales (``ScaledFp8Tensor.fsdp_post_all_gather`` wraps them).

How the bytes travel (all ranks make the same choice, it depends only on the global shape and the mesh size):

``fused``  dim 0 divisible by the world size: two all-gather inputs, the fp8 data viewed as ``uint8`` and the
           float32 scales. FSDP2 packs inputs of different dtypes into one ``uint8`` all-gather, so data and
           scales go in a single collective.
``padded`` dim 0 not divisible (uneven or empty shards): FSDP2 requires *every* all-gather input of a rank with a
           padded shard to have the padded sharded *parameter* shape, which a ``(rows, 1)`` scale cannot have. The
           data (zero-padded to the padded shard) goes through FSDP2's all-gather; the (padded) scales through one
           extra small all-gather issued on the same process group in ``fsdp_pre_all_gather`` and carried to
           ``fsdp_post_all_gather`` in the metadata. Same bytes, one more (tiny) collective.
``local``  world size 1: FSDP2 copies only the first input; the data goes through FSDP2, the scales through the
           metadata.

The fp8 data is sent as ``uint8`` because gloo has no float8 dtypes (NCCL would accept either); nothing is lost, it
is a bit-level view. Padding rows are zeros with unit scales and are dropped after the gather: ``torch.chunk``
sharding puts every rank's real rows first, so the first ``rows`` gathered rows are exactly the unsharded tensor.

On later iterations FSDP2 calls ``fsdp_post_all_gather(..., out=unsharded_param)`` after re-allocating the storages
returned as inner tensors the first time; the unsharded :class:`ScaledFp8Tensor` views those storages, so only the
scales of the ``padded``/``local`` modes need a copy.

Editing FSDP2's private state (conversion after ``fully_shard``, dropping FSDP2's flat copy of an fp8 shard) is
:mod:`fp8tensor.fsdp_state`.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .quantize import E4M3, quantize

__all__ = [
    "master_pre_all_gather",
    "scaled_pre_all_gather",
    "all_gather_inputs",
    "gathered",
    "refill",
    "unsharded_buffers",
    "gather_scales",
    "FUSED",
    "PADDED",
    "LOCAL",
]

FUSED, PADDED, LOCAL = "fused", "padded", "local"


class _Meta(NamedTuple):
    """Metadata passed by FSDP2 from ``fsdp_pre_all_gather`` to ``fsdp_post_all_gather``."""

    mode: str  # FUSED / PADDED / LOCAL
    float8_dtype: torch.dtype
    rows: int  # dim 0 of the unsharded tensor
    fast_accum: bool
    scale: Optional[torch.Tensor]  # gathered (padded) scales in PADDED / LOCAL mode, else None


def _padded_rows(rows: int, world_size: int) -> int:
    """Rows of the padded shard: ``torch.chunk`` (FSDP2's sharding) gives ``ceil(rows / world_size)`` per chunk."""
    return -(-rows // world_size)


def _pad_rows(t: torch.Tensor, rows: int, fill) -> torch.Tensor:
    """``t`` with dim 0 extended to ``rows`` (new rows = ``fill``); ``t`` itself when already that long."""
    if t.shape[0] == rows:
        return t.contiguous()
    out = torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
    n = t.shape[0]
    if n:
        out[:n].copy_(t)
    out[n:].fill_(fill)
    return out


def all_gather_inputs(qdata: torch.Tensor, scale: torch.Tensor, mesh, outer_size, fast_accum: bool):
    """Pad the local fp8 rows and row scales and choose how they travel (see the module docstring).

    Args:
        qdata: ``(r, *rest)`` fp8 local rows (``r`` may be 0).
        scale: ``(r, *srest)`` float32 scales of those rows.
        mesh: FSDP2's 1-D shard mesh.
        outer_size: the unsharded (FSDP-level) size.

    Returns:
        ``(all_gather_inputs, metadata)`` as FSDP2 expects them from ``fsdp_pre_all_gather``.
    """
    world_size = mesh.size()
    rows = int(outer_size[0])
    prow = _padded_rows(rows, world_size)
    data = _pad_rows(qdata.view(torch.uint8), prow, 0)
    scale = _pad_rows(scale, prow, 1.0)
    if world_size == 1:
        return (data,), _Meta(LOCAL, qdata.dtype, rows, fast_accum, scale)
    if rows % world_size == 0:
        return (data, scale), _Meta(FUSED, qdata.dtype, rows, fast_accum, None)
    gathered_scales = torch.empty((prow * world_size, *scale.shape[1:]), dtype=scale.dtype, device=scale.device)
    gather_scales(gathered_scales, scale, mesh.get_group())
    return (data,), _Meta(PADDED, qdata.dtype, rows, fast_accum, gathered_scales)


def gather_scales(out: torch.Tensor, scale: torch.Tensor, group) -> None:
    """The extra all-gather of the ``padded`` mode: ``out = cat(scale of every rank)`` over FSDP2's group.

    Issued on the same process group as FSDP2's all-gather and in the same order on every rank (each rank runs
    the pre-all-gather hooks of a group's parameters in the same order, before the group's all-gather). It waits
    on the host only with gloo; with NCCL the call enqueues and makes the current stream wait for it.
    """
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, scale, group=group)


def check_rowwise_input(t: torch.Tensor, op: str) -> None:
    """Raise ``NotImplementedError`` naming ``op`` unless ``t`` has at least 2 dims (FSDP2 fp8 all-gather)."""
    if t.ndim < 2:
        raise NotImplementedError(
            f"{op}: FSDP2 fp8 all-gather needs a weight with at least 2 dims (rows x columns), got shape "
            f"{tuple(t.shape)}"
        )


@torch.no_grad()
def master_pre_all_gather(master, mesh, outer_size, outer_stride, module, mp_policy):
    """``Fp8MasterWeight.fsdp_pre_all_gather``: quantize the local master rows row-wise, return fp8 data + scales.

    Each rank quantizes its own rows of the high-precision master (``amax`` over the last dim, the recipe's fp8
    format, as :meth:`ScaledFp8Tensor.from_hp`), directly from the master dtype (no intermediate cast to
    ``mp_policy.param_dtype``). Empty shards quantize nothing (no reduction over an empty tensor).

    Args:
        master: the local :class:`~fp8tensor.master.Fp8MasterWeight` shard, shape ``(r, *rest)``; only its
            high-precision ``_data`` and ``recipe.float8_dtype`` are read.
        mesh: FSDP2's shard mesh (1-D). outer_size / outer_stride: the unsharded size and contiguous stride.
        module, mp_policy: unused (part of FSDP2's signature).

    Returns:
        ``(all_gather_inputs, metadata)``; inputs are the padded ``uint8`` view of the fp8 rows and, when dim 0
        divides evenly, the padded float32 row scales.

    Raises:
        NotImplementedError: the weight has fewer than 2 dims.
    """
    data = master._data
    check_rowwise_input(data, "Fp8MasterWeight.fsdp_pre_all_gather")
    float8_dtype = getattr(master.recipe, "float8_dtype", E4M3)
    if data.numel() > 0:
        q, s = quantize(data, -1, float8_dtype)
    else:
        q = torch.empty(data.shape, dtype=float8_dtype, device=data.device)
        s = torch.empty((*data.shape[:-1], 1), dtype=torch.float32, device=data.device)
    return all_gather_inputs(q, s, mesh, outer_size, fast_accum=True)


@torch.no_grad()
def scaled_pre_all_gather(qdata: torch.Tensor, scale: torch.Tensor, fast_accum: bool, mesh, outer_size):
    """``ScaledFp8Tensor.fsdp_pre_all_gather``: gather the stored fp8 rows and their scales unchanged.

    A scale that is not per-row (size 1 on dim 0, e.g. one per column) is expanded to one per row before the
    gather, which keeps every value exact at the cost of a larger scale payload.

    Returns:
        ``(all_gather_inputs, metadata)``, as :func:`master_pre_all_gather`.
    """
    if scale.shape[0] != qdata.shape[0]:
        scale = scale.expand(qdata.shape[0], *scale.shape[1:])
    return all_gather_inputs(qdata, scale, mesh, outer_size, fast_accum=fast_accum)


def gathered(all_gather_outputs, metadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsharded ``(qdata, scale)``, views of the all-gather outputs (padding rows dropped).

    Args:
        all_gather_outputs: ``(data,)`` or ``(data, scale)``; ``data`` is ``(world * padded_rows, *rest)`` uint8.
        metadata: what ``fsdp_pre_all_gather`` returned.
    """
    meta: _Meta = metadata
    scale_full = all_gather_outputs[1] if meta.mode == FUSED else meta.scale
    return all_gather_outputs[0].view(meta.float8_dtype)[: meta.rows], scale_full[: meta.rows]


@torch.no_grad()
def refill(dst_qdata: torch.Tensor, dst_scale: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> None:
    """Copy gathered ``qdata`` / ``scale`` into the unsharded tensor's own ones (iterations after the first).

    Refills without bumping the version counters: the forward may have saved this weight for backward
    (torch.compile saves qdata and scale themselves), and the re-gather before backward writes the same
    values. FSDP2 does the same for the all-gather outputs it copies into."""
    for dst, src in ((dst_qdata, qdata), (dst_scale, scale)):
        if dst.data_ptr() != src.data_ptr():
            with torch.autograd._unsafe_preserve_version_counter(dst):
                dst.copy_(src)


@torch.no_grad()
def unsharded_buffers(all_gather_outputs, metadata):
    """First ``fsdp_post_all_gather``: ``(qdata, scale, inner_tensors)`` of the unsharded tensor.

    ``inner_tensors`` are the buffers FSDP2 frees on reshard and re-allocates before the next ``out=`` call; in the
    ``padded`` / ``local`` modes the scales are copied into such a buffer of their own."""
    meta: _Meta = metadata
    data_u8 = all_gather_outputs[0]
    scale_full = all_gather_outputs[1] if meta.mode == FUSED else meta.scale
    if meta.mode != FUSED:
        scale_full = scale_full.clone()
    return data_u8.view(meta.float8_dtype)[: meta.rows], scale_full[: meta.rows], (data_u8, scale_full)
