"""Editing FSDP2's private state for fp8tensor subclasses (the payload that goes on the wire is :mod:`fp8tensor.fsdp`).

* :func:`refresh_fsdp_param` lets :func:`fp8tensor.convert_to_fp8` / :func:`fp8tensor.quantize_weights` run after
  ``fully_shard``: it finds the ``FSDPParam`` that owns the swapped parameter and resets its extension state and
  cached all-gather buffers;
* :func:`check_fsdp_sharded` refuses, before anything changes, to convert parameters that FSDP2 currently holds
  unsharded;
* the flat copy FSDP2 keeps of a :class:`~fp8tensor.tensor.ScaledFp8Tensor` shard is dropped before each of its
  all-gathers (registered with :func:`fp8tensor.tensor.register_fsdp_pre_all_gather_callback` on import).

These read and write attributes of FSDP2's ``FSDPParam`` / ``FSDPState`` that are not public API
(``torch/distributed/fsdp/_fully_shard/``).
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .master import Fp8MasterWeight
from .tensor import ScaledFp8Tensor, _is_dtensor, register_fsdp_pre_all_gather_callback

__all__ = ["refresh_fsdp_param", "find_fsdp_param", "check_fsdp_sharded"]


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


register_fsdp_pre_all_gather_callback(_drop_flat_copy)
