"""Loading an fp8 state dict held by rank 0 only (``set_model_state_dict`` with ``broadcast_from_rank0=True``) and
``distribute_tensor(..., [Replicate()])`` of a ScaledFp8Tensor, over real gloo processes (2 and 3 ranks).

torch's state-dict broadcast allocates a plain tensor of the logical dtype on the receiving ranks while rank 0 holds
a ScaledFp8Tensor, so the broadcast carries the values in the logical dtype and each fp8 rank copies them into its
tensor (quantized in its own layout). What is checked:

* ``quantize_weights`` models (bfloat16 and float32), plain and under FSDP2: after the load every rank's weights have
  the bits of rank 0's state dict (a tensor quantized from values of its logical dtype round-trips exactly), the
  biases equal, and the forward outputs equal the source model's on every rank.
* ``distribute_tensor(Replicate)``: every rank holds the same bits. Tensors quantized from their logical dtype keep
  the source's bits; tensors that do not round-trip (codes below the fp8 maximum, float16 subnormals) are
  re-quantized on every rank, the source included, within fp8 rounding of the source's values.
"""
from __future__ import annotations

import traceback

import pytest
import torch
import torch.nn as nn

pytestmark = pytest.mark.slow


def spawn(world: int, out_dir) -> list[dict]:
    from _spawn import spawn as run

    return run(__name__, "worker", world, out_dir)


def _bits(t) -> tuple:
    """``(fp8 bytes, scale)`` of a ScaledFp8Tensor (a DTensor's full tensor), or ``(t, None)``."""
    from fp8tensor import ScaledFp8Tensor

    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    t = t.detach()
    if isinstance(t, ScaledFp8Tensor):
        return t.qdata.view(torch.uint8).clone(), t.scale.expand(
            [n if s > 1 else 1 for n, s in zip(t.shape, t.scale.shape)]).clone()
    return t.clone(), None


def _model(seed: int, dtype: torch.dtype) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    m = nn.Sequential(nn.Linear(40, 24), nn.ReLU(), nn.Linear(24, 16))
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):  # rows of very different magnitudes: every row scale differs
            rows = torch.logspace(-2, 2, p.shape[0]).view(-1, *([1] * (p.ndim - 1)))
            p.copy_(torch.randn(p.shape, generator=g) * rows)
    return m.to(dtype)


def check_load(rank: int, world: int, seed: int) -> list:
    from fp8tensor import quantize_weights
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    fails = []
    for dtype in (torch.bfloat16, torch.float32):
        for fsdp in (False, True):
            tag = f"{dtype} {'FSDP2' if fsdp else 'plain'}"
            try:
                src = quantize_weights(_model(seed, dtype))
                dst = quantize_weights(_model(seed + 1 + rank, dtype))  # other weights on every rank
                if fsdp:
                    fully_shard(dst)
                sd = src.state_dict() if rank == 0 else {}
                set_model_state_dict(dst, sd, options=StateDictOptions(full_state_dict=True,
                                                                       broadcast_from_rank0=True))
                for (name, p), (_, q) in zip(dst.named_parameters(), src.named_parameters()):
                    (a, sa), (b, sb) = _bits(p), _bits(q)
                    if not torch.equal(a, b) or (sa is None) != (sb is None) or (sa is not None and
                                                                                 not torch.equal(sa, sb)):
                        fails.append(f"{tag}: {name} does not have the bits of rank 0's state dict")
                x = torch.randn(5, 40, generator=torch.Generator().manual_seed(seed)).to(dtype)
                with torch.no_grad():
                    y, want = dst(x), src(x)
                y = y.full_tensor() if hasattr(y, "full_tensor") else y
                if not torch.equal(y, want):
                    fails.append(f"{tag}: outputs differ from the source model's")
            except Exception as e:  # noqa: BLE001 - recorded for the parent
                fails.append(f"{tag}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}")
    return fails


def _replicate_cases(rank: int, seed: int):
    """``(name, tensor)``: this rank's tensors to replicate (every rank passes different values; rank 0's win)."""
    from fp8tensor import ScaledFp8Tensor

    g = torch.Generator().manual_seed(seed + rank)
    rows = torch.logspace(-3, 3, 6).view(-1, 1)
    for dtype in (torch.bfloat16, torch.float32):
        yield f"from_hp {dtype}", ScaledFp8Tensor.from_hp((torch.randn(6, 9, generator=g) * rows).to(dtype))
        t = ScaledFp8Tensor.from_hp((torch.randn(6, 9, generator=g) * rows).to(dtype))
        low = (t.qdata.float() * 0.6).to(t.qdata.dtype)  # rows whose codes stay below the fp8 maximum
        yield f"codes below the maximum {dtype}", ScaledFp8Tensor(low, t.scale * 1.0371, orig_dtype=dtype)
    # float16 rows of normal values (about 1e-3) whose small codes dequantize to float16 subnormals (about 1e-6)
    w = torch.randn(16, 256, generator=g) * 1e-3
    w[:, 1::2] *= 1e-3
    yield "float16 subnormals", ScaledFp8Tensor.from_hp(w.half())


def check_replicate(rank: int, world: int, seed: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, t in _replicate_cases(rank, seed):
        before = _bits(t)
        source = t.to_hp(torch.float64)
        d = distribute_tensor(t, mesh, [Replicate()])
        loc = d.to_local()
        out[name] = {"type": type(loc).__name__, "bits": _bits(loc), "values": loc.to_hp(torch.float64),
                     "source": source, "source_bits": before}
    return out


def check_direct(rank: int, world: int, seed: int) -> list:
    """``dist.broadcast`` called directly: a source that does not round-trip is re-quantized in place, so its aliases
    (``p.detach()``, ``p.data``) and every rank hold the same bits; a receiver that is a strided view writes through
    to its parent (data and scales); a non-finite row raises on no rank (the next collective runs on every rank); a
    view whose scales stand for elements outside it raises NotImplementedError before the collective (on every rank
    here: each passes one)."""
    import torch.distributed as dist
    from fp8tensor import ScaledFp8Tensor

    fails = []

    def same_everywhere(what, t):
        got = _bits(t)
        everyone = [None] * world
        dist.all_gather_object(everyone, got)
        if not all(torch.equal(a, b) for other in everyone for a, b in zip(other, got)):
            fails.append(f"{what}: ranks hold different bits")

    q = torch.tensor([[100.0, 50.0, -20.0, 3.0]]).repeat(2, 1).to(torch.float8_e4m3fn)  # codes below the maximum
    for how in ("tensor", "detach", "data"):
        p = ScaledFp8Tensor(q.clone(), torch.full((2, 1), 0.01), orig_dtype=torch.bfloat16)
        if rank != 0:
            p = ScaledFp8Tensor.from_hp(torch.randn(2, 4).bfloat16())
        dist.broadcast({"tensor": p, "detach": p.detach(), "data": p.data}[how], src=0)
        same_everywhere(f"broadcast of the source's {how}", p)
    # receivers holding a strided row view of a larger tensor: data and scales written through to the parent
    parent = ScaledFp8Tensor.from_hp((torch.randn(6, 16) * torch.logspace(-2, 2, 6).view(-1, 1)).bfloat16())
    v = parent[::2]
    dist.broadcast(v, src=0)
    same_everywhere("strided view", v)
    if not torch.equal(parent.to_hp(torch.float32)[::2], v.to_hp(torch.float32)):
        fails.append("strided view: the parent does not hold the view's new values")
    # a NaN code on the source, plain receivers (the state-dict path): nobody raises
    if rank == 0:
        qn = torch.full((4, 8), 1.0).to(torch.float8_e4m3fn)
        qn[1, 3] = float("nan")
        src = ScaledFp8Tensor(qn, torch.ones(4, 1), orig_dtype=torch.bfloat16)
    else:
        src = torch.empty(4, 8, dtype=torch.bfloat16)
    try:
        dist.broadcast(src, src=0)
        vals = src.to_hp(torch.float32) if rank == 0 else src.float()
        if not (vals[1].isnan().all() if rank == 0 else vals[1, 3].isnan()) or not vals[0].isfinite().all():
            fails.append(f"NaN source: rank {rank} holds {vals.tolist()}")
    except Exception as e:  # noqa: BLE001
        fails.append(f"NaN source raised on rank {rank}: {type(e).__name__}: {e}")
    dist.barrier()
    full = ScaledFp8Tensor.from_hp(torch.randn(6, 16).bfloat16())
    try:
        dist.broadcast(full[:, :4].contiguous(), src=0)
        fails.append("a column slice of a row-scaled tensor was broadcast")
    except NotImplementedError as e:
        if "broadcast_" not in str(e) or "column slice" not in str(e):
            fails.append(f"column slice: unhelpful message {e}")
    dist.barrier()
    return fails


def worker(rank: int, world: int, seed: int) -> dict:
    return {"seed": seed, "load": check_load(rank, world, seed), "replicate": check_replicate(rank, world, seed),
            "direct": check_direct(rank, world, seed)}


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def run(request, tmp_path_factory):
    return spawn(request.param, tmp_path_factory.mktemp(f"bcast{request.param}"))


def test_broadcast_from_rank0_loads_fp8_state_dict(run):
    """``set_model_state_dict(..., broadcast_from_rank0=True)`` of a ``quantize_weights`` state dict on rank 0:
    every rank gets its bits (plain and FSDP2 models, bfloat16 and float32)."""
    fails = {rank: r["load"] for rank, r in enumerate(run) if r["load"]}
    assert not fails, f"(seed {run[0]['seed']}) " + "\n".join(f"rank {k}: {v}" for k, v in fails.items())


def test_replicate_every_rank_holds_the_same_bits(run):
    """``distribute_tensor(Replicate)`` of a ScaledFp8Tensor: every rank holds the same bits. A tensor quantized from
    its logical dtype keeps the source's bits; one whose codes do not round-trip (codes below the fp8 maximum,
    float16 subnormals) is re-quantized from the values on every rank, the source included: within fp8 rounding."""
    seed = run[0]["seed"]
    for name, r0 in run[0]["replicate"].items():
        for rank, r in enumerate(run):
            got = r["replicate"][name]
            assert got["type"] == "ScaledFp8Tensor", f"(seed {seed}) rank {rank} {name}: local is {got['type']}"
            for a, b in zip(got["bits"], r0["bits"]):
                assert torch.equal(a, b), f"(seed {seed}) rank {rank} {name}: bits differ from rank 0's"
            if name.startswith("from_hp"):
                for a, b in zip(got["bits"], r0["source_bits"]):
                    assert torch.equal(a, b), f"(seed {seed}) rank {rank} {name}: not the source's bits"
            ref = r0["source"]  # rank 0's values: the broadcast's source
            # the values in the logical dtype (at most 2^-8 of themselves in bfloat16), re-quantized: e4m3 rounds to
            # nearest with 3 mantissa bits, a normal value moves by at most 2^-4 of itself, a subnormal code (below
            # 2^-6 of the row's scale unit) by at most 2^-10 of the row's largest value
            err = (got["values"] - ref).abs()
            bound = (2.0 ** -4 + 2.0 ** -8) * ref.abs() + 2.0 ** -10 * ref.abs().amax(-1, keepdim=True)
            worst = (err - bound).max().item()
            assert worst <= 0, f"(seed {seed}) rank {rank} {name}: error exceeds fp8 rounding by {worst:.3g}"


def test_direct_broadcast_source_nan_and_views(run):
    """``dist.broadcast`` of a source that does not round-trip (or of its ``detach()`` / ``.data``) leaves every rank
    with the same bits; a strided receiver view writes through to its parent; a NaN row raises on no rank; a
    column-slice view raises NotImplementedError naming the op."""
    fails = {rank: r["direct"] for rank, r in enumerate(run) if r["direct"]}
    assert not fails, f"(seed {run[0]['seed']}) " + "\n".join(f"rank {k}: {v}" for k, v in fails.items())
