"""Helpers of the optimizer-memory tests (single process and gloo workers): the bytes the CPU allocator hands out
while a function runs, a small model with master and plain parameters, and optimizer steps on fixed gradients.

:func:`allocations` reads the allocator's own records (``torch.profiler`` with ``profile_memory=True`` logs every
CPU allocation and free with its size), so it also sees allocations made below a tensor subclass's
``__torch_dispatch__`` or DTensor's dispatch, which a ``TorchDispatchMode`` would not.
"""
from __future__ import annotations

import torch
import torch.nn as nn

#: name -> (optimizer class, keyword arguments). Each kernel family of AdamW and SGD with momentum.
OPTIMIZERS = {
    "adamw_fused": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, fused=True)),
    "adamw_foreach": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, foreach=True)),
    "adamw_for_loop": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, foreach=False)),
    "sgd_momentum_fused": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=0.1, fused=True)),
    "sgd_momentum_foreach": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=0.1, foreach=True)),
}


def allocations(fn) -> tuple[int, int]:
    """Run ``fn()``; return ``(allocated, peak)``: the bytes the CPU allocator handed out during the call, and the
    highest number of those bytes alive at once (frees of memory allocated before the call count from 0)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    # By time; at one timestamp frees first: the profiler's clock ties events of one instant, and its list does not
    # always keep their order, so an allocation listed before the free it follows would count both as alive at once
    # (a 16 KiB higher peak, seen once in CI). Deterministic for the comparisons made with it.
    records.sort(key=lambda e: (e.start_ns(), e.nbytes() > 0))
    allocated = live = peak = 0
    for e in records:
        n = e.nbytes()
        allocated += max(n, 0)
        live += n
        peak = max(peak, live)
    return allocated, peak


def make_model(K: int = 64, N: int = 96) -> nn.Module:
    """Three Linears (with and without bias) and a LayerNorm, float32: weights that become masters and plain
    parameters (biases, norm) of several shapes."""
    return nn.Sequential(nn.Linear(K, N), nn.LayerNorm(N), nn.Linear(N, K, bias=False), nn.Linear(K, K))


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor, else ``t``."""
    return getattr(t, "_local_tensor", t)


def is_master(p: torch.Tensor) -> bool:
    """Whether ``p`` (or its DTensor's local tensor) is an :class:`~fp8tensor.Fp8MasterWeight`."""
    from fp8tensor import Fp8MasterWeight

    return isinstance(local(p), Fp8MasterWeight)


def plain_value(t: torch.Tensor) -> torch.Tensor:
    """A detached plain copy of ``t``'s local values (DTensor and master unwrapped)."""
    t = local(t)
    return getattr(t, "_data", t).detach().clone()


def make_optimizers(params, name: str, kinds=None) -> list:
    """One optimizer ``name`` over ``params``; or, given ``kinds`` (one bool per parameter, e.g. :func:`is_master`
    of each), one over the parameters marked True and one over the rest."""
    cls, kw = OPTIMIZERS[name]
    params = list(params)
    if kinds is None:
        return [cls(params, **kw)]
    groups = [[p for p, k in zip(params, kinds) if k], [p for p, k in zip(params, kinds) if not k]]
    return [cls(g, **kw) for g in groups if g]


def run_steps(params, opts: list, grads: list[list[torch.Tensor]], to_grad=lambda p, g: g) -> list[tuple[int, int]]:
    """Step ``opts`` once per entry of ``grads`` (one gradient per parameter, set as ``p.grad`` through
    ``to_grad(p, g)`` before the measurement); return :func:`allocations` of each step (all optimizers)."""
    params = list(params)
    out = []
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = to_grad(p, g.clone())
        out.append(allocations(lambda: [o.step() for o in opts]))
        for o in opts:
            o.zero_grad(set_to_none=True)
    return out
