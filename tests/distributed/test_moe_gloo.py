"""Expert parallelism x FSDP2 of fp8 MoE experts on 4 gloo processes: mesh (dp=2, ep=2).

Each rank holds 2 of 4 experts (``Shard(0)`` over ``ep``), FSDP2 shards them again over ``dp`` and all-gathers the
fp8 rows and scales of the master weights; tokens go to their experts' ranks with high-precision all-to-alls. The
output, the input gradient and every expert's weight gradient are compared with a float64 single-process reference
of all ranks' tokens. Bounds as in tests/test_moe.py: U = 2^-4 / sqrt(3) per rounded operand, in quadrature.
"""
from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

U = 2.0**-4 / math.sqrt(3)
TWO = math.sqrt(2) * U
DIM, HIDDEN, E, TOP_K = 32, 48, 4, 2
ROOT = Path(__file__).resolve().parents[2]


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _reference(x, router_w, w1, w2, w3, top_e):
    """float64 MoE output of tokens ``x`` [T, D] with the routing ``top_e`` fixed (taken from the run)."""
    probs = F.softmax(x @ router_w.t(), dim=-1)
    top_p = probs.gather(1, top_e)
    top_p = top_p / top_p.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    for k in range(TOP_K):
        for e in range(E):
            rows = (top_e[:, k] == e).nonzero().flatten()
            if rows.numel():
                xe = x[rows]
                h = F.silu(xe @ w1[e].t()) * (xe @ w3[e].t())
                y = y.index_add(0, rows, top_p[rows, k, None] * (h @ w2[e].t()))
    return y


def worker(rank, world, seed):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(ROOT / "examples"))
    from llama import MoE, ModelArgs, parallelize_moe_experts

    import fp8tensor
    from fp8tensor import Fp8MasterWeight

    torch.manual_seed(seed)
    args = ModelArgs(dim=DIM, n_heads=4, n_kv_heads=2, moe=True, n_experts=E, top_k=TOP_K, moe_hidden=HIDDEN)
    moe = MoE(args)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    full = {k: v.detach().clone() for k, v in moe.state_dict().items()}
    fp8tensor.convert_to_fp8(moe)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    parallelize_moe_experts(types.SimpleNamespace(layers=[types.SimpleNamespace(feed_forward=moe)]),
                            mesh["ep"], mesh["dp"], reshard_after_forward=True)
    seen = []
    moe.experts.register_forward_pre_hook(lambda m, a: seen.append(type(m.w1.to_local()).__name__))

    gen = torch.Generator().manual_seed(seed + 1)
    xs = torch.randn(world, 2, 21, DIM, generator=gen)  # every rank's tokens (21 per sequence: uneven groups)
    gs = torch.randn(world, 2, 21, DIM, generator=gen)
    x = xs[rank].clone().requires_grad_()
    y = moe(x)
    (y * gs[rank]).sum().backward()

    # routing of every rank (float32, as the run computed it) for the reference
    probs = F.softmax(xs.reshape(-1, DIM) @ full["router.weight"].t(), dim=-1)
    top_e = torch.topk(probs, TOP_K, dim=-1).indices
    ref_w = {k: full[f"experts.{k}"].double().requires_grad_() for k in ("w1", "w2", "w3")}
    xd = xs.reshape(-1, DIM).double().requires_grad_()
    y_ref = _reference(xd, full["router.weight"].double(), ref_w["w1"], ref_w["w2"], ref_w["w3"], top_e)
    (y_ref * gs.reshape(-1, DIM).double()).sum().backward()
    T = 2 * 21
    mine = slice(rank * T, (rank + 1) * T)
    out = {
        "seed": seed,
        "local_types": sorted({type(getattr(moe.experts, n).to_local()).__name__ for n in ("w1", "w2", "w3")}),
        "placements": str(moe.experts.w1.placements),
        "seen": seen,
        "y": rel(y.reshape(-1, DIM), y_ref[mine]),
        "dx": rel(x.grad.reshape(-1, DIM), xd.grad[mine]),
    }
    for n in ("w1", "w2", "w3"):
        g = getattr(moe.experts, n).grad.full_tensor()
        ref = ref_w[n].grad / mesh["dp"].size()  # FSDP2 averages over dp; the ep all-to-all sums the ep ranks
        out[n] = [rel(g[e], ref[e]) for e in range(E)]
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from _spawn import spawn

    return spawn(__name__, "worker", 4, tmp_path_factory.mktemp("moe"))


def test_expert_weights_are_sharded_masters_gathered_in_fp8(run):
    for r in run:
        assert r["local_types"] == ["Fp8MasterWeight"], r
        assert "Shard(dim=0)" in r["placements"], r
        assert r["seen"] == ["GatheredExperts"], r  # the forward sees the fp8 all-gathered weight (a ScaledFp8Tensor)


def test_output_and_input_gradient_match_float64(run):
    for r in run:
        assert r["y"] <= math.sqrt(3) * TWO, (r["seed"], r["y"])
        assert r["dx"] <= 2 * TWO, (r["seed"], r["dx"])


def test_expert_weight_gradients_match_float64(run):
    for r in run:
        for n in ("w1", "w2", "w3"):
            assert max(r[n]) <= 2 * TWO, (r["seed"], n, r[n])
