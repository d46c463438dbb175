"""FSDP2 all-gather extensions (placeholder until the FSDP2 work lands)."""
from __future__ import annotations

import torch


def refresh_fsdp_param(param: torch.Tensor) -> None:
    """Re-read the local tensor class of an FSDP2-managed parameter after its local tensor was swapped."""
    return None


def master_pre_all_gather(master, mesh, outer_size, outer_stride, module, mp_policy):
    raise NotImplementedError("fp8tensor: FSDP2 fp8 all-gather is not implemented yet")


def post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
    raise NotImplementedError("fp8tensor: FSDP2 fp8 all-gather is not implemented yet")
