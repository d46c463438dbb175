"""CUDA graphs (``torch.compile(mode="reduce-overhead")``) around fp8tensor blocks under FSDP2 (skipped without a GPU).

CUDA-graph trees treat parameters as static inputs and record a block again when one moves; FSDP2 re-allocates the
unsharded parameters each step. A graph replayed on a moved weight would silently read stale memory, so the test
trains with AdamW at a large learning rate (every step changes every weight by several percent) and requires each
step's loss to match the same training under the default compile mode.
"""
import copy

import pytest
import torch
import torch.nn as nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda"


def _blocks(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 512, bias=False), nn.ReLU(), nn.Linear(512, 256, bias=False))
                           for _ in range(2)]).to(DEV)


def _train(model: nn.Sequential, mode, xs, reshard: bool, fp8_all_gather: bool):
    """Convert, compile each block with ``mode``, FSDP2 over a 1-rank mesh (bf16 compute, float32 master and
    reduction; ``reshard`` is ``reshard_after_forward``; weights all-gathered in fp8 or in bf16), and train on ``xs``;
    returns the losses and the first step's output."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import fp8tensor

    fp8tensor.convert_to_fp8(model, fp8_all_gather=fp8_all_gather)
    mesh = init_device_mesh("cuda", (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        block.compile(mode=mode) if mode else block.compile()
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, first = [], None
    for x in xs:
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        y = model(x)
        loss = y.float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if first is None:
            first = y.detach().clone()  # a graph output is overwritten by the next replay: copy it
        losses.append(loss.item())
    return losses, first


@pytest.mark.parametrize("reshard,fp8_all_gather", [(False, True), (True, True), (False, False)])
def test_fsdp_reduce_overhead_trains_like_default_compile(reshard, fp8_all_gather):
    import torch.distributed as dist
    from torch._inductor import cudagraph_trees

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        gen = torch.Generator(device=DEV).manual_seed(torch.initial_seed() % 2**31)
        xs = [torch.randn(4, 128, 256, device=DEV, generator=gen) for _ in range(12)]
        ref_model = copy.deepcopy(_blocks(0)).to(torch.float64)
        from torch._dynamo.utils import counters

        runs = {}
        for mode in (None, "reduce-overhead"):
            torch._dynamo.reset()
            counters.clear()
            runs[mode] = _train(_blocks(0), mode, xs, reshard, fp8_all_gather)
            if mode:
                mgr = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
                assert mgr is not None and len(mgr.roots) > 0, "reduce-overhead recorded no CUDA graph"
                # every compiled graph (forward and backward of both blocks) ran as a CUDA graph: none skipped
                assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
        torch._dynamo.reset()
        (l_def, y_def), (l_cg, y_cg) = runs[None], runs["reduce-overhead"]
        # The weights move: a replay on stale weights would be caught (losses change by far more than the bound).
        assert abs(l_def[-1] - l_def[0]) > 0.05 * abs(l_def[0])
        for i, (a, b) in enumerate(zip(l_def, l_cg)):
            assert abs(a - b) <= 1e-3 * abs(a), (i, a, b)
        # First step against float64: 4 chained fp8 GEMMs, 8 e4m3 operands, each with a relative rounding error of
        # RMS at most 2^-4/sqrt(3) (3 mantissa bits, round to nearest); independent errors add in quadrature.
        with torch.no_grad():
            ref = ref_model(xs[0].to(torch.float64))
        rel = ((y_cg.double() - ref).norm() / ref.norm()).item()
        assert rel < 1.5 * 2**-4 / 3**0.5 * 8**0.5, rel
        assert ((y_cg.double() - y_def.double()).norm() / y_def.double().norm()).item() < 1e-3
    finally:
        if own:
            dist.destroy_process_group()
