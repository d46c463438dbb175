"""Editing FSDP2's private state (through :mod:`fp8tensor.compat` only) for conversion after ``fully_shard``:
:func:`refresh_fsdp_param`, :func:`check_fsdp_sharded`; and :func:`fp8_all_gather_default`, the rule of
``convert_to_fp8(..., fp8_all_gather=None)``. The payload on the wire is :mod:`fp8tensor.fsdp`."""
from __future__ import annotations

from typing import Optional

import torch

from ..core import compat
from ..training.master import Fp8MasterWeight
from ..numerics.fsdp_payload import fsdp_params as _fsdp_params
from ..subclass.tensor import _is_dtensor

__all__ = ["refresh_fsdp_param", "find_fsdp_param", "check_fsdp_sharded", "fp8_all_gather_default",
           "rule_changes_after_init"]


def fp8_all_gather_default() -> bool:
    """Whether FSDP2 all-gathers trained weights in fp8 (True) or in its ``param_dtype`` (False) when
    :func:`fp8tensor.convert_to_fp8` is not told (``fp8_all_gather=None``).

    False when ``torch.distributed`` is initialized with an NCCL default group whose ranks all run on this host
    (read from torchrun's, Open MPI's, MPICH's or Slurm's environment, else guessed from the GPU count); True
    otherwise. Why: docs/fsdp.md (measured on H200).
    """
    import os

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or "nccl" not in str(dist.get_backend()).lower():
        return True
    world = dist.get_world_size()
    if world == 1:
        return False
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):  # ranks on this host
        local = os.environ.get(name, "")
        if local.isdigit() and int(local) > 0:
            return world > int(local)
    for name in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES"):  # srun without torchrun: hosts of the step / job
        nodes = os.environ.get(name, "")
        if nodes.isdigit() and int(nodes) > 0:
            return int(nodes) > 1
    return world > max(torch.cuda.device_count(), 1)


def rule_changes_after_init() -> bool:
    """Whether :func:`fp8_all_gather_default` answers True only because no process group exists yet in a CUDA job
    whose ranks all run on this host (torchrun's ``WORLD_SIZE == LOCAL_WORLD_SIZE > 1``)."""
    import os

    import torch.distributed as dist

    if (dist.is_available() and dist.is_initialized()) or not torch.cuda.is_available():
        return False
    world, local = os.environ.get("WORLD_SIZE", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
    return world.isdigit() and local.isdigit() and int(world) > 1 and int(world) == int(local)


def find_fsdp_param(param: torch.Tensor, module: Optional[torch.nn.Module] = None):
    """The FSDP2 ``FSDPParam`` whose sharded parameter is ``param`` (searched under ``module`` if given), or None."""
    for fp in _fsdp_params(module):
        if fp.sharded_param is param:
            return fp
    return None


def refresh_fsdp_param(param: torch.Tensor, module: Optional[torch.nn.Module] = None) -> bool:
    """Make FSDP2 pick up a swapped local tensor of ``param`` (after ``fully_shard``): the ``FSDPParam`` owning it
    (under ``module``, or any live state) re-reads its all-gather extension and drops buffers typed for the old one.
    True if an FSDP2 parameter was refreshed. Raises ``RuntimeError``: the parameter is currently unsharded.
    """
    fp = find_fsdp_param(param, module) if _is_dtensor(param) else None
    if fp is None:
        return False
    if not compat.fsdp_is_sharded(fp):
        raise RuntimeError(f"fp8tensor: cannot convert FSDP2 parameter {compat.fsdp_param_name(fp)!r} while it is "
                           f"unsharded ({compat.fsdp_state_name(fp)}); call model.reshard() (or convert before the "
                           "first forward)")
    # FSDP2's reset_sharded_param compares the flat shard's storage with the local tensor's: give it the subclass
    local = compat.fsdp_sharded_local(fp)
    compat.fsdp_set_flat_shard(fp, local.view(-1) if isinstance(local, Fp8MasterWeight) else local)
    compat.fsdp_reset_extension(fp)
    return True


def check_fsdp_sharded(named_params, op: str) -> None:
    """Raise ``RuntimeError`` (naming ``op`` and the parameter; nothing changed) before a conversion if any of
    ``named_params`` (``(name, parameter)`` pairs, the names as the model's ``named_parameters`` gives them) is an
    FSDP2 parameter held *unsharded* (a swap would be lost)."""
    names: dict = {}
    for name, p in named_params:
        if isinstance(p, torch.Tensor):
            names.setdefault(id(p), name)  # (a weight tied between modules: its first name)
    if not names:
        return
    for fp in _fsdp_params():
        unsharded = compat.fsdp_unsharded_param(fp)
        if unsharded is not None and id(unsharded) in names and not compat.fsdp_is_sharded(fp):
            raise RuntimeError(
                f"{op}: parameter {names[id(unsharded)]!r} is currently unsharded by FSDP2 "
                f"({compat.fsdp_state_name(fp)}); call model.reshard() (or convert before the first forward). "
                "The model was not changed."
            )
