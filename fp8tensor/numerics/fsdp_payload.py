"""FSDP2's fp8 all-gather: row-wise fp8 data plus row scales travel instead of high-precision weights (bit-exact:
FSDP2 shards whole rows). The ``fused`` / ``padded`` / ``local`` modes and the one-launch quantization of a parameter
group: docs/fsdp.md ("How the bytes travel")."""
from __future__ import annotations

import functools
import inspect
import math
import types
import weakref
from typing import NamedTuple, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..core import compat
from ..core.capture import capture_token
from .quantize import quantize, quantize_group, quantize_rows_into

__all__ = ["master_pre_all_gather", "scaled_pre_all_gather", "all_gather_inputs", "gathered", "refill",
           "unsharded_buffers", "gather_scales", "pack", "fsdp_params", "fsdp_group", "FUSED", "PADDED", "LOCAL",
           "pre_all_gather_hook"]

FUSED, PADDED, LOCAL = "fused", "padded", "local"


class pre_all_gather_hook:
    """Descriptor for ``fsdp_pre_all_gather`` whose ``inspect.signature`` (asked by FSDP2 on every call) is built
    once; a plain bound method while tracing."""

    def __init__(self, fn):
        self.fn, self.__doc__ = fn, fn.__doc__
        params = list(inspect.signature(fn).parameters.values())[1:]
        self._bound = type("BoundPreAllGatherHook", (), {
            "__slots__": ("__self__",), "__signature__": inspect.Signature(params), "__doc__": fn.__doc__,
            "__name__": fn.__name__, "__call__": lambda h, *a, **k: fn(h.__self__, *a, **k)})

    def __get__(self, obj, owner=None):
        if obj is None:
            return self.fn
        if compat.is_compiling():
            return types.MethodType(self.fn, obj)
        hook = self._bound.__new__(self._bound)
        hook.__self__ = obj
        return hook


class _Meta(NamedTuple):
    """Metadata passed by FSDP2 from ``fsdp_pre_all_gather`` to ``fsdp_post_all_gather``."""

    mode: str  # FUSED / PADDED / LOCAL
    float8_dtype: torch.dtype
    rows: int  # dim 0 of the unsharded tensor
    fast_accum: bool
    scale: Optional[torch.Tensor]  # gathered (padded) scales in PADDED mode, else None
    packed: Optional[tuple] = None  # LOCAL: (qdata shape, scale shape) of the packed payload


# ------------------------------------------------------------------------------------- the packed 1-rank payload
def _align16(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


@functools.lru_cache(maxsize=256)
def _packed_layout(shapes: tuple) -> tuple:
    """``(total bytes, [(start, bytes, scale offset)])`` of packed ``(qdata shape, scale shape)`` regions."""
    out, o = [], 0
    for qshape, sshape in shapes:
        off = _align16(math.prod(qshape))
        n = _align16(off + 4 * math.prod(sshape))
        out.append((o, n, off))
        o += n
    return o, out


def packed_views(buf: torch.Tensor, qshape, sshape, float8_dtype: torch.dtype):
    """``(qdata, scale)`` viewing a packed ``local`` payload ``buf`` (1-D ``uint8``)."""
    nq, ns, off = math.prod(qshape), math.prod(sshape), _align16(math.prod(qshape))
    buf = buf.view(-1)
    return buf[:nq].view(float8_dtype).view(qshape), buf[off:off + 4 * ns].view(torch.float32).view(sshape)


def _packed_quantize(datas: list, float8_dtype: torch.dtype) -> list:
    """``[(qdata, scale, payload)]``: each of ``datas`` quantized row-wise into its region of one packed buffer."""
    shapes = tuple((tuple(d.shape), (*d.shape[:-1], 1)) for d in datas)
    total, regions = _packed_layout(shapes)
    flat = torch.empty(total, dtype=torch.uint8, device=datas[0].device)
    out = []
    for (qshape, sshape), (o, n, off) in zip(shapes, regions):
        region = flat[o:o + n]
        q, s = packed_views(region, qshape, sshape, float8_dtype)
        nq, end = q.numel(), off + 4 * s.numel()
        if off > nq:  # padding bytes travel too: make them deterministic
            region[nq:off].zero_()
        if n > end:
            region[end:].zero_()
        out.append((q, s, region))
    base = flat.data_ptr() if not compat.is_compiling() else None
    if base is None or not quantize_rows_into(datas, [base + o for o, _, _ in regions],
                                              [base + o + off for o, _, off in regions], float8_dtype):
        for d, (q, s, _) in zip(datas, out):
            qd, sd = quantize(d, -1, float8_dtype)
            q.copy_(qd)
            s.copy_(sd)
    return out


def pack(qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The packed ``local`` payload of ``qdata`` and its row ``scale`` (a copy of both into one ``uint8`` buffer)."""
    total, _ = _packed_layout(((tuple(qdata.shape), tuple(scale.shape)),))
    buf = torch.zeros(total, dtype=torch.uint8, device=qdata.device)
    q, s = packed_views(buf, qdata.shape, scale.shape, qdata.dtype)
    q.copy_(qdata)
    s.copy_(scale)
    return buf


# ------------------------------------------------------------------------------------------ what goes on the wire
def _pad_rows(t: torch.Tensor, rows: int, fill) -> torch.Tensor:
    """``t`` with dim 0 extended to ``rows`` (new rows = ``fill``); ``t`` itself when already that long."""
    if t.shape[0] == rows:
        return t.contiguous()
    out = torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
    out[:t.shape[0]].copy_(t)
    out[t.shape[0]:].fill_(fill)
    return out


def all_gather_inputs(qdata: torch.Tensor, scale: torch.Tensor, mesh, outer_size, fast_accum: bool,
                      packed: Optional[torch.Tensor] = None):
    """Pad the local fp8 rows and row scales and choose how they travel (docs/fsdp.md): ``(all_gather_inputs,
    metadata)`` as FSDP2 expects them from ``fsdp_pre_all_gather``.

    Args:
        qdata: ``(r, *rest)`` fp8 local rows (``r`` may be 0). scale: ``(r, *srest)`` float32 scales of those rows.
        mesh: FSDP2's 1-D shard mesh. outer_size: the unsharded size. fast_accum: carried to the unsharded tensor.
        packed: on a 1-rank mesh, the packed payload ``qdata`` and ``scale`` already view; built here when None.

    Raises:
        NotImplementedError: on a mesh of more than one rank, the local shard is not a dim-0 shard of the unsharded
            tensor (a shard on any other dim, from ``fully_shard``'s ``shard_placement_fn``), on every rank alike.
    """
    world_size, rows = mesh.size(), int(outer_size[0])
    if tuple(qdata.shape[1:]) != tuple(int(d) for d in outer_size[1:]):
        raise NotImplementedError(
            f"fp8tensor (FSDP2 fp8 all-gather): this parameter is sharded on a dim other than 0 (local shard "
            f"{tuple(qdata.shape)} of {tuple(int(d) for d in outer_size)}, e.g. by fully_shard's shard_placement_fn): "
            "the fp8 all-gather quantizes and gathers whole rows with their row scales, which needs FSDP2's default "
            "Shard(0). Shard fp8 weights on dim 0 (no shard_placement_fn for them, or one returning Shard(0)), or "
            "gather master weights in high precision: convert_to_fp8(model, fp8_all_gather=False)")
    if world_size == 1:
        buf = packed if packed is not None else pack(qdata, scale)
        return (buf,), _Meta(LOCAL, qdata.dtype, rows, fast_accum, None, (tuple(qdata.shape), tuple(scale.shape)))
    prow = -(-rows // world_size)  # torch.chunk (FSDP2's sharding): ceil(rows / world_size) rows per chunk
    data = _pad_rows(qdata.view(torch.uint8), prow, 0)
    scale = _pad_rows(scale, prow, 1.0)
    if rows % world_size == 0:
        return (data, scale), _Meta(FUSED, qdata.dtype, rows, fast_accum, None)
    gathered_scales = torch.empty((prow * world_size, *scale.shape[1:]), dtype=scale.dtype, device=scale.device)
    gather_scales(gathered_scales, scale, mesh.get_group())
    return (data,), _Meta(PADDED, qdata.dtype, rows, fast_accum, gathered_scales)


def gather_scales(out: torch.Tensor, scale: torch.Tensor, group) -> None:
    """The extra all-gather of the ``padded`` mode: ``out = cat(scale of every rank)`` over FSDP2's group."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, scale, group=group)


def check_rowwise_input(t: torch.Tensor, op: str) -> None:
    """Raise ``NotImplementedError`` naming ``op`` unless ``t`` has at least 2 dims (FSDP2 fp8 all-gather)."""
    if t.ndim < 2:
        raise NotImplementedError(f"{op}: FSDP2 fp8 all-gather needs a weight with at least 2 dims (rows x columns), "
                                  f"got shape {tuple(t.shape)}")


# ------------------------------------------------------------------------------- FSDP2 state: groups, flat copies
_GROUP_OF = WeakIdKeyDictionary()  # sharded local tensor -> weakref to its FSDPParamGroup (by identity)
_FSDP_PARAM_OF = WeakIdKeyDictionary()  # sharded local tensor -> weakref to its FSDPParam


def fsdp_params(module: Optional[torch.nn.Module] = None) -> list:
    """All ``FSDPParam`` s, of the FSDP2 states of ``module``'s submodules or (``None``) of every live state."""
    states = compat.fsdp_states() if module is None else [
        s for m in module.modules() if (s := compat.fsdp_module_state(m)) is not None]
    return [fp for state in states for g in compat.fsdp_param_groups(state) for fp in compat.fsdp_params_of(g)]


def fsdp_group(local):
    """``(FSDPParamGroup, its sharded local tensors)`` holding ``local``, or ``(None, [])`` (cached weakly)."""
    ref = _GROUP_OF.get(local)
    group = ref() if ref is not None else None
    if group is None:
        group = next((g for state in compat.fsdp_states() for g in compat.fsdp_param_groups(state)
                      if any(compat.fsdp_sharded_local(fp) is local for fp in compat.fsdp_params_of(g))), None)
        if group is None:
            return None, []
        _GROUP_OF[local] = weakref.ref(group)
    return group, [compat.fsdp_sharded_local(fp) for fp in compat.fsdp_params_of(group)]


def _drop_flat_copy(local) -> None:
    """Replace FSDP2's flat copy of a ScaledFp8Tensor shard (5x its size, unused here) by the shard itself."""
    ref = _FSDP_PARAM_OF.get(local)
    fp = ref() if ref is not None else None
    if fp is None:
        fp = next((f for f in fsdp_params() if compat.fsdp_sharded_local(f) is local), None)
        if fp is None:
            return
        _FSDP_PARAM_OF[local] = weakref.ref(fp)
    if compat.fsdp_flat_shard(fp) is not local:
        compat.fsdp_set_flat_shard(fp, local)


# ---------------------------------------------------------------------------------------------- the two hooks
_PENDING = "_fp8tensor_pending"  # master attribute: (data, version, key, result) kept from its group's launch


def _group_members(master, float8_dtype) -> tuple[list, list]:
    """The masters (``master`` first) and data to quantize together: its FSDP2 group's alike members."""
    data = master._data
    try:
        _, locals_ = fsdp_group(master)
    except Exception:  # FSDP2 internals changed: quantize weight by weight
        return [master], [data]
    masters, datas = [master], [data]
    for t in locals_:
        if t is master or type(t) is not type(master):
            continue
        t.__dict__[_PENDING] = None  # a new round of this group: nothing kept from an earlier one is served
        d = t._data
        if (t.recipe.float8_dtype == float8_dtype and d.dtype == data.dtype and d.device == data.device
                and d.numel() > 0 and d.ndim >= 2):
            masters.append(t)
            datas.append(d)
    return masters, datas


def _quantized_rows(master, float8_dtype, local: bool):
    """``(qdata, scale, 1-rank payload or None)`` of ``master``'s rows, from its group's launch (kept or made now)."""
    if compat.is_compiling():
        masters, datas = [master], [master._data]
    else:
        key = (float8_dtype, local, capture_token())  # a result made outside a CUDA-graph capture: never served in one
        data, hit = master._data, master.__dict__.get(_PENDING)
        master.__dict__[_PENDING] = None
        if hit is not None and hit[0] is data and hit[1] == data._version and hit[2] == key:
            return hit[3]
        masters, datas = _group_members(master, float8_dtype)
    if local:
        results = _packed_quantize(datas, float8_dtype)
    else:
        results = [(q, s, None) for q, s in quantize_group(datas, float8_dtype)]
    for m, d, r in zip(masters[1:], datas[1:], results[1:]):
        m.__dict__[_PENDING] = (d, d._version, key, r)
    return results[0]


@torch.no_grad()
def master_pre_all_gather(master, mesh, outer_size, outer_stride, module, mp_policy):
    """``Fp8MasterWeight.fsdp_pre_all_gather``: the local master rows quantized row-wise (as ``from_hp``, the
    recipe's format, from the master dtype) with its FSDP2 parameter group in one launch; returns
    ``(all_gather_inputs, metadata)`` (see :func:`all_gather_inputs`).

    ``master``: the local ``Fp8MasterWeight`` shard ``(r, *rest)``; the other arguments are FSDP2's. Raises
    ``NotImplementedError``: the weight has fewer than 2 dims.
    """
    data = master._data
    check_rowwise_input(data, "Fp8MasterWeight.fsdp_pre_all_gather")
    float8_dtype, packed = master.recipe.float8_dtype, None
    if data.numel() > 0:
        q, s, packed = _quantized_rows(master, float8_dtype, mesh.size() == 1)
    else:
        q = torch.empty(data.shape, dtype=float8_dtype, device=data.device)
        s = torch.empty((*data.shape[:-1], 1), dtype=torch.float32, device=data.device)
    return all_gather_inputs(q, s, mesh, outer_size, fast_accum=True, packed=packed)


@torch.no_grad()
def scaled_pre_all_gather(local, mesh, outer_size):
    """``ScaledFp8Tensor.fsdp_pre_all_gather``: gather the stored fp8 rows of ``local`` and their (per-row) scales.

    Returns ``(all_gather_inputs, metadata)``. Raises ``NotImplementedError``: fewer than 2 dims.
    """
    check_rowwise_input(local, "ScaledFp8Tensor.fsdp_pre_all_gather")
    if not compat.is_compiling():
        _drop_flat_copy(local)
    qdata, scale = local.qdata, local.scale
    if scale.shape[0] != qdata.shape[0]:
        scale = scale.expand(qdata.shape[0], *scale.shape[1:])
    return all_gather_inputs(qdata, scale, mesh, outer_size, fast_accum=local.fast_accum)


# ------------------------------------------------------------------------------------------- after the gather
def gathered(all_gather_outputs, metadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsharded ``(qdata, scale)``, views of the all-gather outputs (``(data,)`` or ``(data, scale)``, ``data``
    ``(world * padded_rows, *rest)`` uint8) without the padding rows."""
    return unsharded_buffers(all_gather_outputs, metadata, copy_scale=False)[:2]


@torch.no_grad()
def refill(dst_qdata: torch.Tensor, dst_scale: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> None:
    """Copy gathered ``qdata`` / ``scale`` into the unsharded tensor's own, version counters untouched (as FSDP2)."""
    for dst, src in ((dst_qdata, qdata), (dst_scale, scale)):
        if dst.data_ptr() != src.data_ptr():
            with compat.preserve_version_counter(dst):
                dst.copy_(src)


@torch.no_grad()
def unsharded_buffers(all_gather_outputs, metadata, copy_scale: bool = True):
    """First ``fsdp_post_all_gather``: ``(qdata, scale, inner_tensors)`` of the unsharded tensor; ``inner_tensors``:
    the buffers FSDP2 frees on reshard (``padded`` mode: the scales copied into one, unless ``copy_scale`` is False)."""
    meta: _Meta = metadata
    data_u8 = all_gather_outputs[0]
    if meta.mode == LOCAL:
        return (*packed_views(data_u8, *meta.packed, meta.float8_dtype), (data_u8,))
    scale_full = all_gather_outputs[1] if meta.mode == FUSED else meta.scale.clone() if copy_scale else meta.scale
    return data_u8.view(meta.float8_dtype)[: meta.rows], scale_full[: meta.rows], (data_u8, scale_full)
