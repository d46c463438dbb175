"""Tensor-parallel Llama block training step: bf16 vs fp8tensor recipes, with and without fp8 sequence-parallel
communication.

Setup (the method of docs/benchmarks.md): one Llama3-8B-sized block (hidden 4096, 32 query / 8 kv heads,
FFN 14336), sequence 8192, batch 1, TP=2 with sequence parallelism via PyTorch's own parallel styles
(``examples/llama.py``'s block plan), block compiled with ``torch.compile``, step = forward + backward with a fixed
grad_output, median of 20 timed steps after warm-up.

Usage (2 GPUs): ``PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/tp.py [--profile] [--seq 8192]``.
CPU smoke test: ``torchrun --nproc-per-node 2 benchmarks/tp.py --cpu-smoke``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import fp8tensor  # noqa: E402
from fp8tensor.parallel import fp8_sequence_parallel_plan  # noqa: E402
from llama import ModelArgs, TransformerBlock, block_tp_plan, rope_table  # noqa: E402


def build(variant: str, args: ModelArgs, mesh, device, dtype, compile_: bool):
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    block = TransformerBlock(0, args).to(device=device, dtype=dtype)
    plan = block_tp_plan(sequence_parallel=True)
    if variant != "bf16":
        recipe = "rowwise_gw_hp" if "gw_hp" in variant else "rowwise"
        fp8tensor.convert_to_fp8(block, recipe=recipe)
        if "fp8 comm" in variant:
            plan = fp8_sequence_parallel_plan(plan)
    parallelize_module(block, mesh, plan)
    return torch.compile(block) if compile_ else block


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="print top kernels of each variant (rank 0)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny dims, gloo, no compile")
    p.add_argument("--variants", default="bf16,fp8 rowwise,fp8 rowwise_gw_hp,fp8 rowwise + fp8 comm")
    a = p.parse_args()

    cpu = a.cpu_smoke or not torch.cuda.is_available()
    dist.init_process_group("gloo" if cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cpu:
        device, dtype = torch.device("cpu"), torch.float32
        args = ModelArgs(dim=128, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=256, max_seq_len=64)
        seq, steps, compile_ = 64, 2, False
    else:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device, dtype = torch.device("cuda"), torch.bfloat16
        args = ModelArgs(dim=4096, n_layers=1, n_heads=32, n_kv_heads=8, ffn_hidden=14336, max_seq_len=a.seq)
        seq, steps, compile_ = a.seq, a.steps, True
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    rope = rope_table(args.head_dim, seq).to(device)
    torch.manual_seed(1)
    x_full = torch.randn(1, seq, args.dim, device=device, dtype=dtype)
    g_full = torch.randn(1, seq, args.dim, device=device, dtype=dtype)
    chunk = seq // world
    # Under sequence parallelism the residual stream between blocks is the local sequence shard (plain tensor).
    x = x_full[:, rank * chunk:(rank + 1) * chunk].contiguous().requires_grad_()
    g = g_full[:, rank * chunk:(rank + 1) * chunk].contiguous()

    results, outs = {}, {}
    for variant in [v.strip() for v in a.variants.split(",")]:
        if not cpu:
            torch._dynamo.reset()
        block = build(variant, args, mesh, device, dtype, compile_)

        def step():
            y = block(x, rope)
            y.backward(g)
            return y

        for _ in range(3):
            y = step()
        outs[variant] = y.detach().float()
        times = []
        for _ in range(steps):
            if not cpu:
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            step()
            if not cpu:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        results[variant] = times[len(times) // 2]
        if a.profile and not cpu:
            if rank == 0:
                from _util import top_kernels

                print(f"\n## top kernels (rank 0): {variant}\n```\n{top_kernels(step, n=15)}\n```", flush=True)
            else:
                for _ in range(4):  # the same collectives as rank 0's profiled calls
                    step()
        x.grad = None
        del block
    diffs = {}
    ref = outs.get("bf16")
    for v in results:
        if ref is None:
            diffs[v] = float("nan")
            continue
        num = torch.tensor([(outs[v] - ref).norm().item() ** 2, ref.norm().item() ** 2], device=device)
        dist.all_reduce(num)
        diffs[v] = (num[0] / num[1]).sqrt().item()
    if rank == 0:
        from _util import env_line

        print(f"\n# TP={world} Llama block step, seq {seq}, hidden {args.dim}, FFN {args.hidden_dim} ({env_line() if not cpu else 'cpu'})\n")
        print("| variant | ms | speedup vs bf16 | output rel. diff vs bf16 |\n|---|---|---|---|")
        for v, ms in results.items():
            print(f"| {v} | {ms:.2f} | {results.get('bf16', ms) / ms:.3f} | {diffs[v]:.4f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
