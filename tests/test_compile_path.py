"""A compiled fp8 Linear trains through its autograd Function on every supported torch (CPU, ``aot_eager``), and a
compiled tensor-parallel fp8 Linear on a 1-rank mesh trains. See ``tests/_compile_path.py`` for what is checked and
why; ``tests/gpu/test_gpu_compile_path.py`` runs the same checks with inductor on CUDA."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fp8tensor
from fp8tensor import compat
from _compile_path import FP8_BOUND, BackwardCounter, check_compiled_matches_eager, rel


#: (weights, recipe): a frozen fp8 weight has no grad_weight GEMM, so its recipes do not differ.
WEIGHTS_RECIPES = [("master", "rowwise"), ("master", "rowwise_gw_hp"), ("fp8", "rowwise")]


@pytest.mark.parametrize("weights,recipe", WEIGHTS_RECIPES)
@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("ndim", [2, 3])
def test_compiled_linear_trains_like_eager(monkeypatch, ndim, fullgraph, weights, recipe):
    # aot_eager runs the traced ops as eager runs them: the compiled path is claimed bit-identical here.
    check_compiled_matches_eager(monkeypatch, device="cpu", ndim=ndim, weights=weights, recipe=recipe,
                                 fullgraph=fullgraph, backend="aot_eager", bit_exact=True)


def test_compat_tracing_state_queries():
    """compat's answers in eager code, under torch.compile and under torch.export (strict and not)."""
    assert not compat.is_exporting() and not compat.is_compiling()
    seen = {}

    def probe(x, key):
        seen[key] = (compat.is_compiling(), compat.is_exporting())
        return x + 1

    torch._dynamo.reset()
    # read at trace time (the values are constants of the trace): a graph break would run probe eagerly instead
    torch.compile(lambda x: probe(x, "compile"), backend="eager", fullgraph=True)(torch.ones(2))
    assert seen["compile"] == (True, False), seen

    class M(nn.Module):
        def forward(self, x):
            return x * 3 if compat.is_exporting() else x + 1

    for strict in (True, False):
        ep = torch.export.export(M(), (torch.ones(2),), strict=strict)
        assert torch.equal(ep.module()(torch.ones(2)), torch.full((2,), 3.0)), f"strict={strict}"
    torch._dynamo.reset()
    assert torch.equal(torch.compile(M(), backend="eager", fullgraph=True)(torch.ones(2)), torch.full((2,), 2.0))
    assert torch.equal(torch.compile(M(), backend="aot_eager", fullgraph=False)(torch.ones(2)), torch.full((2,), 2.0))


@pytest.fixture
def one_rank_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if own:
            dist.destroy_process_group()


@pytest.mark.parametrize("style", ["colwise", "rowwise"])
def test_compiled_tensor_parallel_linear_trains(monkeypatch, one_rank_mesh, style):
    """A compiled tensor-parallel fp8 Linear (DTensor weight, 1-rank mesh) runs the training path: its gradients
    exist and match the float64 reference within the fp8 bound, and SGD steps lower the loss."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch._dynamo.reset()
    counter = BackwardCounter(monkeypatch)
    model = nn.Sequential(nn.Linear(64, 96, dtype=torch.bfloat16))
    w0, b0 = model[0].weight.detach().double().clone(), model[0].bias.detach().double().clone()
    parallelize_module(model, one_rank_mesh, {"0": ColwiseParallel() if style == "colwise" else RowwiseParallel()})
    fp8tensor.convert_to_fp8(model)
    comp = torch.compile(model, backend="aot_eager")
    x = torch.randn(40, 64, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(40, 96, dtype=torch.bfloat16)
    y = comp(x)
    y.backward(gy)
    assert counter.calls > 0, "the compiled tensor-parallel fp8 Linear did not run the autograd Function"
    lin = model[0]
    gw = lin.weight.grad.full_tensor() if hasattr(lin.weight.grad, "full_tensor") else lin.weight.grad
    gb = lin.bias.grad.full_tensor() if hasattr(lin.bias.grad, "full_tensor") else lin.bias.grad
    y = y.full_tensor() if hasattr(y, "full_tensor") else y
    xd, gyd = x.detach().double(), gy.double()
    assert rel(y, xd @ w0.t() + b0) < FP8_BOUND
    assert x.grad is not None and rel(x.grad, gyd @ w0) < FP8_BOUND
    assert rel(gw, gyd.t() @ xd) < FP8_BOUND and rel(gb, gyd.sum(0)) < 1e-2
    # a few steps of training on a fixed target lower the loss
    target = torch.randn(40, 96, dtype=torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        out = comp(x.detach())
        loss = ((out.full_tensor() if hasattr(out, "full_tensor") else out).float() - target.float()).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
