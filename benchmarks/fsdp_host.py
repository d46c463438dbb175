"""Host time of FSDP2's parameter all-gather path on one rank: bf16 vs fp8tensor master weights (CPU or CUDA).

A stack of ``--layers`` Llama-shaped layers (the seven bias-free projections, small dims so the host dominates),
``fully_shard`` per layer and at the root over a 1-rank mesh, ``MixedPrecisionPolicy(param_dtype=bf16)``. One
"round" is what a training step does to the weights before each block runs: the root's ``unshard`` and, per layer,
``unshard`` + ``reshard`` (pre-all-gather hooks, the 1-rank all-gather, post-all-gather hooks). Printed: the minimum
over repetitions of the mean ms per round (a shared CPU adds other processes' time to some repetitions).

``--stub-quant`` makes the fp8 pre-all-gather take its CUDA path (one grouped kernel launch writes a whole layer's
payload) with the launch stubbed out, so on the CPU what remains is the Python a GPU step runs around it: FSDP2's
extension path and fp8tensor's hooks (on the CPU without it, each weight is quantized by the plain ops). Values
are then meaningless; only the host time counts.

Usage::

    PYTHONPATH=. python3 benchmarks/fsdp_host.py [--stub-quant] [--profile fp8|bf16]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import fp8tensor  # noqa: E402
import fp8tensor.fsdp as f8fsdp  # noqa: E402
from _util import Layer, one_process_mesh  # noqa: E402


def build(fp8: bool, layers: int, dim: int, device: torch.device, mesh) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = nn.Sequential(*[Layer(dim, dim // 2, 2 * dim) for _ in range(layers)]).to(device)
    if fp8:
        fp8tensor.convert_to_fp8(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def stub_quantization() -> None:
    """Make the fp8 pre-all-gather run its CUDA path (the grouped row-wise kernel writing a layer's payload in one
    launch) with the launch itself stubbed out, on any device (see the module doc)."""
    f8fsdp.kernels.HAS_TRITON = True
    f8fsdp.kernels.row_kernel_available = lambda t: True
    f8fsdp.kernels.quantize_last_dim_group_into = lambda *args, **kwargs: None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--inner", type=int, default=20)
    p.add_argument("--stub-quant", action="store_true")
    p.add_argument("--profile", choices=["bf16", "fp8"], default=None,
                   help="cProfile 50 rounds of this variant (top 30 functions by own time)")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cpu":
        torch.set_num_threads(1)
    if args.stub_quant:
        stub_quantization()
    mesh = one_process_mesh(dev, (1,))
    res = {}
    for name in ("bf16", "fp8"):
        model = build(name == "fp8", args.layers, args.dim, dev, mesh)

        def round_():
            model.unshard()
            for layer in model:
                layer.unshard()
                layer.reshard()

        for _ in range(20):
            round_()
        times = []
        for _ in range(args.reps):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            for _ in range(args.inner):
                round_()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append((time.perf_counter() - t0) / args.inner * 1e3)
        res[name] = min(times)
        if args.profile == name:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(50):
                round_()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(30)
    stub = ", quantization stubbed" if args.stub_quant else ""
    print(f"# FSDP2 unshard rounds, {args.layers} layers of dim {args.dim}, 1 rank, {dev.type}{stub}; "
          f"{time.strftime('%Y-%m-%d')} · torch {torch.__version__}")
    for name, ms in res.items():
        print(f"{name}: {ms:.3f} ms per round ({ms / args.layers * 1e3:.0f} µs per layer)")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
