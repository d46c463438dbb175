"""Tile sweep of the decode GEMM (``fp8tensor::w8_mm``: bf16 activations x fp8 weight read once) and its host cost.

For each row block of the kernel (``BLOCK_M`` 16 / 32, measured at M = 8 / 32 tokens; and 64 at 64 tokens, past
``max_m``, to see whether any tile beats cuBLAS there) the sweep times the
kernel (one layer's GEMMs captured as one CUDA graph, as compiled serving runs them; ``triton.testing.do_bench``
medians of its replay, the L2 cache flushed between replays) on the Linear shapes of a Llama3-8B
layer (qkv 6144x4096, wo 4096x4096, w1 / w3 14336x4096, w2 4096x14336), first over weight tiles and warps, then over
pipeline stages and the K split of the three best, and prints the best tiles (the form of
``fp8tensor.numerics.kernels.W8_MM_CONFIG["tiles"]``) with their weight bandwidth against bf16's ``torch.mm`` and the
fp8 x fp8 row-scaled ``torch._scaled_mm`` on the same shapes. ``--host``: µs per eager call (small shapes, so the host
is what is timed) of ``F.linear`` in bf16, of the kernel's launch, and of an ``nn.Linear`` before and after
``fp8tensor.quantize_weights``.

    PYTHONPATH=. python3 benchmarks/w8_tune.py [--quick] [--host]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fp8tensor  # noqa: E402
from fp8tensor.numerics import kernels  # noqa: E402
from fp8tensor.quantize import quantize_rowwise  # noqa: E402

SHAPES = [(6144, 4096), (4096, 4096), (14336, 4096), (4096, 14336)]  # (N, K) of one Llama3-8B layer (w1, w3 alike)
COUNT = [1, 1, 2, 1]
BUCKETS = {16: 8, 32: 32, 64: 64}  # row block -> tokens measured (a block past max_m: starts from the largest tiles)


def bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=5, rep=25, return_mode="median"))


def graphed(fn) -> float:
    """ms of ``fn`` (one layer's GEMMs) replayed as one CUDA graph, as compiled serving (reduce-overhead) runs it."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return bench(g.replay)


def run_tiles(bm: int, tiles: dict, xs, ws) -> float:
    """Time (ms) of one layer's GEMMs with ``tiles`` for row block ``bm``; inf where the tiles do not compile."""
    saved = kernels.W8_MM_CONFIG["tiles"].get(bm)
    kernels.W8_MM_CONFIG["tiles"][bm] = tiles
    kernels._W8_PLANS.clear()
    try:
        def layer():
            for x, (w8, s), n in zip(xs, ws, COUNT):
                for _ in range(n):
                    kernels.launch_w8_mm(x, w8, s, None)
        return graphed(layer)
    except Exception as e:  # (tiles past the shared memory / registers of the GPU)
        print(f"  skip {tiles}: {type(e).__name__}", flush=True)
        return float("inf")
    finally:
        if saved is None:
            del kernels.W8_MM_CONFIG["tiles"][bm]
        else:
            kernels.W8_MM_CONFIG["tiles"][bm] = saved
        kernels._W8_PLANS.clear()


def sweep(quick: bool) -> None:
    torch.manual_seed(0)
    ws = [quantize_rowwise(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), dim=-1) for n, k in SHAPES]
    ws = [(q.contiguous(), s.float().reshape(-1, 1).contiguous()) for q, s in ws]
    weight_bytes = sum(n * k * c for (n, k), c in zip(SHAPES, COUNT))
    best_all = {}
    for bm, M in BUCKETS.items():
        xs = [torch.randn(M, k, device="cuda", dtype=torch.bfloat16) for _, k in SHAPES]
        tiles = kernels.W8_MM_CONFIG["tiles"]
        base = dict(tiles.get(bm) or tiles[max(tiles)])
        res = []
        first = itertools.product([32, 64, 128], [128, 256] if quick else [128, 256, 512], [4, 8], [False, True])
        for bn, bk, warps, n_major in first:
            t = dict(base, block_n=bn, block_k=bk, warps=warps, n_major=n_major)
            res.append((run_tiles(bm, t, xs, ws), t))
        res.sort(key=lambda r: r[0])
        second = []
        for _, t0 in res[:2 if quick else 3]:
            for stages, pps in itertools.product([3, 4, 6], [1, 2, 4, 8]):
                t = dict(t0, stages=stages, programs_per_sm=pps)
                second.append((run_tiles(bm, t, xs, ws), t))
        res = sorted(res + second, key=lambda r: r[0])
        now = run_tiles(bm, base, xs, ws)
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for n, k in SHAPES]
        mm = graphed(lambda: [x @ w.t() for x, w, c in zip(xs, wb, COUNT) for _ in range(c)])
        xq = [quantize_rowwise(x, dim=-1) for x in xs]
        smm = graphed(lambda: [torch._scaled_mm(q, w8.t(), scale_a=sx.float().reshape(-1, 1), scale_b=s.reshape(1, -1),
                                                out_dtype=torch.bfloat16)
                               for (q, sx), (w8, s), c in zip(xq, ws, COUNT) for _ in range(c)])
        best_t, best = res[0]
        print(f"| BLOCK_M {bm} (M={M}) | now {now * 1e3:.1f} us | best {best_t * 1e3:.1f} us "
              f"({weight_bytes / best_t / 1e6:.0f} GB/s) | bf16 mm {mm * 1e3:.1f} us | fp8 _scaled_mm {smm * 1e3:.1f} us "
              f"| speed-up vs bf16 {mm / best_t:.2f}x |", flush=True)
        for t, tiles in res[:5]:
            print(f"    {t * 1e3:8.1f} us  {tiles}", flush=True)
        best_all[bm] = best
    print("tiles=" + repr(best_all), flush=True)


def host() -> None:
    torch.manual_seed(0)
    n = 2000

    def per_call(fn) -> float:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e6

    lin = torch.nn.Linear(256, 256, bias=False, device="cuda", dtype=torch.bfloat16)
    q = fp8tensor.quantize_weights(torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False, device="cuda",
                                                                       dtype=torch.bfloat16)))[0]
    x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    w8, s = q.weight.qdata, q.weight.scale
    with torch.no_grad():
        rows = {"F.linear bf16": per_call(lambda: torch.nn.functional.linear(x, lin.weight)),
                "launch_w8_mm": per_call(lambda: kernels.launch_w8_mm(x, w8, s, None)),
                "nn.Linear bf16": per_call(lambda: lin(x)),
                "nn.Linear after quantize_weights": per_call(lambda: q(x))}
    for k, v in rows.items():
        print(f"| host {k} | {v:.1f} us/call |", flush=True)
    print("launcher cache entries:", {f.__name__ if hasattr(f, "__name__") else str(f): len(l.cache)
                                      for f, l in kernels._LAUNCHERS.items()}, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer tiles")
    ap.add_argument("--host", action="store_true", help="also the host cost per eager call")
    ap.add_argument("--no-sweep", action="store_true")
    a = ap.parse_args()
    if a.host:
        host()
    if not a.no_sweep:
        sweep(a.quick)


if __name__ == "__main__":
    main()
