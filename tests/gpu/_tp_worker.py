"""Worker for test_tp_2gpu.py (run by torchrun on 2 GPUs): a Llama block with TP=2 + sequence parallelism in fp8
vs the same block on one device in fp8 and in float64. Prints one JSON line on rank 0."""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import fp8tensor  # noqa: E402
from fp8tensor.parallel import fp8_sequence_parallel_plan  # noqa: E402
from llama import ModelArgs, TransformerBlock, block_tp_plan, rope_table  # noqa: E402


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cuda", (world,))
    args = ModelArgs(dim=1024, n_layers=1, n_heads=8, n_kv_heads=4, ffn_hidden=2816, max_seq_len=512)
    B, T = 2, 512
    torch.manual_seed(0)
    ref = TransformerBlock(0, args).cuda().double()
    x = torch.randn(B, T, args.dim, device="cuda", dtype=torch.float64)
    gy = torch.randn(B, T, args.dim, device="cuda", dtype=torch.float64)
    rope = rope_table(args.head_dim, T).cuda()
    xr = x.clone().requires_grad_()
    yr = ref(xr, rope.double())
    yr.backward(gy)
    out = {}
    for recipe in ("rowwise", "rowwise_gw_hp"):
        for fp8_comm in (False, True):
            single = TransformerBlock(0, args).cuda().bfloat16()
            single.load_state_dict({k: v.bfloat16() for k, v in ref.state_dict().items()})
            tp = TransformerBlock(0, args).cuda().bfloat16()
            tp.load_state_dict(single.state_dict())
            fp8tensor.convert_to_fp8(single, recipe=recipe)
            fp8tensor.convert_to_fp8(tp, recipe=recipe)
            plan = block_tp_plan(sequence_parallel=True)
            if fp8_comm:
                plan = fp8_sequence_parallel_plan(plan)
            parallelize_module(tp, mesh, plan)
            xs = x.bfloat16().requires_grad_()
            ys = single(xs, rope)
            ys.backward(gy.bfloat16())
            c = T // world
            xl = x.bfloat16()[:, rank * c:(rank + 1) * c].contiguous().requires_grad_()
            yl = tp(xl, rope)
            yl.backward(gy.bfloat16()[:, rank * c:(rank + 1) * c])
            yt = [torch.empty_like(yl) for _ in range(world)]
            dist.all_gather(yt, yl.detach().contiguous())
            gt = [torch.empty_like(xl.grad) for _ in range(world)]
            dist.all_gather(gt, xl.grad.contiguous())
            y_tp, gx_tp = torch.cat(yt, 1), torch.cat(gt, 1)
            w_tp = tp.feed_forward.w2.weight.full_tensor()
            gw_tp = tp.feed_forward.w2.weight.grad.full_tensor()
            key = f"{recipe}{'+fp8comm' if fp8_comm else ''}"
            out[key] = dict(
                y_single=rel(ys, yr), y_tp=rel(y_tp, yr), y_tp_vs_single=rel(y_tp, ys),
                gx_single=rel(xs.grad, xr.grad), gx_tp=rel(gx_tp, xr.grad),
                gw2_single=rel(single.feed_forward.w2.weight.grad, ref.feed_forward.w2.weight.grad),
                gw2_tp=rel(gw_tp, ref.feed_forward.w2.weight.grad),
                w_same=bool(torch.equal(w_tp, single.feed_forward.w2.weight.detach())),
            )
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
