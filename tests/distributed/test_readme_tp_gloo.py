"""The README's API block on a (dp, tp) = (1, 2) mesh of 2 gloo processes, as its comment says to run it under
torchrun: ``convert_to_fp8``, ``root_tp_plan`` on the model, ``block_tp_plan`` (sequence parallel) on each block,
``fully_shard``. Loss and gradients against the same model in float64 on one process, and the same steps with the
high-precision model (which the blocks' plan alone, without the model's, got wrong too: the replicated embedding
output was read as a sequence shard). Fresh weights and tokens per run (``FP8TENSOR_TEST_SEED`` replays).
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

WORLD = 2
BOUND = 5e-2  # one fp8 GEMM's relative error bound (tests/conftest.py E4M3_GEMM_BOUND)


def _rel(a, b) -> float:
    from torch.distributed.tensor import DTensor

    a = a.full_tensor() if isinstance(a, DTensor) else a
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm()).item()


def gloo_entry(rank: int, world: int, seed: int) -> dict:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import fp8tensor
    from examples.llama import Llama, ModelArgs, block_tp_plan, root_tp_plan

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    torch.manual_seed(seed)  # the same weights and tokens on every rank
    base = Llama(ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=64))
    ref = copy.deepcopy(base).double()
    tokens = torch.randint(0, 256, (2, 33))
    lr = F.cross_entropy(ref(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    lr.backward()
    out: dict = {}
    for name, convert in (("fp8", True), ("hp", False)):
        model = copy.deepcopy(base)
        if convert:
            fp8tensor.convert_to_fp8(model, recipe="rowwise")
        parallelize_module(model, tp_mesh, root_tp_plan())
        for block in model.layers:
            parallelize_module(block, tp_mesh, block_tp_plan())
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        out[f"{name}_loss"] = abs(loss.item() - lr.item()) / lr.item()
        grads = {n: p.grad for n, p in model.named_parameters()}
        out[f"{name}_grads"] = {n: _rel(grads[n], p.grad) for n, p in ref.named_parameters()}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from _spawn import spawn

    return spawn(__name__, "gloo_entry", WORLD, tmp_path_factory.mktemp("readme_tp"), timeout=600)


def test_readme_api_on_two_tp_ranks_matches_float64(results):
    """High precision: the float64 model's gradients to float32 rounding. fp8: the loss within one fp8 GEMM's bound,
    each gradient within the bound of the fp8 GEMMs it passes through (up to the depth of the model: a wrong layout
    on one rank leaves gradients ~100% off)."""
    for res in results:
        assert res["hp_loss"] < 1e-4 and max(res["hp_grads"].values()) < 1e-4, res["hp_grads"]
        assert res["fp8_loss"] < BOUND
        worst = max(res["fp8_grads"].items(), key=lambda kv: kv[1])
        assert worst[1] < 4 * BOUND, worst  # (measured 0.077-0.083 over three seeds)
