"""``torch.autocast`` and tied weights with tensor parallelism and FSDP2, on 2 gloo processes (see
``tests/test_nn_linear_compat.py`` for the single-process checks).

Per rank, on an fp32 model converted with ``convert_to_fp8``, under ``torch.autocast("cpu", bfloat16)``:

* TP (ColwiseParallel -> RowwiseParallel): bf16 output, within the fp8 bound of the float64 math and of the same
  model without TP under autocast; the weight gradients of the TP model against float64;
* FSDP2 (``fully_shard`` per Linear and at the root, fp32 parameters, fp8 all-gather of the master rows): bf16
  output; two SGD steps track the float64 model trained on the same global batch (both ranks' data);
* a tied pair of Linears under FSDP2 (one Parameter used twice, converted before ``fully_shard``): one master,
  and its gradient against the float64 sum of both uses;
* an embedding tied to the output head under FSDP2 with the fp8 all-gather asked for: the embedding reads the
  exact high-precision rows.

Weights and data are fresh per run (``FP8TENSOR_TEST_SEED`` replays).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

pytestmark = pytest.mark.slow

WORLD = 2
D, H = 64, 128
BOUND = 5e-2  # one fp8 GEMM's relative error bound (tests/conftest.py E4M3_GEMM_BOUND)


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm()).item()


def _model():
    return nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D))


def _full(t):
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    from fp8tensor import Fp8MasterWeight

    return t._data if isinstance(t, Fp8MasterWeight) else t


def gloo_entry(rank: int, world: int, seed: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fp8tensor

    torch.manual_seed(seed)  # same weights on every rank
    mesh = init_device_mesh("cpu", (world,))
    ref = _model().double()
    x_all = torch.randn(world, 6, D)
    gy_all = torch.randn(world, 6, D)
    out: dict = {}
    ac = torch.autocast("cpu", dtype=torch.bfloat16)

    # ---- TP under autocast (every rank sees the same x)
    x, gy = x_all[0], gy_all[0]
    tp = fp8tensor.convert_to_fp8(
        parallelize_module(copy.deepcopy(ref).float(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    )
    single = fp8tensor.convert_to_fp8(copy.deepcopy(ref).float())
    xt = x.clone().requires_grad_()
    with ac:
        y_tp = tp(xt)
        y_single = single(x)
    y_tp.backward(gy.to(y_tp.dtype))
    xd = x.double().requires_grad_()
    r = copy.deepcopy(ref)
    yd = r(xd)
    yd.backward(gy.double())
    out["tp_dtype"] = y_tp.dtype
    out["tp_vs_f64"] = _rel(y_tp, yd)
    out["tp_vs_single"] = _rel(y_tp, y_single)
    out["tp_gx_vs_f64"] = _rel(xt.grad, xd.grad)
    out["tp_gw_vs_f64"] = max(_rel(_full(tp[i].weight.grad), r[i].weight.grad) for i in (0, 2))

    # ---- FSDP2 under autocast, 2 SGD steps; reference: float64 on the global batch (mean over ranks' losses)
    fs = fp8tensor.convert_to_fp8(copy.deepcopy(ref).float())
    for m in (fs[0], fs[2]):
        fully_shard(m, mesh=mesh)
    fully_shard(fs, mesh=mesh)
    r = copy.deepcopy(ref)
    opt = torch.optim.SGD(fs.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(r.parameters(), lr=0.1)
    dtypes = []
    for _ in range(2):
        opt.zero_grad()
        with ac:
            y = fs(x_all[rank])
        dtypes.append(y.dtype)
        (y.float() * gy_all[rank]).sum().backward()  # FSDP2 averages the gradients over the ranks
        opt.step()
        opt_r.zero_grad()
        sum((r(x_all[k].double()) * gy_all[k].double()).sum() for k in range(world)).div(world).backward()
        opt_r.step()
    out["fsdp_dtypes"] = dtypes
    out["fsdp_weights_vs_f64"] = max(_rel(_full(fs[i].weight), r[i].weight) for i in (0, 2))
    out["fsdp_delta_vs_f64"] = max(
        _rel(_full(fs[i].weight) - ref[i].weight.float(), r[i].weight - ref[i].weight) for i in (0, 2)
    )

    # ---- tied Linears under FSDP2 (converted before fully_shard)
    tied = nn.Sequential(nn.Linear(D, D, bias=False), nn.Tanh(), nn.Linear(D, D, bias=False))
    tied[2].weight = tied[0].weight
    tref = copy.deepcopy(tied).double()
    fp8tensor.convert_to_fp8(tied)
    out["tied_same_before"] = tied[0].weight is tied[2].weight
    fully_shard(tied, mesh=mesh)
    out["tied_n_params"] = len(list(tied.parameters()))
    tied(x_all[rank]).mul(gy_all[rank]).sum().backward()
    sum((tref(x_all[k].double()) * gy_all[k].double()).sum() for k in range(world)).div(world).backward()
    out["tied_grad_vs_f64"] = _rel(_full(tied[0].weight.grad), tref[0].weight.grad)

    # ---- an embedding tied to the output head under FSDP2 (fp8 all-gather asked for): the embedding reads the
    # weight's high-precision rows, as without FSDP2
    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(64, D), nn.Linear(D, 64, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, t):
            return self.head(self.emb(t))

    lm = TiedLM()
    rows = lm.emb.weight.detach().clone()
    fp8tensor.convert_to_fp8(lm, fp8_all_gather=True)
    fully_shard(lm, mesh=mesh)
    seen = {}
    lm.emb.register_forward_hook(lambda mod, i, o: seen.__setitem__("emb", o.detach()))
    idx = torch.arange(8)[None]
    y = lm(idx)
    y.float().mul(torch.randn(y.shape)).sum().backward()
    out["tied_emb_exact"] = torch.equal(seen["emb"][0], rows[:8])
    out["tied_emb_head_vs_f64"] = _rel(y, rows.double()[:8] @ rows.double().t())
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from _spawn import spawn

    return spawn(__name__, "gloo_entry", WORLD, tmp_path_factory.mktemp("compat"), timeout=600)


def test_tp_under_autocast(results):
    for res in results:
        assert res["tp_dtype"] == torch.bfloat16
        assert res["tp_vs_f64"] <= BOUND * 2  # two fp8 GEMMs deep
        assert res["tp_vs_single"] <= 2 * BOUND  # two fp8 results of the same math (sub-row-wise scales under TP)
        assert res["tp_gx_vs_f64"] <= BOUND * 2 and res["tp_gw_vs_f64"] <= BOUND * 2


def test_fsdp2_under_autocast_trains_like_float64(results):
    for res in results:
        assert res["fsdp_dtypes"] == [torch.bfloat16, torch.bfloat16]
        # the update itself (two steps of fp8 gradients, each two GEMMs deep for the first Linear): a gradient not
        # averaged over the ranks, or a lost term, is off by tens of percent
        assert res["fsdp_delta_vs_f64"] <= BOUND * 2
        assert res["fsdp_weights_vs_f64"] <= BOUND * 2


def test_tied_linears_under_fsdp2(results):
    for res in results:
        assert res["tied_same_before"] and res["tied_n_params"] == 1
        assert res["tied_grad_vs_f64"] <= BOUND * 2


def test_embedding_tied_to_the_head_reads_high_precision_under_fsdp2(results):
    """``convert_to_fp8(fp8_all_gather=True)`` leaves a weight an embedding also holds a plain Parameter: FSDP2
    all-gathers it in high precision, the embedding's output is its exact rows, the head's output within one fp8
    GEMM's bound of float64."""
    for res in results:
        assert res["tied_emb_exact"]
        assert res["tied_emb_head_vs_f64"] <= BOUND
