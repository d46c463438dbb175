"""Calibrate ``fp8tensor.convert.fp8_size_rule`` and compare the fp8 GEMMs' kernels (tiles) with bf16's at small shapes.

1. Per-layer forward + backward, bf16 vs ``convert_to_fp8`` (rowwise), compiled, for square and MLP-shaped Linears
   from 512 to 4096 features at M = 8192 and 16384 tokens; prints the fp8 / bf16 time ratio next to the rule's
   decision (``K * N / (K + N) >= size_rule_min``) and the smallest ``K * N / (K + N)`` at which fp8 was faster
   at every M measured: the value to set ``size_rule_min`` to (``fp8tensor.set_config(size_rule_min=...)``).
2. The GEMM kernels themselves at the small shapes: ``torch._scaled_mm`` (row-wise scales, fast accumulation as the
   forward, slow as the gradients) vs ``torch.mm`` in bf16, each shape's kernel name (CUTLASS / cuBLAS names carry
   their tile and cluster sizes) and time, to see whether the fp8 GEMM picks a tile as good as bf16's.

Usage: ``PYTHONPATH=. python benchmarks/size_rule.py [--quick]``.
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

FEATURES = (512, 768, 1024, 1536, 2048, 4096)


def _shapes(quick: bool):
    feats = (768, 1024, 2048) if quick else FEATURES
    out = []
    for d in feats:
        out += [(d, d), (d, 4 * d), (4 * d, d)]
    return out


def step_ms(K: int, N: int, M: int, fp8: bool) -> float:
    lin = nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
    if fp8:
        fp8tensor.convert_to_fp8(lin, size_rule=False)
    torch._dynamo.reset()
    f = torch.compile(lin)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)

    def step():
        x.grad = None
        lin.weight.grad = None
        f(x).backward(gy)

    step()
    return bench_ms(step)


def section_layers(quick: bool) -> None:
    Ms = (8192,) if quick else (8192, 16384)
    print("| K→N | K·N/(K+N) | rule | " + " | ".join(f"fp8/bf16 at M={m}" for m in Ms) + " |")
    print("|---|---|---|" + "---|" * len(Ms))
    wins = []
    for K, N in _shapes(quick):
        ratios = []
        for M in Ms:
            ratios.append(step_ms(K, N, M, True) / step_ms(K, N, M, False))
        inten = K * N / (K + N)
        wins.append((inten, all(r < 1 for r in ratios)))
        cells = " | ".join(f"{r:.2f}" for r in ratios)
        print(f"| {K}→{N} | {inten:.0f} | {'fp8' if convert_mod.fp8_size_rule(K, N) else 'bf16'} | {cells} |")
    losing = [i for i, w in wins if not w]
    above = [i for i, w in sorted(wins) if w and all(i > j for j in losing)]
    print(f"\nsize_rule_min now {fp8tensor.get_config().size_rule_min}; smallest K·N/(K+N) above every shape where fp8 lost: "
          f"{min(above) if above else 'none'} (shapes where fp8 lost: {sorted(round(i) for i in losing)})")


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
    ap.add_argument("--quick", action="store_true", help="fewer shapes and one M")
    args = ap.parse_args()
    print(f"# size rule and GEMM kernels ({env_line()})\n")
    section_layers(args.quick)
    section_gemm_tiles(args.quick)


if __name__ == "__main__":
    main()
