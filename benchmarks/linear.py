"""Per-layer forward+backward time: bf16 vs fp8tensor recipes vs torchao float8 recipes (if importable).

Method (same as docs/benchmarks.md): ``nn.Linear(K, N, bias=False, dtype=bf16)`` converted, compiled
with ``torch.compile``; ``x`` of shape ``[M, K]`` requires grad; one step = forward + backward with a fixed
grad_output; median time (triton do_bench). Usage: ``PYTHONPATH=. python benchmarks/linear.py [--profile]
[--json PATH]``.

Two more modes (CUDA):

* ``--size-rule [--quick]``: calibrate ``convert_to_fp8(..., size_rule=True)`` for a GPU. One Linear's forward +
  backward, bf16 vs ``rowwise`` and ``rowwise_gw_hp``, eager and captured as one CUDA graph with
  ``fp8tensor.graph_step`` (no host time, as under a whole-step graph), for square, 4:1 grouped-query k/v and
  MLP-shaped Linears at M = 8192 and 16384 tokens; prints fp8 time / bf16 time next to the rule's decision and the
  smallest ``K·N/(K+N)`` above every shape where ``rowwise`` lost (a value for ``size_rule_min``).
* ``--quant``: the cost of quantizing ``grad_out`` (8192 × N, bf16) for both gradient GEMMs: the separate passes
  (row-wise kernel + column amax + transposed cast) vs the fused pair, with and without an fp8 weight's row scales
  folded in; every output bit-compared.
"""
from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.nn as nn

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import bench_ms, env_line, top_kernels  # noqa: E402

import fp8tensor  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]


def variants(peers: bool = True):
    v = {"bf16": lambda m: m}
    for r in ("rowwise", "rowwise_gw_hp"):
        v[f"fp8tensor {r}"] = lambda m, r=r: fp8tensor.convert_to_fp8(m, recipe=r)
    if not peers:
        return v
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        for r in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
            v[f"torchao {r}"] = lambda m, r=r: convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(r))
    except Exception as e:  # torchao missing or incompatible
        print(f"(torchao not available: {type(e).__name__}: {str(e)[:100]})")
    return v


def step_fn(model, x, gy):
    def step():
        y = model(x)
        y.backward(gy)

    return step


# ------------------------------------------------------------------------------------------------ --size-rule
SIZE_RULE_VARIANTS = ("bf16", "rowwise", "rowwise_gw_hp")


def _size_rule_shapes(quick: bool):
    feats = (768, 1024, 1536, 2048, 3072) if quick else (512, 768, 1024, 1536, 2048, 3072, 4096)
    out = []
    for d in feats:  # attention (square, and the k / v projections of 4:1 grouped-query attention), MLP in / out
        out += [(d, d), (d, d // 4), (d, 4 * d), (4 * d, d)]
    return out


def graphed_step_ms(K: int, N: int, M: int, variant: str) -> float:
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


def size_rule_table(quick: bool, rows: list) -> None:
    from fp8tensor.recipes import fp8_size_rule

    Ms = (8192, 16384)
    print("fp8 / bf16 time of one Linear's forward + backward (graph-captured, eager); < 1: fp8 faster\n")
    print("| K→N | K·N/(K+N) | rule | " + " | ".join(f"{v} M={m}" for m in Ms for v in SIZE_RULE_VARIANTS[1:]) + " |")
    print("|---|---|---|" + "---|" * (len(Ms) * (len(SIZE_RULE_VARIANTS) - 1)))
    wins = []
    for K, N in _size_rule_shapes(quick):
        cells, rw = {}, []
        for M in Ms:
            t = {v: graphed_step_ms(K, N, M, v) for v in SIZE_RULE_VARIANTS}
            for v in SIZE_RULE_VARIANTS[1:]:
                cells[f"{v} M={M}"] = t[v] / t["bf16"]
            rw.append(t["rowwise"] / t["bf16"])
        inten = K * N / (K + N)
        wins.append((inten, all(r < 1 for r in rw)))
        rule = "fp8" if fp8_size_rule(K, N) else "bf16"
        rows.append({"K→N": f"{K}→{N}", "K·N/(K+N)": round(inten), "rule": rule, **{k: round(v, 2) for k, v in cells.items()}})
        print(f"| {K}→{N} | {inten:.0f} | {rule} | " + " | ".join(f"{r:.2f}" for r in cells.values()) + " |", flush=True)
    losing = [i for i, w in wins if not w]
    above = [i for i, w in sorted(wins) if w and all(i > j for j in losing)]
    print(f"\nsize_rule_min now {fp8tensor.get_config().size_rule_min}; smallest K·N/(K+N) above every shape where "
          f"rowwise lost: {min(above) if above else 'none'} (shapes where it lost: {sorted(round(i) for i in losing)})")


# ------------------------------------------------------------------------------------------------ --quant
QUANT_M = 8192
QUANT_NS = (2048, 5632, 6144)


def _same(a, b) -> bool:
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and torch.equal(a, b)


def quant_separate(g, s=None):
    from fp8tensor.quantize import E4M3, quantize, quantize_tokens

    gr = g if s is None else g.float() * s.reshape(1, -1)
    return quantize(gr, -1, E4M3, gemm_layout=True), quantize_tokens(g, E4M3)


def quant_fused(g, s=None):
    from fp8tensor.quantize import E4M3, quantize_rows_and_tokens

    return quantize_rows_and_tokens(g, E4M3, col_mul=None if s is None else s.reshape(-1))


def quant_table(rows: list) -> None:
    print(f"grad_out ({QUANT_M} × N, bf16) quantized for both gradient GEMMs\n")
    print("| N | folded scales | separate µs | fused µs | fused / separate | same bits |")
    print("|---|---|---|---|---|---|")
    for N in QUANT_NS:
        g = torch.randn(QUANT_M, N, device="cuda", dtype=torch.bfloat16)
        s = (torch.rand(N, 1, device="cuda") + 0.5) / 448
        for fold in (False, True):
            ss = s if fold else None
            t0 = bench_ms(lambda: quant_separate(g, ss)) * 1e3
            t1 = bench_ms(lambda: quant_fused(g, ss)) * 1e3
            (a0, sa0), (u0, su0) = quant_separate(g, ss)
            (a1, sa1), (u1, su1) = quant_fused(g, ss)
            same = all(_same(x, y) for x, y in ((a0, a1), (sa0, sa1), (u0, u1), (su0, su1)))
            rows.append({"N": N, "folded scales": "yes" if fold else "no", "separate µs": round(t0, 1),
                         "fused µs": round(t1, 1), "fused / separate": f"{t0 / t1:.2f}x", "same bits": same})
            print(f"| {N} | {'yes' if fold else 'no'} | {t0:.1f} | {t1:.1f} | {t0 / t1:.2f}x | {same} |", flush=True)


def write_json(path, table: str, rows: list, command: str) -> None:
    """The rows as a ``docs/results`` record (see ``benchmarks/render.py``)."""
    if path:
        from _util import write_record

        write_record(path, table, rows, command)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--M", type=int, default=16384)
    p.add_argument("--size-rule", action="store_true", help="calibrate the size rule (fp8 / bf16 per Linear shape)")
    p.add_argument("--quick", action="store_true", help="with --size-rule: fewer shapes")
    p.add_argument("--quant", action="store_true", help="grad_out quantization: separate passes vs the fused pair")
    p.add_argument("--json", default=None, help="write the table as a docs/results record here")
    p.add_argument("--profile", action="store_true", help="print top kernels of fp8tensor rowwise at 4096->4096")
    p.add_argument("--check", action="store_true", help="also print grad error vs fp32 at each shape")
    p.add_argument("--no-peers", action="store_true", help="skip torchao")
    p.add_argument("--fast-accum-backward", action="store_true", help="also time rowwise with fast accumulation in backward")
    args = p.parse_args()
    command = "python benchmarks/linear.py " + " ".join(sys.argv[1:])
    if args.size_rule or args.quant:
        rows: list = []
        torch.manual_seed(0)
        print(f"# {'size rule' if args.size_rule else 'grad_out quantization'} ({env_line()})\n")
        (size_rule_table(args.quick, rows) if args.size_rule else quant_table(rows))
        write_json(args.json, "size_rule" if args.size_rule else "quant", rows, command)
        return
    dev = torch.device("cuda")
    vs = variants(not args.no_peers)
    table_rows: list = []
    if args.fast_accum_backward:
        r = fp8tensor.Recipe("rowwise_fastbw", grad_weight_fp8=True, fast_accum_backward=True)
        vs["fp8tensor rowwise+fast bwd"] = lambda m: fp8tensor.convert_to_fp8(m, recipe=r)
    print(f"# Linear forward+backward, M={args.M} ({env_line()})\n")
    names = list(vs)
    print("| K→N | bf16 ms | " + " | ".join(f"{n} (x)" for n in names[1:]) + " |")
    print("|" + "---|" * (len(names) + 1))
    for K, N in SHAPES:
        torch.manual_seed(0)
        base = nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
        x = torch.randn(args.M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
        gy = torch.randn(args.M, N, device=dev, dtype=torch.bfloat16)
        times = {}
        for name, conv in vs.items():
            torch._dynamo.reset()  # each variant compiles afresh (no recompile-limit fallback to eager)
            m = conv(copy.deepcopy(base))
            cm = torch.compile(m)
            fn = step_fn(cm, x, gy)
            try:
                times[name] = bench_ms(fn)
            except Exception as e:
                print(f"({name} failed at {K}->{N}: {type(e).__name__}: {str(e)[:200]})")
                times[name] = float("nan")
            if args.check and name != "bf16":
                x.grad = None
                m.weight.grad = None
                fn()
                xr = x.detach().float().requires_grad_()
                wr = base.weight.detach().float().requires_grad_()
                (xr @ wr.t()).backward(gy.float())
                ex = ((x.grad.float() - xr.grad).norm() / xr.grad.norm()).item()
                ew = ((m.weight.grad.float() - wr.grad).norm() / wr.grad.norm()).item()
                print(f"  check {name} {K}->{N}: grad_input rel err {ex:.4f}, grad_weight rel err {ew:.4f}")
            x.grad = None
            del m, cm
        bf = times["bf16"]
        print(f"| {K}→{N} | {bf:.3f} | " + " | ".join(f"{times[n]:.3f} ({bf / times[n]:.2f})" for n in names[1:]) + " |")
        table_rows.append({"K→N": f"{K}→{N}", "bf16 ms": round(bf, 3),
                           **{n: f"{times[n]:.3f} ({bf / times[n]:.2f}x)" for n in names[1:]}})
    write_json(args.json, "linear", table_rows, command)
    if args.profile:
        K, N = 4096, 4096
        base = nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
        x = torch.randn(args.M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
        gy = torch.randn(args.M, N, device=dev, dtype=torch.bfloat16)
        for name in ("bf16", "fp8tensor rowwise"):
            m = torch.compile(vs[name](copy.deepcopy(base)))
            print(f"\n## top kernels: {name} {K}->{N}\n```\n{top_kernels(step_fn(m, x, gy))}\n```")


if __name__ == "__main__":
    main()
