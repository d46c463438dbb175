"""FSDP2 parameter all-gather: bf16 (mixed precision) vs fp8tensor's fp8 row-wise all-gather.

Setup: a stack of Llama3-8B-sized layers (hidden 4096, 32 query / 8 kv heads of 128 -> q/o 4096x4096, k/v
1024x4096; SwiGLU FFN 14336 -> w1/w3 14336x4096, w2 4096x14336), bias-free Linears with float32 master weights,
``fully_shard`` per layer over all ranks, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``.

* ``bf16``: plain weights; FSDP2 casts each shard to bf16 and all-gathers 2 bytes per element.
* ``fp8``: ``convert_to_fp8`` weights; each rank quantizes its rows (e4m3 + one float32 scale per row) and FSDP2
  all-gathers ``K + 4`` bytes per row of ``K`` elements (``fp8tensor.fsdp``).

Measured per variant, for one all-gather of every layer (``unshard`` then ``reshard`` each layer in turn):

* bytes: what each rank hands to the all-gather collective (read from an FSDP2 custom all-gather that wraps the
  default one), plus the extra scale all-gather of unevenly sharded weights (none at these dims);
* collective ms: time of the all-gather collectives alone (CUDA events around them on the all-gather stream);
* unshard ms: the whole ``unshard`` (fp8: row-wise quantization of the shard, the collective, copy-out), median
  of ``--iters`` timed iterations after warm-up.

It also checks that the gathered fp8 weight is bit-identical to quantizing the full master weight.

Usage (2 GPUs): ``PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/fsdp_allgather.py [--layers 4]``.
CPU smoke test: ``PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/fsdp_allgather.py --cpu-smoke``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import fp8tensor  # noqa: E402
import fp8tensor.fsdp as f8fsdp  # noqa: E402
from _util import Layer  # noqa: E402

TARGET_RATIO = 0.52


class Recorder:
    """Collects the bytes and (on CUDA) the event pairs of the all-gather collectives while ``on`` is True."""

    def __init__(self, cuda: bool):
        self.cuda, self.on, self.bytes, self.events = cuda, False, 0, []

    def comm(self):
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

        rec = self

        class _Timed(DefaultAllGather):
            def __call__(self, output_tensor, input_tensor, group, async_op=False):
                if not rec.on:
                    return super().__call__(output_tensor, input_tensor, group, async_op)
                rec.bytes += input_tensor.numel() * input_tensor.element_size()
                if rec.cuda:
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    work = super().__call__(output_tensor, input_tensor, group, async_op)
                    e.record()
                    rec.events.append((s, e))
                    return work
                t0 = time.perf_counter()
                work = super().__call__(output_tensor, input_tensor, group, async_op)
                rec.events.append(time.perf_counter() - t0)
                return work

        return _Timed()

    def wrap_scale_gather(self):
        orig = f8fsdp.gather_scales

        def gather(out, scale, group):
            if self.on:
                self.bytes += scale.numel() * scale.element_size()
            return orig(out, scale, group)

        f8fsdp.gather_scales = gather

    def collective_ms(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return sum(s.elapsed_time(e) for s, e in self.events)
        return 1e3 * sum(self.events)


def build(variant: str, layers: int, dims, mesh, device):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[Layer(*dims) for _ in range(layers)]).to(device)
    if variant == "fp8":
        fp8tensor.convert_to_fp8(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny dims, gloo, 2 iterations")
    a = p.parse_args()

    cpu = a.cpu_smoke or not torch.cuda.is_available()
    dist.init_process_group("gloo" if cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cpu:
        device, dims, iters, layers = torch.device("cpu"), (256, 64, 512), 2, min(a.layers, 2)
    else:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device, dims, iters, layers = torch.device("cuda"), (4096, 1024, 14336), a.iters, a.layers
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    rows = {}
    for variant in ("bf16", "fp8"):
        model = build(variant, layers, dims, mesh, device)
        rec = Recorder(device.type == "cuda")
        rec.wrap_scale_gather()
        for layer in model:
            layer.set_custom_all_gather(rec.comm())

        def gather_all():
            for layer in model:
                layer.unshard()
                layer.reshard()

        for _ in range(2):
            gather_all()
        # bytes and collective time of one pass
        rec.on = True
        gather_all()
        rec.on = False
        sent, coll_ms = rec.bytes, rec.collective_ms()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            gather_all()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        exact = None
        if variant == "fp8":
            lin = model[0].w1
            full = fp8tensor.ScaledFp8Tensor.from_hp(lin.weight.full_tensor()._data)
            model[0].unshard()
            w = lin.weight
            ok = torch.tensor(
                [int(torch.equal(w.qdata.view(torch.uint8), full.qdata.view(torch.uint8)) and torch.equal(w.scale, full.scale))],
                device=device,
            )
            model[0].reshard()
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            exact = bool(ok.item())
        rows[variant] = dict(bytes=sent, coll_ms=coll_ms, unshard_ms=times[len(times) // 2], exact=exact)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if rank == 0:
        hidden, kv, ffn = dims
        env = "cpu (gloo) smoke test" if cpu else f"{torch.cuda.get_device_name()} x{world} (NCCL), torch {torch.__version__}"
        print(f"\n# FSDP2 all-gather of {layers} layers (hidden {hidden}, kv {kv}, FFN {ffn}), {world} ranks — {env}\n")
        print("| variant | MB sent per rank | bytes vs bf16 | collective ms | vs bf16 | unshard ms (median) | vs bf16 |")
        print("|---|---|---|---|---|---|---|")
        b = rows["bf16"]
        for v, r in rows.items():
            print(
                f"| {v} | {r['bytes'] / 2**20:.2f} | {r['bytes'] / b['bytes']:.4f} | {r['coll_ms']:.2f} | "
                f"{r['coll_ms'] / max(b['coll_ms'], 1e-9):.3f} | {r['unshard_ms']:.2f} | {r['unshard_ms'] / b['unshard_ms']:.3f} |"
            )
        ratio = rows["fp8"]["bytes"] / b["bytes"]
        print(f"\nfp8 bytes / bf16 bytes = {ratio:.4f} (target <= {TARGET_RATIO}: {'PASS' if ratio <= TARGET_RATIO else 'FAIL'});"
              f" gathered fp8 weight bit-identical to quantizing the full master: {rows['fp8']['exact']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
