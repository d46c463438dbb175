"""Tile sweep of the dim-0 quantization kernels (``fp8tensor.kernels``: column amax, then cast + transpose) on the
shapes the e2e models run, weighted by how often a training step runs each shape.

The amax is a max (order-free) and the cast reads the same amax, so every tile config gives the same bits; only the
time changes. Each config is timed with ``triton.testing.do_bench`` (L2 flushed between runs, median), the amax
kernel together with the zeroing of its output as a step runs it.

Usage (one GPU): ``PYTHONPATH=. python benchmarks/dim0_sweep.py [--model 2048|4096|readme] [--top 8]``.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import env_line  # noqa: E402

from fp8tensor import kernels  # noqa: E402
from fp8tensor.quantize import SCALE_FLOOR  # noqa: E402

#: (M, K) of each dim-0 quantization per layer and how many times a step runs it per layer: the Linears' inputs
#: (shared by q/k/v and w1/w3), their output gradients, and (bf16 parameters, no FSDP2) the weights for grad_input
#: (W1 / W3 of the dim-2048 model have the inputs' shape, 8192×2048).
SHAPES = {
    "2048": {(8192, 2048): 8, (8192, 8192): 3, (8192, 1024): 2, (2048, 2048): 2, (1024, 2048): 2,
             (2048, 8192): 1},
    "4096": {(8192, 4096): 6, (8192, 14336): 3, (8192, 1024): 2, (4096, 4096): 2, (1024, 4096): 2,
             (14336, 4096): 2, (4096, 14336): 1},
    "readme": {(16384, 1024): 6, (16384, 2752): 3, (16384, 256): 2, (1024, 1024): 2, (256, 1024): 2,
               (2752, 1024): 2, (1024, 2752): 1},
}


def main(argv=None) -> None:
    import triton
    from triton.testing import do_bench

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="2048", choices=sorted(SHAPES))
    p.add_argument("--top", type=int, default=8)
    a = p.parse_args(argv)
    shapes = {s: n for s, n in SHAPES[a.model].items() if n}
    f8 = torch.float8_e4m3fn
    fmax = torch.finfo(f8).max
    xs = {s: torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in shapes}
    print(f"# dim-0 kernel tile sweep, model {a.model}; {env_line()}\n")

    def t_us(fn) -> float:
        return float(do_bench(fn, warmup=5, rep=25, return_mode="median")) * 1e3

    def amax_fn(x, c):
        M, K = x.shape
        amax = torch.zeros(K, device="cuda")
        grid = (triton.cdiv(K, c["amax_block_k"]), triton.cdiv(M, c["amax_chunk_m"]))

        def run():
            amax.zero_()
            kernels._col_amax_kernel[grid](x, amax, M, K, x.stride(0), CHUNK_M=c["amax_chunk_m"],
                                           BLOCK_M=c["amax_block_m"], BLOCK_K=c["amax_block_k"],
                                           num_warps=c["amax_warps"])
        return run, amax

    def cast_fn(x, c, amax):
        M, K = x.shape
        q = torch.empty(K, M, dtype=f8, device="cuda")
        scale = torch.empty(K, 1, device="cuda")
        grid = (triton.cdiv(M, c["cast_block_m"]), triton.cdiv(K, c["cast_block_k"]))

        def run():
            kernels._cast_t_kernel[grid](x, amax, q, scale, M, K, x.stride(0), FMAX=fmax, EPS=SCALE_FLOOR,
                                         BLOCK_M=c["cast_block_m"], BLOCK_K=c["cast_block_k"], N_AMAX=1,
                                         num_warps=c["cast_warps"])
        return run, q, scale

    # reference bits: the current CONFIG
    ref = {}
    for s, x in xs.items():
        run, amax = amax_fn(x, kernels.CONFIG)
        run()
        crun, q, sc = cast_fn(x, kernels.CONFIG, amax)
        crun()
        ref[s] = (amax.clone(), q.view(torch.uint8).clone(), sc.clone())

    def weighted(times):
        return sum(times[s] * n for s, n in shapes.items())

    def sweep(name, cfgs, bench):
        """Time ``bench(config, shape, x)`` (which also checks the bits) for every config; print the best and the
        current config, weighted per layer."""
        rows = []
        for c in cfgs:
            times = {s: bench(c, s, x) for s, x in xs.items()}
            rows.append((weighted(times), c, times))
        rows.sort(key=lambda r: r[0])
        cur = next(r for r in rows if all(r[1][k] == kernels.CONFIG[k] for k in r[1]))
        print(f"\n| {name} config | µs per layer (weighted) | " + " | ".join(f"{m}×{k}" for m, k in shapes) + " |")
        print("|---|---|" + "---|" * len(shapes))
        for w, c, times in rows[: a.top] + [(cur[0], {**cur[1], "current": True}, cur[2])]:
            print(f"| {c} | {w:.1f} | " + " | ".join(f"{times[s]:.1f}" for s in shapes) + " |")

    def bench_amax(c, s, x):
        run, amax = amax_fn(x, c)
        run()
        if not torch.equal(amax, ref[s][0]):
            raise AssertionError(f"amax differs for {c} at {s}")
        return t_us(run)

    def bench_cast(c, s, x):
        crun, q, sc = cast_fn(x, c, ref[s][0])
        crun()
        if not (torch.equal(q.view(torch.uint8), ref[s][1]) and torch.equal(sc, ref[s][2])):
            raise AssertionError(f"cast differs for {c} at {s}")
        return t_us(crun)

    sweep("amax", [dict(amax_block_k=bk, amax_block_m=bm, amax_chunk_m=bm * r, amax_warps=w)
                   for bk, bm, r, w in itertools.product((32, 64, 128), (32, 64, 128, 256), (1, 2, 4, 8), (4, 8))
                   if bm * r <= 1024], bench_amax)
    sweep("cast", [dict(cast_block_m=bm, cast_block_k=bk, cast_warps=w)
                   for bm, bk, w in itertools.product((32, 64, 128), (64, 128, 256), (4, 8))], bench_cast)


if __name__ == "__main__":
    main()
