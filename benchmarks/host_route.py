"""Host time of the eager no-grad fp8 Linear's decode route, on any machine (CPU included): the decode GEMM's
availability check and its kernel launches are replaced by stand-ins, so what is timed is fp8tensor's Python from
the module call to the launch (checks, settings, launch arguments, output allocation), not Triton's launch nor the
GPU. Per call, min over batches (µs); a bf16 ``nn.Linear`` of a tiny shape as the yardstick (it includes a small
GEMM on the CPU). The real launch and GEMM are timed on the GPU by ``benchmarks/serve.py --host``.

    PYTHONPATH=. python benchmarks/host_route.py
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

import fp8tensor
from fp8tensor.numerics import kernels


def per_call(fn, n: int = 50, batches: int = 400) -> float:
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(batches):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def main() -> None:
    launches = []
    kernels._launch = lambda fn, *a, **k: launches.append(fn)  # (stand-in: nothing launched)
    limit = kernels.W8_MM_CONFIG["max_m"]
    kernels.w8_mm_available = lambda x, w8: (  # (stand-in: the CUDA check without is_cuda)
        x.dim() >= 2 and w8.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and x.shape[-1] == w8.shape[1]
        and 1 <= x.numel() // max(x.shape[-1], 1) <= limit)
    torch.manual_seed(0)
    tiny = nn.Linear(16, 16, dtype=torch.bfloat16)
    lin = fp8tensor.quantize_weights(nn.Sequential(nn.Linear(4096, 4096, dtype=torch.bfloat16)))[0]
    rows = [("nn.Linear bf16 16 -> 16, one token", lambda: tiny(xt)),
            ("fp8 Linear 4096 -> 4096 (bias), x (1, 4096)", lambda: lin(x2)),
            ("fp8 Linear 4096 -> 4096 (bias), x (1, 1, 4096)", lambda: lin(x3))]
    xt = torch.randn(1, 16, dtype=torch.bfloat16)
    x2 = torch.randn(1, 4096, dtype=torch.bfloat16)
    x3 = x2.view(1, 1, 4096)
    with torch.no_grad():
        lin(x3)
        assert launches, "the decode route was not taken"
        print("| call | µs |\n|---|---|")
        for name, fn in rows:
            print(f"| {name} | {per_call(fn):.1f} |")


if __name__ == "__main__":
    main()
