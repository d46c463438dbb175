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
``local``  world size 1: one ``uint8`` input packing the fp8 bytes and, 16-byte aligned after them, the float32
           scales (FSDP2 copies only the first input at world size 1); the unsharded tensor's data and scales both
           view the buffer FSDP2 fills, so later rounds copy nothing into it. With a parameter group quantized in
           one launch the kernel writes straight into the packed buffers.

The fp8 data is sent as ``uint8`` because gloo has no float8 dtypes (NCCL would accept either); nothing is lost, it
is a bit-level view. Padding rows are zeros with unit scales and are dropped after the gather: ``torch.chunk``
sharding puts every rank's real rows first, so the first ``rows`` gathered rows are exactly the unsharded tensor.

On later iterations FSDP2 calls ``fsdp_post_all_gather(..., out=unsharded_param)`` after re-allocating the storages
returned as inner tensors the first time; the unsharded :class:`ScaledFp8Tensor` views those storages, so only the
scales of the ``padded`` mode need a copy.

Editing FSDP2's private state (conversion after ``fully_shard``, dropping FSDP2's flat copy of an fp8 shard) is
:mod:`fp8tensor.fsdp_state`.
"""
from __future__ import annotations

import inspect
import types
import weakref
from typing import NamedTuple, Optional

import torch

from ..core import compat
from ..core.capture import capture_token
from .quantize import quantize, quantize_group, quantize_rows_into

__all__ = [
    "master_pre_all_gather",
    "register_group_finder",
    "scaled_pre_all_gather",
    "all_gather_inputs",
    "gathered",
    "refill",
    "unsharded_buffers",
    "gather_scales",
    "FUSED",
    "PADDED",
    "LOCAL",
    "pre_all_gather_hook",
]

FUSED, PADDED, LOCAL = "fused", "padded", "local"


class _BoundHook:
    """``fsdp_pre_all_gather`` bound to one tensor (see :class:`pre_all_gather_hook`); subclasses carry the
    ``__signature__`` FSDP2 reads. Behaves as the bound method: ``__self__``, ``__func__``, ``__name__``, equality
    and hash."""

    __slots__ = ("__func__", "__self__")

    def __init__(self, fn, obj):
        self.__func__, self.__self__ = fn, obj

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __name__(self):
        return self.__func__.__name__

    def __eq__(self, other):
        return (isinstance(other, (_BoundHook, types.MethodType)) and other.__func__ is self.__func__
                and other.__self__ is self.__self__)

    def __hash__(self):
        return hash((id(self.__func__), id(self.__self__)))

    def __repr__(self):
        return f"<bound method {self.__func__.__qualname__} of {type(self.__self__).__name__}>"


class pre_all_gather_hook:
    """Descriptor for a tensor subclass's ``fsdp_pre_all_gather`` method that makes FSDP2's per-call signature
    check cheap.

    FSDP2 calls ``inspect.signature(local.fsdp_pre_all_gather)`` before *every* pre-all-gather of every parameter
    (``FSDPParam.all_gather_inputs``, to pick the 1- or 5-argument form). On a bound method that builds a new
    ``Signature`` each time (dropping ``self``): several µs per parameter per all-gather, twice per block and step.
    Here attribute access returns a small callable whose class holds the bound signature, which
    ``inspect.signature`` returns as it is. Calls, ``hasattr`` and the signature are those of the bound method; while
    ``torch.compile`` traces, a plain bound method is returned."""

    def __init__(self, fn):
        self.fn = fn
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", "fsdp_pre_all_gather")
        sig = inspect.signature(fn)
        bound = sig.replace(parameters=list(sig.parameters.values())[1:])
        self._bound_cls = type("BoundPreAllGatherHook", (_BoundHook,),
                               {"__slots__": (), "__signature__": bound, "__doc__": fn.__doc__})

    def __get__(self, obj, owner=None):
        if obj is None:
            return self.fn
        if compat.is_compiling():
            return types.MethodType(self.fn, obj)
        return self._bound_cls(self.fn, obj)


class _Meta(NamedTuple):
    """Metadata passed by FSDP2 from ``fsdp_pre_all_gather`` to ``fsdp_post_all_gather``."""

    mode: str  # FUSED / PADDED / LOCAL
    float8_dtype: torch.dtype
    rows: int  # dim 0 of the unsharded tensor
    fast_accum: bool
    scale: Optional[torch.Tensor]  # gathered (padded) scales in PADDED mode, else None
    packed: Optional[tuple] = None  # LOCAL: (qdata shape, scale shape) of the packed payload


def _scale_offset(nbytes: int) -> int:
    """Byte offset of the scales in a packed ``local`` payload: after the fp8 bytes, 16-byte aligned."""
    return -(-nbytes // 16) * 16


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def packed_views(buf: torch.Tensor, qshape, sshape, float8_dtype: torch.dtype):
    """``(qdata, scale)`` viewing a packed ``local`` payload ``buf`` (1-D ``uint8``: the fp8 bytes of ``qshape``,
    zero padding to a 16-byte boundary, the float32 scales of ``sshape``)."""
    nq, ns = _numel(qshape), _numel(sshape)
    off = _scale_offset(nq)
    buf = buf.view(-1)
    return buf[:nq].view(float8_dtype).view(qshape), buf[off:off + 4 * ns].view(torch.float32).view(sshape)


def packed_buffers(shapes, float8_dtype: torch.dtype, device) -> list:
    """One allocation holding the packed ``local`` payloads of several weights: per ``(qshape, sshape)`` a 1-D
    ``uint8`` region (16-byte aligned) and its ``(qdata, scale)`` views, for the quantization to write into."""
    sizes = [_scale_offset(_scale_offset(_numel(q)) + 4 * _numel(sc)) for q, sc in shapes]
    flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    out, o = [], 0
    for (qshape, sshape), n in zip(shapes, sizes):
        region = flat[o:o + n]
        q, sc = packed_views(region, qshape, sshape, float8_dtype)
        nq = q.numel()
        if n > nq + 4 * sc.numel():  # padding bytes travel too: make them deterministic
            region[nq:_scale_offset(nq)].zero_()
            region[_scale_offset(nq) + 4 * sc.numel():].zero_()
        out.append((region, q, sc))
        o += n
    return out


def pack(qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The packed ``local`` payload of ``qdata`` and ``scale`` (a copy of both into one ``uint8`` buffer)."""
    ((region, q, sc),) = packed_buffers([(tuple(qdata.shape), tuple(scale.shape))], qdata.dtype, qdata.device)
    q.copy_(qdata)
    sc.copy_(scale)
    return region


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


def all_gather_inputs(qdata: torch.Tensor, scale: torch.Tensor, mesh, outer_size, fast_accum: bool,
                      packed: Optional[torch.Tensor] = None):
    """Pad the local fp8 rows and row scales and choose how they travel (see the module docstring).

    Args:
        qdata: ``(r, *rest)`` fp8 local rows (``r`` may be 0).
        scale: ``(r, *srest)`` float32 scales of those rows.
        mesh: FSDP2's 1-D shard mesh.
        outer_size: the unsharded (FSDP-level) size.
        fast_accum: carried to the unsharded tensor.
        packed: for a 1-rank mesh, the packed payload ``qdata`` and ``scale`` already view (see
            :func:`packed_buffers`); built here (a copy) when None.

    Returns:
        ``(all_gather_inputs, metadata)`` as FSDP2 expects them from ``fsdp_pre_all_gather``.
    """
    world_size = mesh.size()
    rows = int(outer_size[0])
    if world_size == 1:
        buf = packed if packed is not None else pack(qdata, scale)
        return (buf,), _Meta(LOCAL, qdata.dtype, rows, fast_accum, None, (tuple(qdata.shape), tuple(scale.shape)))
    prow = _padded_rows(rows, world_size)
    data = _pad_rows(qdata.view(torch.uint8), prow, 0)
    scale = _pad_rows(scale, prow, 1.0)
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


# ------------------------------------------------------------------------------------------ group quantization
#: ``fn(local) -> (group, locals)``: the FSDP2 parameter group holding the sharded local tensor ``local`` (any
#: weak-referenceable key) and that group's sharded local tensors; ``(None, [])`` when ``local`` is in none. Set by
#: fp8tensor.fsdp_state, which reads FSDP2's state; None: each weight is quantized on its own.
_GROUP_FINDER = None
#: Attribute of a master weight holding ``(data, data._version, tag, result)``: its result from an earlier weight's
#: launch over the whole FSDP2 parameter group in the same pre-all-gather round, until its own hook call takes it.
_PENDING_ATTR = "_fp8tensor_pending"


def register_group_finder(fn) -> None:
    """Let :func:`master_pre_all_gather` quantize a whole FSDP2 parameter group in one launch (see
    :func:`_group_quantized`); ``fn(local)`` returns ``(group, sharded local tensors of the group)``."""
    global _GROUP_FINDER
    _GROUP_FINDER = fn


class _Group(NamedTuple):
    group: object
    masters: list  # the master weights quantized together, ``master`` first
    datas: list  # their high-precision data
    data: torch.Tensor


def _take_pending(master, float8_dtype, tag):
    """``master``'s kept result from its group's earlier launch (for ``float8_dtype`` and tagged ``tag``), or None.

    A kept result is used only by the same data object at the same version: an update in between (an optimizer
    step, ``copy_``, ``load_state_dict``: :class:`~fp8tensor.master.Fp8MasterWeight` bumps its data's version for
    every op that writes it) or ``w.data = new`` makes the weight quantize again. It is taken once."""
    hit = master.__dict__.get(_PENDING_ATTR)
    if hit is None:
        return None
    master.__dict__[_PENDING_ATTR] = None
    data = master._data
    if hit[0] is data and hit[1] == data._version and hit[2] == (float8_dtype, tag, capture_token()):
        return hit[3]
    return None


def _keep_pending(found: "_Group", float8_dtype, tag, results) -> None:
    """Hand the later weights of a group launch their results (see :func:`_take_pending`). Tagged with the CUDA-graph
    capture they were made in (:func:`fp8tensor.capture.capture_token`): a result made outside a capture is never
    served inside one, where it would be baked into the graph."""
    token = capture_token()
    for m, d, r in zip(found.masters[1:], found.datas[1:], results[1:]):
        m.__dict__[_PENDING_ATTR] = (d, d._version, (float8_dtype, tag, token), r)


def _group_and_datas(master, float8_dtype, tag):
    """The kept result of ``master`` from its group's earlier launch (tagged ``tag``), or ``_Group`` (the FSDP2
    group and the master weights and high-precision data to quantize together, ``master``'s first), or None (no
    group, one weight, or ``torch.compile`` tracing the hook: each weight is then quantized on its own)."""
    if compat.is_compiling():
        return None
    hit = _take_pending(master, float8_dtype, tag)  # first: the later weights of a group need no group lookup
    if hit is not None:
        return hit
    data = master._data
    try:
        group, locals_ = _GROUP_FINDER(master)
    except Exception:  # FSDP2 internals changed: quantize weight by weight
        return None
    if group is None:
        return None
    masters, datas = [master], [data]
    for t in locals_:
        if t is master or type(t) is not type(master):
            continue
        t.__dict__[_PENDING_ATTR] = None  # a new round of this group: nothing kept from an earlier one is served
        if t.recipe.float8_dtype != float8_dtype:
            continue
        d = t._data
        if d.dtype == data.dtype and d.device == data.device and d.numel() > 0 and d.ndim >= 2:
            masters.append(t)
            datas.append(d)
    if len(datas) < 2:
        return None
    return _Group(group, masters, datas, data)


def _group_quantized(master, float8_dtype, packed: bool):
    """``(qdata, scale, payload)`` of ``master``'s rows from one launch over its whole FSDP2 parameter group, or None.
    With ``packed`` (a 1-rank mesh) the kernel writes straight into the packed ``local`` payloads
    (:func:`packed_buffers`) and ``payload`` is this weight's; else ``payload`` is None.

    FSDP2 calls the pre-all-gather hook once per parameter of a group, back to back. The first call quantizes every
    master weight of the group of the same class, fp8 format, dtype and device
    (:func:`fp8tensor.quantize.quantize_group`, the same bits as one launch each) and keeps the others' results until
    their own call. A kept result is used only by the same tensor at the same version (an optimizer step in between
    bumps the version, and the weight is quantized again)."""
    if _GROUP_FINDER is None:
        return None
    found = _group_and_datas(master, float8_dtype, packed)
    if not isinstance(found, _Group):
        return found
    datas, data = found.datas, found.data
    if packed:
        bufs = packed_buffers([(tuple(d.shape), (*d.shape[:-1], 1)) for d in datas], float8_dtype, data.device)
        quantize_group(datas, float8_dtype, out=[(q, s) for _, q, s in bufs])
        results = [(q, s, region) for region, q, s in bufs]
    else:
        results = [(q, s, None) for q, s in quantize_group(datas, float8_dtype)]
    _keep_pending(found, float8_dtype, packed, results)
    return results[0]


#: group -> (layout key, (total bytes, [(region offset, region bytes, q offset, s offset, metadata, zero ranges)]))
#: of the packed 1-rank payload of the group's weights: computed once, reused every step.
_LOCAL_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _local_plan(datas, float8_dtype):
    entries, o = [], 0
    for d in datas:
        nq = d.numel()
        ns = nq // d.shape[-1]
        off_s = _scale_offset(nq)
        n = _scale_offset(off_s + 4 * ns)
        zeros = [(o + a, o + b) for a, b in ((nq, off_s), (off_s + 4 * ns, n)) if b > a]
        meta = _Meta(LOCAL, float8_dtype, int(d.shape[0]), True, None, (tuple(d.shape), (*d.shape[:-1], 1)))
        entries.append((o, n, o, o + off_s, meta, zeros))
        o += n
    return o, entries


def _local_group_payload(master, float8_dtype):
    """FSDP2 on a 1-rank mesh: ``((payload,), metadata)`` of ``master``, from one launch over its parameter group,
    or None (no group, a single weight, or a weight the row kernel does not take).

    The first hook call of a round allocates one buffer for the group's packed payloads (layout computed once per
    group: :data:`_LOCAL_PLANS`) and has the row kernel write every weight's fp8 bytes and scales straight into it
    (:func:`fp8tensor.quantize.quantize_rows_into`; on CPU, weight by weight into the same layout); the
    others take their slice, as :func:`_group_quantized`. Same bytes as :func:`packed_buffers` +
    :func:`fp8tensor.quantize.quantize_group`."""
    if _GROUP_FINDER is None:
        return None
    found = _group_and_datas(master, float8_dtype, LOCAL)
    if not isinstance(found, _Group):
        return found
    group, datas, data = found.group, found.datas, found.data
    layout = (float8_dtype, tuple((tuple(d.shape), d.dtype) for d in datas))
    plan = _LOCAL_PLANS.get(group)
    if plan is None or plan[0] != layout:
        plan = _LOCAL_PLANS[group] = (layout, _local_plan(datas, float8_dtype))
    total, entries = plan[1]
    flat = torch.empty(total, dtype=torch.uint8, device=data.device)
    for _, _, _, _, _, zeros in entries:
        for a, b in zeros:  # padding bytes travel too: make them deterministic
            flat[a:b].zero_()
    base = flat.data_ptr()
    if not quantize_rows_into(datas, [base + e[2] for e in entries], [base + e[3] for e in entries], float8_dtype):
        # CPU, or a tensor the kernel does not take: the same bytes weight by weight
        for d, (o, n, _, _, meta, _) in zip(datas, entries):
            q, sc = packed_views(flat[o:o + n], *meta.packed, float8_dtype)
            qd, sd = quantize(d, -1, float8_dtype)
            q.copy_(qd)
            sc.copy_(sd)
    results = [((flat[o:o + n],), meta) for o, n, _, _, meta, _ in entries]
    _keep_pending(found, float8_dtype, LOCAL, results)
    return results[0]


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
    float8_dtype = master.recipe.float8_dtype
    local = mesh.size() == 1
    if local and data.numel() > 0:
        payload = _local_group_payload(master, float8_dtype)
        if payload is not None:
            return payload
    hit = _group_quantized(master, float8_dtype, local) if data.numel() > 0 else None
    packed = None
    if hit is not None:
        q, s, packed = hit
    elif data.numel() > 0:
        q, s = quantize(data, -1, float8_dtype)
    else:
        q = torch.empty(data.shape, dtype=float8_dtype, device=data.device)
        s = torch.empty((*data.shape[:-1], 1), dtype=torch.float32, device=data.device)
    return all_gather_inputs(q, s, mesh, outer_size, fast_accum=True, packed=packed)


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
    if meta.mode == LOCAL:
        return packed_views(all_gather_outputs[0], *meta.packed, meta.float8_dtype)
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
    ``padded`` mode the scales are copied into such a buffer of their own (``local``: data and scales both view
    the one gathered buffer)."""
    meta: _Meta = metadata
    data_u8 = all_gather_outputs[0]
    if meta.mode == LOCAL:
        q, s = packed_views(data_u8, *meta.packed, meta.float8_dtype)
        return q, s, (data_u8,)
    scale_full = all_gather_outputs[1] if meta.mode == FUSED else meta.scale
    if meta.mode != FUSED:
        scale_full = scale_full.clone()
    return data_u8.view(meta.float8_dtype)[: meta.rows], scale_full[: meta.rows], (data_u8, scale_full)
