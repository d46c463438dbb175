"""Cost of quantizing ``grad_out`` for both gradient GEMMs: the separate passes vs the fused pair of kernels.

Shapes of the end-to-end step at dim 2048 (8192 tokens; ``grad_out`` of the attention/w2 projections, of w1/w3 and
of fused projections: N in 2048, 5632, 6144), bf16. Sections (markdown tables):

1. ``grad_out`` quantization, µs (``triton.testing.do_bench`` median) and bit-identity of every output:
   * separate: the row-wise kernel (``quantize(g, -1)``) + the dim-0 kernels (``quantize_tokens(g)``: column amax,
     transposed cast) — 3 reads of ``g``, 3 launches (+ the amax buffer's memset);
   * fused: ``quantize_rows_and_tokens(g)`` — 2 reads, 2 launches;
   * the same with an fp8 weight's row scales folded in (``g.float() * s`` then row-wise, as the eager backward of an
     FSDP2-gathered fp8 weight does) vs ``col_mul=s``.
2. A sweep of the fused first kernel's tiles (``kernels.ROWS_DIM0_CONFIG``); bits must not change.
3. One eager fp8 Linear forward + backward at M = 8192 (``fp8tensor.config``'s ``fused_grad_out``: ``"never"`` /
   ``"eager"``), gradients bit-compared between off and on.

Usage: ``PYTHONPATH=. python benchmarks/quant_cost.py [--no-sweep] [--no-linear]``.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import bench_ms, env_line  # noqa: E402

import fp8tensor  # noqa: E402
from fp8tensor import kernels  # noqa: E402
from fp8tensor.quantize import E4M3, quantize, quantize_rows_and_tokens, quantize_tokens  # noqa: E402

M = 8192
NS = (2048, 5632, 6144)


def _same(a, b) -> bool:
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and torch.equal(a, b)


def separate(g, s=None):
    gr = g if s is None else g.float() * s.reshape(1, -1)
    a = quantize(gr, -1, E4M3, gemm_layout=True)
    t = quantize_tokens(g, E4M3)
    return a, t


def fused(g, s=None):
    return quantize_rows_and_tokens(g, E4M3, col_mul=None if s is None else s.reshape(-1))


def check(g, s=None) -> bool:
    (a0, sa0), (t0, st0) = separate(g, s)
    (a1, sa1), (t1, st1) = fused(g, s)
    return all(_same(x, y) for x, y in ((a0, a1), (sa0, sa1), (t0, t1), (st0, st1))) and t1.stride() == t0.stride()


def section_quant() -> None:
    print("| N | folded scales | separate µs | fused µs | speed-up | GB/s fused (2 reads + writes) | same bits |")
    print("|---|---|---|---|---|---|---|")
    for N in NS:
        g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        g[0, 0] = 0.0
        s = (torch.rand(N, 1, device="cuda") + 0.5) / 448
        for fold in (False, True):
            ss = s if fold else None
            t0 = bench_ms(lambda: separate(g, ss)) * 1e3
            t1 = bench_ms(lambda: fused(g, ss)) * 1e3
            nbytes = 2 * M * N * 2 + 2 * M * N + 4 * (M + N)
            print(f"| {N} | {fold} | {t0:.1f} | {t1:.1f} | {t0 / t1:.2f}x | {nbytes / (t1 * 1e-6) / 1e9:.0f} | "
                  f"{check(g, ss)} |")


def section_sweep() -> None:
    base = dict(kernels.ROWS_DIM0_CONFIG)
    print("\n| N | block_m | block_k | warps | one_pass_elems | amax_copies | fused µs | same bits |\n"
          "|---|---|---|---|---|---|---|---|")
    for N in NS:
        g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        ref = separate(g)
        best = None
        grid = [(bm, bk, w, 0, c) for bm, bk, w, c in itertools.product((8, 16, 32, 64), (256, 512), (4, 8),
                                                                       (1, 8, 32)) if bm * bk <= 16384]
        grid += [(bm, 0, w, e, c) for bm, w, e, c in itertools.product((2, 4), (8, 16), (16384,), (1, 32))]
        for bm, bk, w, e, c in grid:
            kernels.ROWS_DIM0_CONFIG.update(block_m=bm, block_k=bk or 512, warps=w, one_pass_elems=e, amax_copies=c)
            try:
                out = fused(g)
                ok = all(_same(x, y) for x, y in zip((*ref[0], *ref[1]), (*out[0], *out[1])))
                us = bench_ms(lambda: fused(g)) * 1e3
            except Exception as err:  # a config the compiler rejects
                print(f"| {N} | {bm} | {bk} | {w} | {e} | {c} | failed: {type(err).__name__} | |")
                continue
            print(f"| {N} | {bm} | {bk} | {w} | {e} | {c} | {us:.1f} | {ok} |")
            if best is None or us < best[0]:
                best = (us, bm, bk, w, e, c)
        print(f"| {N} | best: {best[1]} | {best[2]} | {best[3]} | {best[4]} | {best[5]} | {best[0]:.1f} | |")
        kernels.ROWS_DIM0_CONFIG.clear()
        kernels.ROWS_DIM0_CONFIG.update(base)


def section_linear() -> None:
    print("\n| K→N | mode | fused off ms | fused on ms | speed-up | grads same bits |\n|---|---|---|---|---|---|")
    for K, N in ((2048, 2048), (2048, 5632), (5632, 2048), (4096, 4096)):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        gy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        lin0 = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
        for mode in ("eager",):
            res = {}
            for on in (False, True):
                # process-wide (set_config): the backward runs in autograd's device thread
                fp8tensor.set_config(fused_grad_out="eager" if on else "never")
                lin = fp8tensor.convert_to_fp8(torch.nn.Linear(K, N, bias=False, device="cuda",
                                                               dtype=torch.bfloat16))
                with torch.no_grad():
                    lin.weight._data.copy_(lin0.weight)
                torch._dynamo.reset()
                f = torch.compile(lin) if mode == "compiled" else lin
                xr = x.clone().requires_grad_()

                def step():
                    xr.grad = None
                    lin.weight.grad = None
                    f(xr).backward(gy)

                step()
                grads = (xr.grad.clone(), lin.weight.grad.clone())
                res[on] = (bench_ms(step), grads)
            fp8tensor.set_config(fused_grad_out="eager")
            same = all(torch.equal(a, b) for a, b in zip(res[False][1], res[True][1]))
            print(f"| {K}→{N} | {mode} | {res[False][0]:.3f} | {res[True][0]:.3f} | "
                  f"{res[False][0] / res[True][0]:.2f}x | {same} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-linear", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"# grad_out quantization for both gradient GEMMs, M = {M}, bf16 ({env_line()})\n")
    section_quant()
    if not args.no_sweep:
        section_sweep()
    if not args.no_linear:
        section_linear()


if __name__ == "__main__":
    main()
