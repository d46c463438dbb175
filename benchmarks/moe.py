"""MoE experts forward+backward: bf16 ``torch._grouped_mm`` vs fp8tensor's fp8 grouped GEMMs vs torchao's prototype.

One step = the routed-experts computation of one MoE layer on one rank (tokens already dispatched and sorted by
expert): ``h = silu(x @ w1[e]^T) * (x @ w3[e]^T)``, ``y = h @ w2[e]^T`` per expert group through
``torch._grouped_mm``, then backward with a fixed ``grad_output`` (grads for ``x`` and the three weights). Shapes:

* ``deepseek``: DeepSeek-V3-like local shapes: dim 7168, expert hidden 2048, 8 local experts, 16384 routed rows;
* ``qwen3``: Qwen3-30B-A3B-like: dim 2048, expert hidden 768, 128 experts, top-8 of 8192 tokens = 65536 routed rows.

Group sizes are drawn uneven (a Dirichlet(1) split: some experts far above the mean; the last one gets 0 tokens) and
rounded to multiples of 16 (torchao's grouped GEMM needs that alignment; fp8tensor pads inside the op, measured in
the extra row ``fp8tensor rowwise (unaligned)`` with the unrounded sizes). Variants: ``bf16`` (bf16 weights,
``torch._grouped_mm``), ``fp8tensor rowwise`` / ``rowwise_gw_hp`` (bf16 :class:`~fp8tensor.Fp8MasterWeight`
weights: the same call dispatches to :func:`fp8tensor.grouped.fp8_grouped_mm`), ``fp8tensor rowwise (fp8 weights)``
(the weights as FSDP2's fp8 all-gather hands them to the experts: row-wise fp8 ``GatheredExperts``, quantized
once outside the timed step as the all-gather does before it; grad_input folds their row scales into
``grad_output``), ``fp8tensor rowwise (converted module)`` (the step under
:class:`~fp8tensor.grouped.Fp8GroupedMMMode`, as a converted experts module runs its forward: w1 and w3 share the
tokens' quantization), ``fp8tensor rowwise, slow grouped backward`` (``Recipe.grouped_fast_accum=False``: the backward
GEMMs accumulate slowly, as the Linear's), ``torchao fp8 rowwise``
(``torchao.prototype.moe_training``'s ``_to_fp8_rowwise_then_scaled_grouped_mm``, when importable). Median times
from ``triton.testing.do_bench``. Prints a markdown table; ``--out`` writes the rows as JSON.

Usage: ``PYTHONPATH=. python benchmarks/moe.py [--shapes deepseek,qwen3] [--out moe.json] [--profile]``;
``--raw-gemms``: ``torch._scaled_grouped_mm`` alone, fast and slow accumulation, against bf16 ``_grouped_mm``;
``--quant``: the quantizations of one step's backward operands alone: the per-group column quantization of the
grad_weight GEMMs' tokens and gradients in both forms of the kernel (one launch; split over chunks of each group's
rows) and the one the package picks, against a copy (GB/s as read once and written once in fp8); the grad_input
GEMMs' expert weights re-cast per row with the forward's scales, against the per-column re-quantization of before
and a stored fp8 weight's transpose.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import bench_ms, env_line, top_kernels  # noqa: E402

import fp8tensor  # noqa: E402
from fp8tensor import Fp8MasterWeight  # noqa: E402
from fp8tensor.training.grouped import Fp8GroupedMMMode  # noqa: E402
from fp8tensor.training.master import GatheredExperts  # noqa: E402

SHAPES = {
    "deepseek": dict(dim=7168, hidden=2048, experts=8, rows=16384),
    "qwen3": dict(dim=2048, hidden=768, experts=128, rows=65536),
}


def group_sizes(rows: int, experts: int, align: int, seed: int = 0) -> list:
    """Uneven group sizes summing to ``rows`` (multiples of ``align``; the last expert gets 0 tokens)."""
    g = torch.Generator().manual_seed(seed)
    w = -torch.rand(experts, generator=g).log()  # exponential(1): Dirichlet(1) after normalizing
    w[-1] = 0.0
    sizes = (w / w.sum() * rows / align).floor().long() * align
    sizes[0] += rows - int(sizes.sum())  # the remainder (a multiple of align when rows is) to the first expert
    return sizes.tolist()


def torchao_gmm():
    """torchao's fp8 row-wise grouped GEMM, or None."""
    for mod in ("torchao.prototype.moe_training.scaled_grouped_mm", "torchao.prototype.moe_training"):
        try:
            m = __import__(mod, fromlist=["_to_fp8_rowwise_then_scaled_grouped_mm"])
            fn = getattr(m, "_to_fp8_rowwise_then_scaled_grouped_mm")
            return lambda a, b, offs: fn(a, b, offs=offs, out_dtype=torch.bfloat16)
        except Exception as e:  # missing or incompatible
            err = e
    print(f"(torchao prototype not available: {type(err).__name__}: {str(err)[:120]})")
    return None


def experts_step(x, ws, offs, gy, gmm, mode=None):
    def step():
        w1, w2, w3 = ws
        with mode(share_inputs=True) if mode is not None else contextlib.nullcontext():
            h = F.silu(gmm(x, w1.transpose(-2, -1), offs)) * gmm(x, w3.transpose(-2, -1), offs)
            y = gmm(h, w2.transpose(-2, -1), offs)
        y.backward(gy)
        for t in (x, *ws):
            t.grad = None

    return step


def torch_gmm(a, b, offs):
    return torch._grouped_mm(a, b, offs=offs)


#: ``rowwise`` with the grouped GEMMs' backward accumulating as the Linear's does (slow): the A/B of
#: ``Recipe.grouped_fast_accum``.
SLOW_BACKWARD = fp8tensor.RECIPES["rowwise"].replace(grouped_fast_accum=False)


def raw_gemms(dev, shapes) -> list:
    """``torch._scaled_grouped_mm`` alone (fp8 operands and scales made outside the timing; fast and slow accumulation;
    medians of ``triton.testing.do_bench``)
    against bf16 ``torch._grouped_mm`` at each shape's GEMMs: the forward / grad_input products (2-D x 3-D) and the
    grad_weight ones (2-D x 2-D over the padded token layout)."""
    from triton.testing import do_bench

    from fp8tensor.training.grouped import padded_offsets

    f8, out = torch.float8_e4m3fn, []
    for name in shapes:
        cfg = SHAPES[name]
        E, D, H, M = cfg["experts"], cfg["dim"], cfg["hidden"], cfg["rows"]
        offs = torch.cumsum(torch.tensor(group_sizes(M, E, 16), device=dev), 0).to(torch.int32)
        M_pad, pends, _ = padded_offsets(offs, M)
        cases = []
        # (the last two of each kind: w1 and w3 as one GEMM, [w1; w3] of 2H rows: the forward's x @ [w1; w3]^T,
        # grad_input's [g1, g3] @ [w1; w3] without the add of two products, grad_weight's [g1, g3]^T @ x)
        for what, K, N in (("x @ w1^T", D, H), ("h @ w2^T", H, D), ("x @ [w1; w3]^T", D, 2 * H),
                           ("[g1, g3] @ [w1; w3]", 2 * H, D)):
            a = torch.randn(M, K, device=dev).bfloat16()
            b = torch.randn(E, N, K, device=dev).bfloat16().transpose(-2, -1)
            bq = b.transpose(-2, -1).contiguous().to(f8).transpose(-2, -1)
            sa, sb = torch.rand(M, device=dev) + 0.5, torch.rand(E, N, device=dev) + 0.5
            cases.append((f"2d x 3d {what}", M * K * N, lambda a=a, b=b: torch._grouped_mm(a, b, offs=offs),
                          lambda fast, a=a.to(f8), b=bq, sa=sa, sb=sb: torch._scaled_grouped_mm(
                              a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=fast)))
        for what, N, K in (("gy_h^T @ x", H, D), ("gy^T @ h", D, H), ("[g1, g3]^T @ x", 2 * H, D)):
            gy, x = torch.randn(M, N, device=dev).bfloat16(), torch.randn(M, K, device=dev).bfloat16()
            gq, xq = torch.randn(N, M_pad, device=dev).to(f8), torch.randn(K, M_pad, device=dev).to(f8)
            s1, s2 = torch.rand(E * N, device=dev) + 0.5, torch.rand(E * K, device=dev) + 0.5
            cases.append((f"2d x 2d {what}", M * K * N, lambda gy=gy, x=x: torch._grouped_mm(gy.t(), x, offs=offs),
                          lambda fast, gq=gq, xq=xq, s1=s1, s2=s2: torch._scaled_grouped_mm(
                              gq, xq.t(), s1, s2, offs=pends, out_dtype=torch.bfloat16, use_fast_accum=fast)))
        for what, mnk, bf, f8mm in cases:
            t_bf = do_bench(bf, warmup=20, rep=200, return_mode="median")
            t_fast = do_bench(lambda: f8mm(True), warmup=20, rep=200, return_mode="median")
            t_slow = do_bench(lambda: f8mm(False), warmup=20, rep=200, return_mode="median")
            out.append(dict(shape=name, gemm=what, bf16_us=round(t_bf * 1e3, 1), fast_us=round(t_fast * 1e3, 1),
                            slow_us=round(t_slow * 1e3, 1), tflops_fast=round(2 * mnk / t_fast / 1e9, 1)))
        # what grad_input's two products of x cost to add up (autograd's accumulation; one GEMM of [w1; w3] has none)
        u, v = torch.randn(M, D, device=dev).bfloat16(), torch.randn(M, D, device=dev).bfloat16()
        t_add = do_bench(lambda: u + v, warmup=20, rep=200, return_mode="median")
        out.append(dict(shape=name, gemm=f"grad_x add ({M} x {D} bf16)", bf16_us=round(t_add * 1e3, 1),
                        fast_us=None, slow_us=None, tflops_fast=None))
    return out


def _graph_us(fn, reps=10, rounds=9):
    """Median µs per call of ``fn`` over ``rounds`` CUDA-graph replays of ``reps`` calls (CUDA events)."""
    fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    ts = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / reps)
    return sorted(ts)[len(ts) // 2]


def column_quant(dev, shapes: list) -> tuple:
    """The quantizations of one step's backward operands alone, CUDA-graph replays, medians:

    * tokens: µs of :func:`fp8tensor.grouped.quantize_group_cols` per operand in the kernel's one-launch form, its
      split form (forced: at least 2 chunks per group) and the form the package picks (the split where
      ``kernels.group_col_chunks`` gives more than one chunk), beside the same operand's row-wise quantization (the
      forward's, :func:`~fp8tensor.numerics.quantize.quantize` over the last dim);
    * expert weights (grad_input's operand): µs of the per-column re-quantization
      (:func:`~fp8tensor.grouped.quantize_expert_cols`, the package's form), of the row re-cast with the
      forward's scales the backward runs (``cast_rows_t_after``) and of a stored fp8 weight's transpose.

    Returns ``(token rows, weight rows)``."""
    from fp8tensor.grouped import padded_offsets, quantize_expert_cols, quantize_group_cols
    from fp8tensor.numerics import kernels
    from fp8tensor.numerics.quantize import cast_rows_t_after, quantize, transpose_after

    table, toks, wts = kernels.GROUP_COL_CONFIG, [], []
    for name in shapes:
        cfg = SHAPES[name]
        E, D, H, M = cfg["experts"], cfg["dim"], cfg["hidden"], cfg["rows"]
        offs = torch.cumsum(torch.tensor(group_sizes(M, E, 16), device=dev), 0).to(torch.int32)
        M_pad, _, pad_starts = padded_offsets(offs, M)
        for C in (D, H):
            t = torch.randn(M, C, device=dev).bfloat16()
            row = dict(shape=name, operand=f"tokens ({M} x {C}, {E} groups)", copy_us=round(_graph_us(t.clone), 1))
            for form in ("one_kernel", "split", "auto"):
                kernels.GROUP_COL_CONFIG = kernels._frozen({**table, "mode": form})
                try:
                    row[f"{form}_chunks"] = kernels.group_col_chunks(M, E)
                    row[f"{form}_us"] = round(_graph_us(lambda: quantize_group_cols(t, offs, M_pad, pad_starts)), 1)
                finally:
                    kernels.GROUP_COL_CONFIG = table
            row["row_us"] = round(_graph_us(lambda: quantize(t, -1)), 1)  # (the forward's row-wise quantization)
            row["gbs"] = round(3 * t.numel() / row["auto_us"] / 1e3)
            row["copy_gbs"] = round(4 * t.numel() / row["copy_us"] / 1e3)
            toks.append(row)
        for N, K in ((H, D), (D, H)):
            w = torch.randn(E, N, K, device=dev).bfloat16()
            q, s = quantize(w, -1)
            s = s.reshape(E, N)
            row = dict(shape=name, operand=f"expert weights ({E} x {N} x {K})",
                       cols_us=round(_graph_us(lambda: quantize_expert_cols(w)), 1),
                       recast_us=round(_graph_us(lambda: cast_rows_t_after(w, s, w)), 1),
                       transpose_us=round(_graph_us(lambda: transpose_after(q, w)), 1))
            row["recast_gbs"] = round(3 * w.numel() / row["recast_us"] / 1e3)
            wts.append(row)
    return toks, wts


def weights(cfg, dev, master_recipe=None, seed=0, gathered_fp8=False):
    g = torch.Generator(device=dev).manual_seed(seed)
    E, D, H = cfg["experts"], cfg["dim"], cfg["hidden"]
    shapes = ((E, H, D), (E, D, H), (E, H, D))
    out = []
    for s in shapes:
        t = (torch.randn(s, device=dev, generator=g) * s[-1] ** -0.5).bfloat16()
        if gathered_fp8:  # (what FSDP2's fp8 all-gather of a master of this recipe gives the experts)
            t = GatheredExperts.of(fp8tensor.ScaledFp8Tensor.from_hp(t), master_recipe)
        elif master_recipe is not None:
            t = Fp8MasterWeight(t, master_recipe)
        out.append(torch.nn.Parameter(t))
    return out


def run_shape(name: str, cfg: dict, dev, ao, profile: bool) -> list:
    rows = cfg["rows"]
    offs_al = torch.cumsum(torch.tensor(group_sizes(rows, cfg["experts"], 16), device=dev), 0).to(torch.int32)
    offs_un = torch.cumsum(torch.tensor(group_sizes(rows, cfg["experts"], 1, seed=1), device=dev), 0).to(torch.int32)
    x = (torch.randn(rows, cfg["dim"], device=dev)).bfloat16().requires_grad_()
    gy = torch.randn(rows, cfg["dim"], device=dev).bfloat16()
    variants = {
        "bf16": (weights(cfg, dev), torch_gmm, offs_al),
        "fp8tensor rowwise": (weights(cfg, dev, "rowwise"), torch_gmm, offs_al),
        "fp8tensor rowwise_gw_hp": (weights(cfg, dev, "rowwise_gw_hp"), torch_gmm, offs_al),
        "fp8tensor rowwise (unaligned)": (weights(cfg, dev, "rowwise"), torch_gmm, offs_un),
        "fp8tensor rowwise (fp8 weights)": (weights(cfg, dev, "rowwise", gathered_fp8=True), torch_gmm, offs_al),
        "fp8tensor rowwise, slow grouped backward": (weights(cfg, dev, SLOW_BACKWARD), torch_gmm, offs_al),
        "fp8tensor rowwise (converted module)": (weights(cfg, dev, "rowwise"), torch_gmm, offs_al, Fp8GroupedMMMode),
    }
    if ao is not None:
        variants["torchao fp8 rowwise"] = (weights(cfg, dev), ao, offs_al)
    flops = 3 * 2 * 3 * rows * cfg["dim"] * cfg["hidden"]  # 3 GEMMs forward, 2x that backward
    out, base = [], None
    for vname, (ws, gmm, offs, *mode) in variants.items():
        step = experts_step(x, ws, offs, gy, gmm, *mode)
        try:
            step()
            ms = bench_ms(step)
        except Exception as e:  # a peer that does not take these shapes
            print(f"{name} {vname}: {type(e).__name__}: {str(e)[:200]}")
            continue
        if vname == "bf16":
            base = ms
        row = dict(shape=name, variant=vname, ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
                   speedup=round(base / ms, 3) if base else None, **cfg)
        out.append(row)
        if profile and vname in ("fp8tensor rowwise", "fp8tensor rowwise (converted module)"):
            print(top_kernels(step))
        del step
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="deepseek,qwen3", help="comma-separated: " + ", ".join(SHAPES))
    p.add_argument("--out", default=None, help="write the rows as JSON to this path")
    p.add_argument("--profile", action="store_true", help="print the top kernels of fp8tensor rowwise per shape")
    p.add_argument("--no-peers", action="store_true", help="skip torchao")
    p.add_argument("--raw-gemms", action="store_true",
                   help="time torch._scaled_grouped_mm alone (fast / slow accumulation) against bf16 _grouped_mm")
    p.add_argument("--quant", action="store_true",
                   help="time the per-group column quantizations of one step's operands (both kernel forms)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/moe.py: needs a CUDA GPU (torch._scaled_grouped_mm)")
    dev = torch.device("cuda")
    if args.raw_gemms:
        raw = raw_gemms(dev, args.shapes.split(","))
        print(f"\n# raw grouped GEMMs · {env_line()}\n")
        print("| shape | GEMM | bf16 µs | fp8 fast µs | fp8 slow µs | fast vs bf16 | slow vs fast |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for r in raw:
            ratio = (lambda a, b: f"{a / b:.2f}x" if a and b else "—")
            print(f"| {r['shape']} | {r['gemm']} | {r['bf16_us']} | {r['fast_us'] or '—'} | {r['slow_us'] or '—'} | "
                  f"{ratio(r['bf16_us'], r['fast_us'])} | {ratio(r['slow_us'], r['fast_us'])} |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(env=env_line(), fp8tensor=fp8tensor.__version__, raw=raw), f, indent=1)
        return
    if args.quant:
        toks, wts = column_quant(dev, args.shapes.split(","))
        print(f"\n# per-group column quantization of the tokens · {env_line()}\n")
        print("| shape | operand | copy µs (GB/s) | one launch µs | split µs (chunks) | package µs (chunks) | "
              "GB/s | one launch / package | row-wise µs |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in toks:
            print(f"| {r['shape']} | {r['operand']} | {r['copy_us']} ({r['copy_gbs']}) | {r['one_kernel_us']} | "
                  f"{r['split_us']} ({r['split_chunks']}) | {r['auto_us']} ({r['auto_chunks']}) | {r['gbs']} | "
                  f"{r['one_kernel_us'] / r['auto_us']:.2f}x | {r['row_us']} |")
        print(f"\n# grad_input's expert weights · {env_line()}\n")
        print("| shape | operand | per-column re-quantization µs | row re-cast µs (GB/s) | fp8 transpose µs |")
        print("|---|---|---:|---:|---:|")
        for r in wts:
            print(f"| {r['shape']} | {r['operand']} | {r['cols_us']} | {r['recast_us']} ({r['recast_gbs']}) | "
                  f"{r['transpose_us']} |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(env=env_line(), fp8tensor=fp8tensor.__version__, tokens=toks, weights=wts), f,
                          indent=1)
        return
    ao = None if args.no_peers else torchao_gmm()
    rows = []
    for name in args.shapes.split(","):
        rows += run_shape(name, SHAPES[name], dev, ao, args.profile)
    print(f"\n# moe experts fwd+bwd · {env_line()}\n")
    print("| shape | variant | ms | TFLOP/s | speedup vs bf16 |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['variant']} | {r['ms']:.3f} | {r['tflops']} | {r['speedup']}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(env=env_line(), fp8tensor=fp8tensor.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
