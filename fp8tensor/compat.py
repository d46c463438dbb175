"""Every use of a private PyTorch API by fp8tensor, in one place, gated by the torch version where it differs.

fp8tensor supports torch 2.11 to 2.14. The rest of the package reaches private torch state only through the
functions here, so a torch upgrade that moves one of them breaks (or is fixed) in this module alone;
``tests/test_compat.py`` checks each of them against the installed torch.
"""
from __future__ import annotations

import torch

__all__ = ["TORCH_VERSION", "register_foreach_type", "local_tensor", "set_local_tensor", "dtensor_spec",
           "dispatch_modes_active", "function_modes_active", "functorch_active"]


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
