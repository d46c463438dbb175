"""One optimizer over all parameters under FSDP2 and tensor parallelism (DTensor parameters, some with an
``Fp8MasterWeight`` as local tensor, some plain): no copy of a master, bit-identical updates, unchanged
optimizer state dict (the DCP form of ``get_optimizer_state_dict``).

One gloo process (a 1-rank mesh, the FSDP2 setup of the benchmarks): the worker measures, for every optimizer of
:data:`NAMES` and each setup, the bytes the CPU allocator hands out per step (see
``test_optimizer_memory.py`` for the meter and the bound) with four optimizer layouts — the unconverted model and the
converted one, each with one optimizer over all parameters and with one per kind (masters / the rest) — and the
parameters after the steps. The tests below assert on what it wrote.
"""
from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.slow

STEPS = 3
#: ``_optim_steps.OPTIMIZERS`` but fused SGD, which DTensor has no sharding strategy for (plain models too).
NAMES = ("adamw_fused", "adamw_foreach", "adamw_for_loop", "sgd_momentum_foreach")
LAYOUTS = ("plain", "plain_split", "one", "per_kind")
#: Each layout is measured this many times from fresh copies and each step keeps its largest bytes. The meter can only
#: undercount (``_optim_steps.allocations`` orders a timestamp's frees first, so an allocation that the profiler stamps
#: with the same instant as an unrelated free is missed at the peak: the unconverted model's peak once read 16 KiB
#: low in CI); a copy of a master is allocated in every repeat, so the largest reading keeps it.
REPEATS = 3


def _distribute(model, setup: str, mesh) -> None:
    """FSDP2 (each Linear and the root) or tensor parallelism (colwise / rowwise Linears, replicated norm)."""
    if setup == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.tensor import distribute_module
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel(), "3": ColwiseParallel()})
        distribute_module(model[1], mesh)


def worker(rank, world, seed):
    """Per (setup, optimizer): bytes per step of the four layouts, equality of the updates with the unconverted
    model's, and (two optimizers) the DCP optimizer state dict compared with the unconverted model's."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    from _optim_steps import is_master, local, make_model, make_optimizers, plain_value, run_steps
    from fp8tensor import convert_to_fp8

    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (world,))
    base = make_model()
    grads = [[torch.randn_like(p) for p in base.parameters()] for _ in range(STEPS)]

    def to_grad(p, g):
        return distribute_tensor(g, p.device_mesh, p.placements)

    res = {}
    for setup in ("fsdp", "tp"):
        for name in NAMES:
            used = None
            for _ in range(REPEATS):  # the largest of each step's bytes over the repeats (see REPEATS)
                models = {}
                for k in LAYOUTS:
                    models[k] = copy.deepcopy(base)
                    if k in ("one", "per_kind"):
                        convert_to_fp8(models[k])
                    _distribute(models[k], setup, mesh)
                params = {k: list(m.parameters()) for k, m in models.items()}
                kinds = [is_master(p) for p in params["one"]]
                opts = {k: make_optimizers(params[k], name, kinds if k.endswith(("split", "kind")) else None)
                        for k in LAYOUTS}
                now = {k: run_steps(params[k], opts[k], grads, to_grad) for k in LAYOUTS}
                used = now if used is None else {
                    k: [tuple(max(a, b) for a, b in zip(u, v)) for u, v in zip(used[k], now[k])] for k in LAYOUTS}
            entry = dict(
                used=used,
                n_masters=sum(kinds),
                all_dtensor=all(isinstance(p, DTensor) for p in params["one"]),
                slack=min(local(p).numel() * local(p).element_size() for p in params["one"] if is_master(p)) // 4,
                n_opts={k: len(o) for k, o in opts.items()},
                equal={k: all(torch.equal(plain_value(p), plain_value(q)) for p, q in zip(params["plain"], params[k]))
                       for k in LAYOUTS},
            )
            if name in ("adamw_fused", "sgd_momentum_foreach"):
                sd_plain = get_optimizer_state_dict(models["plain"], opts["plain"][0])
                sd_one = get_optimizer_state_dict(models["one"], opts["one"][0])
                same = sd_plain["param_groups"] == sd_one["param_groups"] and sd_plain["state"].keys() == sd_one["state"].keys()
                types = set()
                for fqn, st in sd_one["state"].items():
                    same = same and st.keys() == sd_plain["state"][fqn].keys()
                    for key, v in st.items():
                        ref = sd_plain["state"][fqn][key]
                        types.add((type(v).__name__, type(local(v)).__name__))
                        same = same and type(v) is type(ref) and torch.equal(plain_value(v), plain_value(ref))
                entry["state_dict"] = dict(same=bool(same), types=sorted(types), n=len(sd_one["state"]))
            res[(setup, name)] = entry
    return res


@pytest.fixture(scope="module")
def run1(tmp_path_factory):
    from _spawn import spawn

    return spawn(__name__, "worker", 1, tmp_path_factory.mktemp("optim_memory"))[0]


@pytest.mark.parametrize("setup", ["fsdp", "tp"])
def test_one_optimizer_over_dtensor_masters_and_plain_parameters_allocates_no_copy(run1, setup):
    for name in NAMES:
        e = run1[(setup, name)]
        assert e["all_dtensor"] and e["n_masters"] == 3
        assert e["n_opts"] == {"plain": 1, "plain_split": 2, "one": 1, "per_kind": 2}
        used, slack = e["used"], e["slack"]
        for step in range(STEPS):
            u = {k: used[k][step] for k in LAYOUTS}
            for conv, ref in (("one", "plain"), ("per_kind", "plain_split")):
                for i in (0, 1):  # bytes allocated, peak
                    assert abs(u[conv][i] - u[ref][i]) <= slack, (name, step, conv, used)
            assert abs(u["one"][0] - u["per_kind"][0]) <= slack, (name, step, used)
            if "fused" in name:
                assert abs(u["one"][1] - u["per_kind"][1]) <= slack, (name, step, used)


@pytest.mark.parametrize("setup", ["fsdp", "tp"])
def test_one_optimizer_over_dtensor_masters_updates_bit_identically(run1, setup):
    for name in NAMES:
        assert all(run1[(setup, name)]["equal"].values()), (name, run1[(setup, name)]["equal"])


@pytest.mark.parametrize("setup", ["fsdp", "tp"])
def test_one_optimizer_distributed_state_dict_matches_unconverted_model(run1, setup):
    for name in ("adamw_fused", "sgd_momentum_foreach"):
        sd = run1[(setup, name)]["state_dict"]
        assert sd["same"] and sd["n"] == 7, (name, sd)  # every parameter has state
        # the state is DTensors of plain shards (and AdamW's plain step counters): no master in a checkpoint
        assert ("DTensor", "Tensor") in sd["types"] and all(inner == "Tensor" for _, inner in sd["types"]), (name, sd)
