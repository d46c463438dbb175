"""A compiled fp8 Linear trains through its autograd Function on CUDA with inductor, on the GPU image's torch
(skipped without a GPU). The checks are those of ``tests/test_compile_path.py`` (``tests/_compile_path.py``): the
gradients of the input, weight and bias exist and agree with eager within :data:`COMPILED_VS_EAGER_BOUND` (inductor
fuses the quantizations, so an ulp may differ) and with float64 within the fp8 bound, and the Function's backward
ran; a compiled tensor-parallel fp8 Linear on a 1-rank NCCL mesh trains."""
from __future__ import annotations

import pytest
import torch

from _compile_path import check_compiled_matches_eager, check_compiled_tp_linear_trains

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
