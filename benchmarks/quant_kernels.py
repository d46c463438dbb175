"""Quantization kernel timings on one GPU: the fused dim-0 quantize+transpose kernel (tile configs) vs
``torch.compile`` of the same math, and row-wise (dim -1) quantization, at 16384×4096 bf16.

Usage: ``PYTHONPATH=. python benchmarks/quant_kernels.py``. Prints µs and achieved GB/s (bytes read + written).
"""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import bench_ms, env_line  # noqa: E402

from fp8tensor import kernels  # noqa: E402
from fp8tensor.quantize import SCALE_FLOOR, quantize_dim0_t, quantize_rowwise  # noqa: E402


def main() -> None:
    M, K = 16384, 4096
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    f8 = torch.float8_e4m3fn
    nbytes = M * K * 2 + M * K  # read bf16, write fp8
    print(f"# quantization kernels, {M}×{K} bf16 ({env_line()})\n")
    print("| variant | µs | GB/s |\n|---|---|---|")

    def row(name, fn):
        ms = bench_ms(fn)
        print(f"| {name} | {ms * 1e3:.1f} | {nbytes / (ms * 1e-3) / 1e9:.0f} |")

    comp_row = torch.compile(lambda t: quantize_rowwise(t, -1, f8))
    row("row-wise (dim -1), torch.compile", lambda: comp_row(x))
    comp_t = torch.compile(lambda t: tuple(v.contiguous() for v in quantize_rowwise(t.t(), -1, f8)))
    row("dim 0 + transpose, torch.compile", lambda: comp_t(x))
    base = dict(kernels.CONFIG)
    configs = [
        dict(amax_block_k=128, amax_block_m=32, amax_chunk_m=512, amax_warps=4),
        dict(amax_block_k=64, amax_block_m=256, amax_chunk_m=256, amax_warps=8),
        dict(amax_block_k=128, amax_block_m=128, amax_chunk_m=128, amax_warps=8),
        dict(amax_block_k=128, amax_block_m=64, amax_chunk_m=512, amax_warps=4),
        dict(amax_block_k=256, amax_block_m=64, amax_chunk_m=256, amax_warps=8),
        dict(cast_block_m=128, cast_block_k=64, cast_warps=8),
        dict(cast_block_m=64, cast_block_k=128, cast_warps=8),
        dict(cast_block_m=128, cast_block_k=128, cast_warps=8),
    ]
    for c in configs:
        kernels.CONFIG.update(base)
        kernels.CONFIG.update(c)
        row(f"fused kernel {c}", lambda: quantize_dim0_t(x, f8))
    kernels.CONFIG.update(base)
    amax = torch.zeros(K, device="cuda")
    print()
    for c in configs[:5]:
        def only_amax(c=c):
            amax.zero_()
            grid = (triton.cdiv(K, c["amax_block_k"]), triton.cdiv(M, c["amax_chunk_m"]))
            kernels._col_amax_kernel[grid](x, amax, M, K, x.stride(0), CHUNK_M=c["amax_chunk_m"],
                                           BLOCK_M=c["amax_block_m"], BLOCK_K=c["amax_block_k"],
                                           num_warps=c["amax_warps"])
        ms = bench_ms(only_amax)
        print(f"| amax only {c} | {ms * 1e3:.1f} | {M * K * 2 / (ms * 1e-3) / 1e9:.0f} |")
    comp_amax = torch.compile(lambda t: t.abs().amax(0))
    ms = bench_ms(lambda: comp_amax(x))
    print(f"| amax only, torch.compile abs().amax(0) | {ms * 1e3:.1f} | {M * K * 2 / (ms * 1e-3) / 1e9:.0f} |")

    # Row-wise (last dim) in eager: what FSDP2's pre-all-gather and from_hp run on each weight shard.
    from fp8tensor.quantize import cast_to_fp8, rowwise_scale

    print("\n| row-wise (dim -1), eager | shape | dtype | µs | GB/s |\n|---|---|---|---|---|")
    for shape, dtype in (((16384, 4096), torch.bfloat16), ((14336, 4096), torch.float32),
                         ((4096, 14336), torch.float32), ((1024, 4096), torch.float32)):
        w = torch.randn(*shape, device="cuda", dtype=dtype)
        nb = w.numel() * (w.element_size() + 1) + shape[0] * 4

        def eager_ops(w=w):
            s = rowwise_scale(w, -1, f8)
            return cast_to_fp8(w, s, f8), s

        for name, fn in (("eager ops", eager_ops), ("fused Triton kernel", lambda w=w: kernels.quantize_last_dim(w, f8, SCALE_FLOOR))):
            ms = bench_ms(fn)
            print(f"| {name} | {shape[0]}×{shape[1]} | {str(dtype)[6:]} | {ms * 1e3:.1f} | {nb / (ms * 1e-3) / 1e9:.0f} |")


if __name__ == "__main__":
    import triton  # noqa: F401

    main()
