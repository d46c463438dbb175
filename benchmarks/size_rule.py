"""Calibrate ``fp8tensor.convert.fp8_size_rule`` and compare the fp8 GEMMs' kernels (tiles) with bf16's at small shapes.

1. Per-layer forward + backward, bf16 vs ``convert_to_fp8`` (rowwise and rowwise_gw_hp), eager and captured as one
   CUDA graph (no host time, as under a whole-step graph), for square, 4:1 grouped-query k/v and MLP-shaped Linears
   from 512 to 4096 features at M = 8192 and 16384 tokens; prints the fp8 / bf16 time ratio next to the rule's
   decision (``K * N / (K + N) >= size_rule_min``) and the smallest ``K * N / (K + N)`` at which fp8 was faster
   at every M measured: the value to set ``size_rule_min`` to (``fp8tensor.set_config(size_rule_min=...)``).
2. The GEMM kernels themselves at the small shapes: ``torch._scaled_mm`` (row-wise scales, fast accumulation as the
   forward, slow as the gradients) vs ``torch.mm`` in bf16, each shape's kernel name (CUTLASS / cuBLAS names carry
   their tile and cluster sizes) and time, to see whether the fp8 GEMM picks a tile as good as bf16's.

Usage: ``PYTHONPATH=. python benchmarks/size_rule.py [--quick] [--fused-grad-out MODE]``.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn as nn

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import bench_ms, env_line  # noqa: E402

import fp8tensor  # noqa: E402
from fp8tensor import convert as convert_mod  # noqa: E402
from fp8tensor.quantize import E4M3, quantize  # noqa: E402

FEATURES = (512, 768, 1024, 1536, 2048, 3072, 4096)
VARIANTS = ("bf16", "rowwise", "rowwise_gw_hp")


def _shapes(quick: bool):
    feats = (768, 1024, 1536, 2048, 3072) if quick else FEATURES
    out = []
    for d in feats:  # attention (square, and the k / v projections of 4:1 grouped-query attention), MLP in / out
        out += [(d, d), (d, d // 4), (d, 4 * d), (4 * d, d)]
    return out


def step_ms(K: int, N: int, M: int, variant: str) -> float:
    """Median ms of one Linear's forward + backward (grad_input and grad_weight), captured as one CUDA graph
    (``fp8tensor.graph_step``: no host time, as in a whole-step graph), eager (no ``torch.compile``)."""
    lin = nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
    if variant != "bf16":
        fp8tensor.convert_to_fp8(lin, recipe=variant, size_rule=False)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    step = fp8tensor.graph_step(lambda: lin(x).backward(gy), [*lin.parameters(), x])
    ms = bench_ms(step)
    step.close()
    return ms


def section_layers(quick: bool) -> None:
    Ms = (8192, 16384)
    print("fp8 / bf16 time of one Linear's forward + backward (graph-captured, eager); < 1: fp8 faster\n")
    print("| K→N | K·N/(K+N) | rule | " + " | ".join(f"{v} M={m}" for m in Ms for v in VARIANTS[1:]) + " |")
    print("|---|---|---|" + "---|" * (len(Ms) * (len(VARIANTS) - 1)))
    wins = []
    for K, N in _shapes(quick):
        cells, rw = [], []
        for M in Ms:
            t = {v: step_ms(K, N, M, v) for v in VARIANTS}
            for v in VARIANTS[1:]:
                cells.append(t[v] / t["bf16"])
            rw.append(t["rowwise"] / t["bf16"])
        inten = K * N / (K + N)
        wins.append((inten, all(r < 1 for r in rw)))
        print(f"| {K}→{N} | {inten:.0f} | {'fp8' if convert_mod.fp8_size_rule(K, N) else 'bf16'} | "
              + " | ".join(f"{r:.2f}" for r in cells) + " |", flush=True)
    losing = [i for i, w in wins if not w]
    above = [i for i, w in sorted(wins) if w and all(i > j for j in losing)]
    print(f"\nsize_rule_min now {fp8tensor.get_config().size_rule_min}; smallest K·N/(K+N) above every shape where "
          f"rowwise lost: {min(above) if above else 'none'} (shapes where it lost: {sorted(round(i) for i in losing)})")


def _kernel_names(fn) -> list:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.key, e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
            for e in prof.key_averages()]


def section_gemm_tiles(quick: bool) -> None:
    print("\n| M×K×N | GEMM | µs | kernel |\n|---|---|---|---|")
    shapes = [(8192, 2048, 2048), (8192, 2048, 5632), (8192, 5632, 2048)]
    if not quick:
        shapes += [(8192, 1024, 1024), (16384, 4096, 4096), (8192, 768, 3072)]
    for M, K, N in shapes:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        a8, sa = quantize(a, -1, E4M3)
        b8, sb = quantize(b, -1, E4M3)
        runs = {
            "bf16 mm": lambda: torch.mm(a, b.t()),
            "fp8 fast accum": lambda: torch._scaled_mm(a8, b8.t(), sa, sb.t(), out_dtype=torch.bfloat16,
                                                       use_fast_accum=True),
            "fp8 slow accum": lambda: torch._scaled_mm(a8, b8.t(), sa, sb.t(), out_dtype=torch.bfloat16,
                                                       use_fast_accum=False),
        }
        for name, fn in runs.items():
            us = bench_ms(fn) * 1e3
            names = [k for k, _ in _kernel_names(fn)]
            kern = max(names, key=len) if names else "?"
            print(f"| {M}×{K}×{N} | {name} | {us:.1f} | `{kern[:110]}` |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--fused-grad-out", default=None, choices=("eager", "never"),
                    help="fp8tensor.set_config(fused_grad_out=...) for the (eager) fp8 Linears")
    args = ap.parse_args()
    if args.fused_grad_out is not None:
        fp8tensor.set_config(fused_grad_out=args.fused_grad_out)
    print(f"# size rule and GEMM kernels ({env_line()})\n")
    section_layers(args.quick)
    section_gemm_tiles(args.quick)


if __name__ == "__main__":
    main()
