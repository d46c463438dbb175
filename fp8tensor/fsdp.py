"""FSDP2 fp8 all-gather: gather row-wise fp8 data plus row scales instead of high-precision weights.

FSDP2 (``torch.distributed.fsdp.fully_shard``) shards every parameter on dim 0, i.e. by whole rows. A row-wise scale
(one float32 per row, the amax taken over the last dim) computed on a rank's shard is therefore *the* global row
scale of those rows, and an all-gather of the fp8 rows plus their scales reproduces, bit for bit, what quantizing the
unsharded weight would give. It moves ``K + 4`` bytes per row of ``K`` elements instead of ``2 K`` (bf16) or ``4 K``
(fp32).

The hooks are FSDP2's all-gather extension protocol (see ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``,
"[Note: FSDP tensors]"): ``fsdp_pre_all_gather`` on the *sharded local tensor* returns the all-gather inputs plus
metadata, ``fsdp_post_all_gather`` turns the all-gather outputs into the unsharded tensor the forward sees.

* :class:`~fp8tensor.training.Fp8MasterWeight` (training): quantizes its local high-precision rows
  (:func:`master_pre_all_gather`); the forward receives a :class:`~fp8tensor.tensor.ScaledFp8Tensor` whose logical
  dtype is the mixed-precision ``param_dtype``; ``fp8_linear`` then uses it as is (scale folding for grad_input),
  and the weight gradient (a plain high-precision tensor) is reduce-scattered by FSDP2 in ``reduce_dtype`` into the
  high-precision master shard.
* :class:`~fp8tensor.tensor.ScaledFp8Tensor` (frozen fp8 weights): gathers its data and scales as they are
  (:func:`scaled_pre_all_gather`).

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

:func:`refresh_fsdp_param` lets :func:`fp8tensor.convert_to_fp8` / :func:`fp8tensor.quantize_weights` run after
``fully_shard``: it finds the ``FSDPParam`` that owns the swapped parameter and resets its extension state and cached
all-gather buffers; :func:`check_fsdp_sharded` refuses, before anything changes, to convert parameters that FSDP2
currently holds unsharded.
"""
from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .quantize import E4M3, quantize_rowwise
from .tensor import ScaledFp8Tensor, _is_dtensor

__all__ = [
    "master_pre_all_gather",
    "scaled_pre_all_gather",
    "post_all_gather",
    "refresh_fsdp_param",
    "refresh_fsdp_module",
    "find_fsdp_param",
    "check_fsdp_sharded",
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


def _all_gather_inputs(qdata: torch.Tensor, scale: torch.Tensor, mesh, outer_size, fast_accum: bool):
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
    gathered = torch.empty((prow * world_size, *scale.shape[1:]), dtype=scale.dtype, device=scale.device)
    gather_scales(gathered, scale, mesh.get_group())
    return (data,), _Meta(PADDED, qdata.dtype, rows, fast_accum, gathered)


def gather_scales(out: torch.Tensor, scale: torch.Tensor, group) -> None:
    """The extra all-gather of the ``padded`` mode: ``out = cat(scale of every rank)`` over FSDP2's group.

    Issued on the same process group as FSDP2's all-gather and in the same order on every rank (each rank runs
    the pre-all-gather hooks of a group's parameters in the same order, before the group's all-gather). It waits
    on the host only with gloo; with NCCL the call enqueues and makes the current stream wait for it.
    """
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, scale, group=group)


def _check_rowwise_input(t: torch.Tensor, op: str) -> None:
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
        master: the local :class:`~fp8tensor.training.Fp8MasterWeight` shard, shape ``(r, *rest)``.
        mesh: FSDP2's shard mesh (1-D). outer_size / outer_stride: the unsharded size and contiguous stride.
        module, mp_policy: unused (part of FSDP2's signature).

    Returns:
        ``(all_gather_inputs, metadata)``; inputs are the padded ``uint8`` view of the fp8 rows and, when dim 0
        divides evenly, the padded float32 row scales.

    Raises:
        NotImplementedError: the weight has fewer than 2 dims.
    """
    data = master._data
    _check_rowwise_input(data, "Fp8MasterWeight.fsdp_pre_all_gather")
    float8_dtype = getattr(master.recipe, "float8_dtype", E4M3)
    if data.numel() > 0:
        q, s = quantize_rowwise(data, dim=-1, float8_dtype=float8_dtype)
    else:
        q = torch.empty(data.shape, dtype=float8_dtype, device=data.device)
        s = torch.empty((*data.shape[:-1], 1), dtype=torch.float32, device=data.device)
    return _all_gather_inputs(q, s, mesh, outer_size, fast_accum=True)


# Keyed by tensor identity (a WeakKeyDictionary would compare colliding tensor keys with ``==``).
_FSDP_PARAM_OF = WeakIdKeyDictionary()


def _drop_flat_copy(local: ScaledFp8Tensor) -> None:
    """Free the flat copy FSDP2 keeps of a ScaledFp8Tensor shard.

    FSDP2 stores ``_sharded_param_data = local.view(-1)`` (at ``fully_shard``, lazy init and after
    ``load_state_dict``); it is the all-gather input of the default path only, which an extension never takes. For a
    ScaledFp8Tensor a 1-D view needs one scale per *element* (4 bytes each, on top of the 1-byte data), so the copy
    would cost 5x the fp8 shard. It is replaced by the shard itself (same storage, nothing extra). The owning
    ``FSDPParam`` is looked up once per local tensor.
    """
    ref = _FSDP_PARAM_OF.get(local)
    fp = ref() if ref is not None else None
    if fp is None:
        fp = next((f for f in _fsdp_params() if f._sharded_local_tensor is local), None)
        if fp is None:
            return
        _FSDP_PARAM_OF[local] = weakref.ref(fp)  # weak both ways: the FSDPParam holds the local tensor
    if fp._sharded_param_data is not local:
        fp._sharded_param_data = local


@torch.no_grad()
def scaled_pre_all_gather(t: ScaledFp8Tensor, mesh, outer_size, outer_stride, module, mp_policy):
    """``ScaledFp8Tensor.fsdp_pre_all_gather``: gather the stored fp8 rows and their scales unchanged.

    A scale that is not per-row (size 1 on dim 0, e.g. one per column) is expanded to one per row before the
    gather, which keeps every value exact at the cost of a larger scale payload.

    Returns:
        ``(all_gather_inputs, metadata)``, as :func:`master_pre_all_gather`.

    Raises:
        NotImplementedError: the tensor has fewer than 2 dims.
    """
    _check_rowwise_input(t, "ScaledFp8Tensor.fsdp_pre_all_gather")
    _drop_flat_copy(t)
    scale = t.scale
    if scale.shape[0] != t.shape[0]:
        scale = scale.expand(t.shape[0], *scale.shape[1:])
    return _all_gather_inputs(t.qdata, scale, mesh, outer_size, fast_accum=t.fast_accum)


@torch.no_grad()
def post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
    """``fsdp_post_all_gather`` of both subclasses: build (or refill) the unsharded :class:`ScaledFp8Tensor`.

    Args:
        self: the sharded local tensor (unused apart from FSDP2 calling the method on it).
        all_gather_outputs: ``(data,)`` or ``(data, scale)``; ``data`` is ``(world * padded_rows, *rest)`` uint8.
        metadata: what ``fsdp_pre_all_gather`` returned.
        param_dtype: logical dtype of the result (``MixedPrecisionPolicy.param_dtype`` or the master dtype).
        out: on iterations after the first, the unsharded parameter built the first time (a ScaledFp8Tensor, or
            a DTensor of one with tensor parallelism); it is refilled in place and ``None`` is returned.

    Returns:
        First call: ``(ScaledFp8Tensor of shape (rows, *rest), inner_tensors)``; FSDP2 frees and re-allocates
        ``inner_tensors`` between iterations. With ``out``: ``None``.

    Raises:
        RuntimeError: ``out`` is not a ScaledFp8Tensor of the gathered shape.
    """
    meta: _Meta = metadata
    data_u8 = all_gather_outputs[0]
    scale_full = all_gather_outputs[1] if meta.mode == FUSED else meta.scale
    rows = meta.rows
    qdata = data_u8.view(meta.float8_dtype)[:rows]
    scale = scale_full[:rows]
    if out is not None:
        target = out._local_tensor if _is_dtensor(out) else out
        if not isinstance(target, ScaledFp8Tensor) or tuple(target.shape) != tuple(qdata.shape):
            raise RuntimeError(
                f"fp8tensor fsdp_post_all_gather: out= must be the ScaledFp8Tensor of shape {tuple(qdata.shape)} "
                f"built on the first all-gather, got {type(target).__name__} of shape {tuple(target.shape)}"
            )
        # Refill without bumping the version counters: the forward may have saved this weight for backward
        # (torch.compile saves qdata and scale themselves), and the re-gather before backward writes the same
        # values. FSDP2 does the same for the all-gather outputs it copies into.
        for dst, src in ((target.qdata, qdata), (target.scale, scale)):
            if dst.data_ptr() != src.data_ptr():
                with torch.autograd._unsafe_preserve_version_counter(dst):
                    dst.copy_(src)
        return None
    if meta.mode != FUSED:
        # Own the scales in a buffer that FSDP2 frees on reshard and re-allocates before the next ``out=`` call.
        scale_full = scale_full.clone()
        scale = scale_full[:rows]
    unsharded = ScaledFp8Tensor(qdata, scale, param_dtype, meta.fast_accum)
    return unsharded, (data_u8, scale_full)


# ------------------------------------------------------------------------------------------ conversion after sharding
def _fsdp_states():
    """The live FSDP2 states (one per module ``fully_shard`` was applied to)."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:  # pragma: no cover - builds without distributed, very old torch
        return []
    states = []
    for ref in list(_module_state_mapping.values()):
        state = ref()
        if isinstance(state, FSDPState) and all(state is not s for s in states):
            states.append(state)
    return states


def _param_groups(state):
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.12: a single optional group
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return groups


def _fsdp_params(module: Optional[torch.nn.Module] = None):
    """All ``FSDPParam`` s, of the FSDP2 states of ``module``'s submodules or (``None``) of every live state."""
    from torch.distributed._composable_state import _get_module_state

    if module is None:
        states = _fsdp_states()
    else:
        states = [s for m in module.modules() if (s := _get_module_state(m)) is not None]
    out = []
    for state in states:
        for group in _param_groups(state):
            out.extend(group.fsdp_params)
    return out


def find_fsdp_param(param: torch.Tensor, module: Optional[torch.nn.Module] = None):
    """The FSDP2 ``FSDPParam`` whose sharded parameter is ``param`` (searched under ``module`` if given), or None."""
    for fp in _fsdp_params(module):
        if fp.sharded_param is param:
            return fp
    return None


def _refresh(fp) -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    from .training import Fp8MasterWeight

    if fp.sharded_state != ShardedState.SHARDED:
        raise RuntimeError(
            f"fp8tensor: cannot convert FSDP2 parameter {fp._param_fqn or fp._module_info.param_name!r} while it is "
            f"unsharded ({fp.sharded_state.name}); call model.reshard() (or convert before the first forward)"
        )
    # FSDP2's reset_sharded_param (run at lazy init and after load_state_dict) compares storages of a plain
    # ``_sharded_param_data`` with the local tensor, which a wrapper subclass has none of: give it the subclass.
    # The extension path never reads ``_sharded_param_data`` otherwise (it is the default path's all-gather input).
    local = fp._sharded_local_tensor
    fp._sharded_param_data = local.view(-1) if isinstance(local, Fp8MasterWeight) else local
    fp._init_extensions()
    # Buffers sized and typed for the previous all-gather inputs: rebuild them on the next all-gather.
    fp.all_gather_outputs = []
    if hasattr(fp, "_unsharded_param"):
        del fp._unsharded_param
    if hasattr(fp, "orig_dtype"):
        fp.init_dtype_attrs(fp.mp_policy)


def refresh_fsdp_param(param: torch.Tensor, module: Optional[torch.nn.Module] = None) -> bool:
    """Make FSDP2 pick up a swapped local tensor of ``param`` (``param._local_tensor = new`` after ``fully_shard``).

    Finds the ``FSDPParam`` owning ``param`` (among the FSDP2 states under ``module``, or all live ones), re-pads
    its sharded data, re-initializes its all-gather extension state (``_init_extensions``) and drops the cached
    all-gather outputs and unsharded parameter, which were typed for the old local tensor. A parameter not managed
    by FSDP2 is left alone.

    Returns:
        True if an FSDP2 parameter was refreshed.

    Raises:
        RuntimeError: the parameter is currently unsharded (between forward and backward, or after a forward with
            ``reshard_after_forward=False``): reshard first.
    """
    if not _is_dtensor(param):
        return False
    fp = find_fsdp_param(param, module)
    if fp is None:
        return False
    _refresh(fp)
    return True


def check_fsdp_sharded(params, op: str) -> None:
    """Raise before a conversion if any of ``params`` is an FSDP2 parameter currently held *unsharded*.

    Between a forward with ``reshard_after_forward=False`` and the backward (or after ``unshard()``), a module's
    attribute is FSDP2's unsharded parameter, not the sharded one the optimizer holds: swapping it would be lost
    (or silently bypass FSDP2) at the next reshard. Nothing is changed when this raises.

    Raises:
        RuntimeError: naming ``op`` and the parameter; call ``model.reshard()`` first.
    """
    params = [p for p in params if isinstance(p, torch.Tensor)]
    if not params:
        return
    fps = _fsdp_params()
    if not fps:
        return
    ids = {id(p) for p in params}
    for fp in fps:
        unsharded = getattr(fp, "_unsharded_param", None)
        if unsharded is not None and id(unsharded) in ids and fp.sharded_state.name != "SHARDED":
            raise RuntimeError(
                f"{op}: parameter {fp._param_fqn or fp._module_info.param_name!r} is currently unsharded by FSDP2 "
                f"({fp.sharded_state.name}); call model.reshard() (or convert before the first forward). "
                "The model was not changed."
            )


def refresh_fsdp_module(module: torch.nn.Module) -> int:
    """:func:`refresh_fsdp_param` for every FSDP2 parameter under ``module`` whose local tensor is an fp8tensor
    subclass; returns how many were refreshed."""
    from .training import Fp8MasterWeight

    n = 0
    for fp in _fsdp_params(module):
        if isinstance(fp._sharded_local_tensor, (Fp8MasterWeight, ScaledFp8Tensor)):
            _refresh(fp)
            n += 1
    return n
