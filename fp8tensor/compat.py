"""Every use of a private PyTorch API by fp8tensor, in one place, gated by the torch version where it differs.

fp8tensor supports torch 2.11 to 2.14. The rest of the package reaches private torch state only through the
functions here, so a torch upgrade that moves one of them breaks (or is fixed) in this module alone;
``tests/test_compat.py`` checks each of them against the installed torch.
"""
from __future__ import annotations

import torch

__all__ = ["TORCH_VERSION", "register_foreach_type", "local_tensor", "set_local_tensor", "dtensor_spec",
           "dispatch_modes_active", "function_modes_active", "functorch_active", "fsdp_states", "fsdp_param_groups",
           "fsdp_module_state", "fsdp_params_of", "fsdp_sharded_local", "fsdp_param_name", "fsdp_is_sharded",
           "fsdp_state_name", "fsdp_unsharded_param", "fsdp_flat_shard", "fsdp_set_flat_shard",
           "fsdp_reset_extension"]


def _version(v: str) -> tuple:
    parts = []
    for p in v.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


#: ``(major, minor)`` of the installed torch.
TORCH_VERSION = _version(torch.__version__)


def register_foreach_type(cls: type) -> None:
    """Let optimizers pick their foreach / fused implementations for parameters of type ``cls`` by default (as
    ``torch.distributed.tensor`` does for ``DTensor``): ``torch.optim`` and ``torch.utils._foreach_utils`` test
    ``type(p)`` against a private list, and fall back to a Python loop over the parameters otherwise."""
    from torch.optim import optimizer as _optimizer
    from torch.utils import _foreach_utils

    for types in (_optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if cls not in types:
            types.append(cls)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor without ``to_local``'s autograd Function (the attribute ``_local_tensor``)."""
    return t._local_tensor


def set_local_tensor(t: torch.Tensor, local: torch.Tensor) -> None:
    """Swap a DTensor's local tensor in place (same shape, dtype and device)."""
    t._local_tensor = local


def dtensor_spec(t: torch.Tensor):
    """A DTensor's ``DTensorSpec`` (mesh, placements, global shape and stride): the attribute ``_spec``."""
    return t._spec


def dispatch_modes_active() -> bool:
    """Whether any ``TorchDispatchMode`` is active."""
    return torch._C._len_torch_dispatch_stack() > 0


def function_modes_active() -> bool:
    """Whether any ``TorchFunctionMode`` is active."""
    return torch._C._len_torch_function_stack() > 0


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap, ...) is active."""
    return torch._C._are_functorch_transforms_active()


# ------------------------------------------------------------------------------------------------ FSDP2 internals
# ``torch/distributed/fsdp/_fully_shard/``: FSDPState (one per fully_shard-ed module), FSDPParamGroup, FSDPParam.


def fsdp_states() -> list:
    """The live FSDP2 states (one per module ``fully_shard`` was applied to); [] without torch.distributed."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:  # pragma: no cover - builds without distributed
        return []
    states = []
    for ref in list(_module_state_mapping.values()):
        state = ref()
        if isinstance(state, FSDPState) and all(state is not s for s in states):
            states.append(state)
    return states


def fsdp_module_state(module: torch.nn.Module):
    """The composable state attached to ``module`` (FSDP2's ``FSDPState`` after ``fully_shard``), or None."""
    from torch.distributed._composable_state import _get_module_state

    return _get_module_state(module)


def fsdp_param_groups(state) -> list:
    """The ``FSDPParamGroup`` s of an FSDP2 state (torch >= 2.12: a list; 2.11: one optional group)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return groups


def fsdp_params_of(group) -> list:
    """The ``FSDPParam`` s of a parameter group."""
    return group.fsdp_params


def fsdp_sharded_local(fp) -> torch.Tensor:
    """The sharded local tensor of an ``FSDPParam`` (the local tensor of its sharded DTensor parameter)."""
    return fp._sharded_local_tensor


def fsdp_param_name(fp) -> str:
    """A readable name of an ``FSDPParam``'s parameter (its FQN where FSDP2 recorded it)."""
    return getattr(fp, "_param_fqn", None) or fp._module_info.param_name


def fsdp_is_sharded(fp) -> bool:
    """Whether an ``FSDPParam`` is in its sharded state (not unsharded between forward and backward)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    return fp.sharded_state == ShardedState.SHARDED


def fsdp_state_name(fp) -> str:
    """The name of an ``FSDPParam``'s sharded state (``SHARDED``, ``UNSHARDED``, ...)."""
    return fp.sharded_state.name


def fsdp_unsharded_param(fp):
    """FSDP2's unsharded parameter of an ``FSDPParam`` if one exists, else None."""
    return getattr(fp, "_unsharded_param", None)


def fsdp_flat_shard(fp) -> torch.Tensor:
    """The flat copy FSDP2 keeps of a shard (``_sharded_param_data``: the default all-gather path's input)."""
    return fp._sharded_param_data


def fsdp_set_flat_shard(fp, t: torch.Tensor) -> None:
    """Replace the flat copy FSDP2 keeps of a shard (see :func:`fsdp_flat_shard`)."""
    fp._sharded_param_data = t


def fsdp_reset_extension(fp) -> None:
    """Make an ``FSDPParam`` re-read its local tensor's all-gather extension (``fsdp_pre_all_gather`` /
    ``fsdp_post_all_gather``) and drop what was sized and typed for the previous local tensor: the all-gather
    outputs, the unsharded parameter, the mixed-precision dtypes."""
    fp._init_extensions()
    fp.all_gather_outputs = []
    if hasattr(fp, "_unsharded_param"):
        del fp._unsharded_param
    if hasattr(fp, "orig_dtype"):
        fp.init_dtype_attrs(fp.mp_policy)
