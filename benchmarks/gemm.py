"""GEMM throughput: bf16 vs each fp8tensor backend, and which backend ``"auto"`` picks.

Usage (one GPU): ``PYTHONPATH=. python benchmarks/gemm.py``. Prints a markdown table of TFLOP/s.
Operands are pre-quantized (row-wise e4m3), so the table measures the GEMM plus the backend's scale handling:
``rowwise`` = native row-wise ``torch._scaled_mm``; ``tensorwise`` = unit-scale ``_scaled_mm`` + float32
output + the row/column fix-up (eager); ``emulated`` = dequantize + bf16-free float32 matmul.
"""
from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import bench_ms, env_line  # noqa: E402

from fp8tensor.gemm import choose_backend, scaled_mm  # noqa: E402
from fp8tensor.quantize import quantize_rowwise  # noqa: E402

SHAPES = [(8192, 8192, 8192), (16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--skip-emulated", action="store_true")
    args = p.parse_args()
    dev = torch.device("cuda")
    print(f"# GEMM TFLOP/s ({env_line()})\n")
    cols = ["bf16", "rowwise fast", "rowwise slow", "tensorwise fast", "tensorwise slow"]
    if not args.skip_emulated:
        cols.append("emulated")
    print("| M×K×N | " + " | ".join(cols) + " | auto picks | fastest fp8 |")
    print("|" + "---|" * (len(cols) + 3))
    for M, K, N in SHAPES:
        a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
        a8, sa = quantize_rowwise(a, 1)
        w8, sw = quantize_rowwise(w, 1)
        b8, sb = w8.t(), sw.t()
        flops = 2 * M * K * N
        res = {"bf16": bench_ms(lambda: a @ w.t())}
        for name in ("rowwise", "tensorwise", "emulated"):
            if name == "emulated" and args.skip_emulated:
                continue
            for fast in ((True, False) if name != "emulated" else (False,)):
                key = name if name == "emulated" else f"{name} {'fast' if fast else 'slow'}"
                res[key] = bench_ms(
                    lambda: scaled_mm(a8, sa, b8, sb, torch.bfloat16, use_fast_accum=fast, backend=name)
                )
        tflops = {k: flops / (v * 1e-3) / 1e12 for k, v in res.items()}
        auto = choose_backend(dev, a8.dtype, b8.dtype, torch.bfloat16)
        fp8_keys = [k for k in tflops if k != "bf16"]
        best = max(fp8_keys, key=lambda k: tflops[k])
        print(
            f"| {M}×{K}×{N} | "
            + " | ".join(f"{tflops[c]:.0f}" for c in cols)
            + f" | {auto} | {best} |"
        )


if __name__ == "__main__":
    main()
