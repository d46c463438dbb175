"""A compiled fp8 Linear trains through its autograd Function on CUDA with inductor, on the GPU image's torch
(skipped without a GPU). The checks are those of ``tests/test_compile_path.py`` (``tests/_compile_path.py``): the
gradients of the input, weight and bias exist and agree with eager within :data:`COMPILED_VS_EAGER_BOUND` (inductor
fuses the quantizations, so an ulp may differ) and with float64 within the fp8 bound, and the Function's backward
ran; a compiled tensor-parallel fp8 Linear on a 1-rank NCCL mesh trains."""
from __future__ import annotations

import pytest
import torch

from _compile_path import (check_compiled_matches_eager, check_compiled_tp_linear_trains,
                           check_compiled_under_stale_config_block, check_converted_compiled_first,
                           check_functional_compiled_first)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

WEIGHTS_RECIPES = [("master", "rowwise"), ("master", "rowwise_gw_hp"), ("fp8", "rowwise")]


@pytest.mark.parametrize("weights,recipe", WEIGHTS_RECIPES)
@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("ndim", [2, 3])
def test_compiled_linear_trains_like_eager(monkeypatch, ndim, fullgraph, weights, recipe):
    check_compiled_matches_eager(monkeypatch, device="cuda", ndim=ndim, weights=weights, recipe=recipe,
                                 fullgraph=fullgraph, backend="inductor", bit_exact=False)


@pytest.mark.parametrize("weights,recipe", [("master", "rowwise"), ("fp8", "rowwise")])
def test_compiled_linear_with_inductor_quantization_trains_like_eager(monkeypatch, weights, recipe):
    # compiled_quantization="inductor": the token-dim operands as plain ops inductor generates (no fp8tensor kernels)
    import fp8tensor

    with fp8tensor.config(compiled_quantization="inductor"):
        check_compiled_matches_eager(monkeypatch, device="cuda", ndim=3, weights=weights, recipe=recipe,
                                     fullgraph=True, backend="inductor", bit_exact=False)


def test_compiled_user_module_calling_fp8_linear_on_its_own_parameter():
    # plain Parameters, compiled (inductor, fullgraph) before any eager fp8tensor call in a fresh process
    check_functional_compiled_first("cuda", "inductor", torch.initial_seed(), bit_exact=False)


def test_converted_model_compiled_first_compiles_once():
    # inductor: the compiled-first model gives the bits of the same model compiled again (it compiled twice, the
    # first graph unlike the later ones), no recompile; eager within 2 * COMPILED_VS_EAGER_BOUND (two GEMMs in
    # series), float64 bounds
    check_converted_compiled_first("cuda", "inductor", torch.initial_seed(), bit_exact=False)


def test_compiled_linear_inside_a_config_block_made_stale_by_set_config(monkeypatch):
    # the CUDA forward reads the settings itself (quantize_token_layouts): no patch
    check_compiled_under_stale_config_block(monkeypatch, device="cuda", backend="inductor", bit_exact=False,
                                            read_settings_in_forward=False)


@pytest.fixture(scope="module")
def one_rank_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    torch.cuda.set_device(0)
    yield init_device_mesh("cuda", (1,))
    if own:
        dist.destroy_process_group()


@pytest.mark.parametrize("style", ["colwise", "rowwise"])
def test_compiled_tensor_parallel_linear_trains(monkeypatch, one_rank_mesh, style):
    check_compiled_tp_linear_trains(monkeypatch, one_rank_mesh, style, device="cuda", backend="inductor")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("style", ["colwise", "rowwise"])
def test_tensor_parallel_input_takes_both_layouts(one_rank_mesh, style, compiled):
    """A DTensor input (``ColwiseParallel`` / ``RowwiseParallel`` on a 1-rank mesh) is quantized both ways by the
    two-layout kernels on its local tensor (``_amax_both_kernel`` / ``_cast_both_kernel``, eager and in inductor's
    code; ``grad_out`` is left to the GEMM engine on the DTensor path); output and gradients within the fp8 bound of
    float64."""
    import torch.nn as nn
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fp8tensor
    from fp8tensor.numerics import kernels

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    torch._dynamo.reset()
    lin = nn.Linear(512, 768, device="cuda", dtype=torch.bfloat16)
    w0, b0 = lin.weight.detach().double().clone(), lin.bias.detach().double().clone()
    model = nn.Sequential(lin)
    parallelize_module(model, one_rank_mesh, {"0": ColwiseParallel() if style == "colwise" else RowwiseParallel()})
    fp8tensor.convert_to_fp8(model)
    x = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(4, 256, 768, device="cuda", dtype=torch.bfloat16)

    def step(mod):
        y = mod(x)
        y.backward(gy)
        return full(y)

    if compiled:
        y, codes = run_and_get_code(step, torch.compile(model))
        code = "\n".join(codes)
        assert "_amax_both_kernel" in code  # (no other DTensor operand takes these kernels)
    else:
        seen = []
        launch = kernels._launch

        def recording(fn, *args, **kwargs):
            seen.append(getattr(getattr(fn, "fn", fn), "__name__", str(fn)))
            return launch(fn, *args, **kwargs)

        kernels._launch = recording
        try:
            y = step(model)
        finally:
            kernels._launch = launch
        assert seen.count("_amax_both_kernel") == 1 and seen.count("_cast_both_kernel") == 1, seen
    xd, gyd = x.detach().double().reshape(-1, 512), gy.double().reshape(-1, 768)
    rel = lambda a, b: float((a.double() - b).norm() / b.norm())  # noqa: E731
    assert rel(y.reshape(-1, 768), xd @ w0.t() + b0) < 5e-2
    assert rel(x.grad.reshape(-1, 512), gyd @ w0) < 5e-2
    assert rel(full(lin.weight.grad), gyd.t() @ xd) < 5e-2
