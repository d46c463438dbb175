"""Repeated fp8 redistributions on real gloo processes: no rank aborts, every result bit-exact.

torch's gloo backend can corrupt the heap when two collectives of one process group are in flight at once
(the repro in ``docs/pytorch_issues.md``, item 3, shows it with plain float32 tensors, torch 2.13 and 2.14). Were fp8tensor's all-gather
and all-to-all handlers to issue the data's and the scale's collectives back to back, a full test run would abort a
rank in about one run in five (``malloc(): unaligned tcache chunk detected``). On the CPU the handlers wait on each
collective before issuing the next (``fp8tensor.collectives._serial``).

Each rank redistributes small fp8 DTensors (one-row and one-column shards, the sizes that abort most often; row scales and,
through a transposed tensor, scales compact on the gathered dim) many times and compares every result with a
reference built without any collective: each rank's ``from_hp`` of its own shard, dequantized and concatenated. The
parent asserts that every rank finished and found nothing wrong. The abort itself is intermittent: on the code
before the workaround this test failed in 3 of 6 runs in one series and in none of 3 in another;
the repro in ``docs/pytorch_issues.md`` reproduces the torch bug far more reliably.
"""
from __future__ import annotations


import pytest
import torch

pytestmark = pytest.mark.slow

ITERS = 1500


def _chunk(t: torch.Tensor, world: int, dim: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``t`` along ``dim`` under ``torch.chunk`` sharding (DTensor's): ceil(n / world) per
    rank, the last ones short or empty."""
    n = -(-t.shape[dim] // world)
    lo = min(rank * n, t.shape[dim])
    return t.narrow(dim, lo, min(n, t.shape[dim] - lo))


def worker(rank: int, world: int, seed: int) -> dict:
    from fp8tensor import ScaledFp8Tensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    places = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    # (shape, source placement, destination, transposed): ``transposed`` quantizes w.T sharded on the other dim and
    # transposes the DTensor, so the local scale is compact on dim 0 (one per column) and the all-gather repeats it.
    # (2, 5) transposed: on torch 2.14 ``.t()`` of the unevenly sharded fp8 DTensor re-gathers it, with an empty shard
    # on 3 ranks (``F.pad`` and ``torch.chunk`` below autograd; they once came back dequantized and hung the ranks).
    cases = [((2, 6), "S0", "R", False), ((5, 2), "S1", "R", False), ((5, 3), "S1", "S0", False),
             ((3, 6), "S0", "R", False), ((6, 5), "S0", "R", True), ((6, 4), "S0", "S1", True),
             ((2, 5), "S0", "R", True)]
    g = torch.Generator().manual_seed(seed)
    fails = []
    for i in range(ITERS):
        shape, src, dst, transposed = cases[i % len(cases)]
        w = torch.randn(*shape, generator=g) * torch.logspace(-2, 2, shape[0])[:, None]
        sd = places[src].dim
        if transposed:  # quantize w.T (row-wise per local shard), view the result as w again
            d = ScaledFp8Tensor.from_hp(distribute_tensor(w.t().contiguous(), mesh, [Shard(1 - sd)])).t()
            # reference from the shards alone (no collective): each rank's from_hp of its shard of w.T, dequantized
            want = torch.cat([ScaledFp8Tensor.from_hp(_chunk(w.t().contiguous(), world, 1 - sd, r).contiguous())
                              .to_hp(torch.float32) for r in range(world)], 1 - sd).t()
        else:
            d = ScaledFp8Tensor.from_hp(distribute_tensor(w, mesh, [places[src]]))
            want = torch.cat([ScaledFp8Tensor.from_hp(_chunk(w, world, sd, r).contiguous()).to_hp(torch.float32)
                              for r in range(world)], sd)
        e = d.redistribute(mesh, [places[dst]])
        loc = e.to_local()
        p = e.placements[0]
        ref = _chunk(want, world, p.dim, rank) if isinstance(p, Shard) else want
        if not isinstance(loc, ScaledFp8Tensor) or loc.shape != ref.shape or not torch.equal(
                loc.to_hp(torch.float32), ref):
            fails.append(f"iteration {i} {shape} {src}->{dst} transposed={transposed}: local tensor "
                         f"{tuple(loc.shape)} does not dequantize to its slice {tuple(ref.shape)} of the shards' "
                         f"values")
            # no break: every rank must issue the same collectives (an early exit on one rank hangs the others)
    fails = fails[:5]
    return {"seed": seed, "fails": fails}


@pytest.mark.parametrize("world", [2, 3])
def test_repeated_fp8_redistribute_on_gloo(world, tmp_path):
    """Hundreds of fp8 all-gathers (one-row shards) back to back: every rank finishes, every result bit-exact.

    torch's gloo heap corruption is rare with fp8tensor's serial collectives but not gone: a full CI run on torch
    2.14.1 once lost a rank to it (``double free or corruption``, docs/pytorch_issues.md item 3). The spawn harness
    repeats a run that fails that way, and only that way, once with fresh processes and seed; two in a row, or any
    other error or a wrong value, fail the test."""
    from _spawn import spawn

    res = spawn(__name__, "worker", world, tmp_path)
    fails = {r: x["fails"] for r, x in enumerate(res) if x["fails"]}
    assert not fails, f"(seed {res[0]['seed']}) {fails}"
