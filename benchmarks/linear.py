"""Per-layer forward+backward time: bf16 vs fp8tensor recipes vs torchao float8 recipes (if importable).

Method (same as docs/benchmarks.md): ``nn.Linear(K, N, bias=False, dtype=bf16)`` converted, compiled
with ``torch.compile``; ``x`` of shape ``[M, K]`` requires grad; one step = forward + backward with a fixed
grad_output; median time (triton do_bench). Usage: ``PYTHONPATH=. python benchmarks/linear.py [--profile]
[--json PATH]``. ``--shapes 1024x1024,1024x4096`` times other shapes.

More modes (CUDA):

* ``--size-rule [--quick]``: calibrate ``convert_to_fp8(..., size_rule=True)`` for a GPU. One Linear's forward +
  backward, bf16 vs ``rowwise`` and ``rowwise_gw_hp``, eager and captured as one CUDA graph with
  ``fp8tensor.graph_step`` (no host time, as under a whole-step graph), for square, 4:1 grouped-query k/v and
  MLP-shaped Linears at M = 8192 and 16384 tokens; prints fp8 time / bf16 time next to the rule's decision and the
  smallest ``K·N/(K+N)`` above every shape where ``rowwise`` lost (a value for ``size_rule_min``).
* ``--quant``: the quantization kernels of the token-major operands on ``--M`` x K bf16 tensors (K of the e2e
  models' Linears), each on its own (profiler time, L2 flushed before each call): per row, per feature over the
  tokens (the dim-0 kernels: column amax, transposing cast), both layouts (row + column amax in one read, then both
  casts from one read). µs, the GB/s of the bytes each must move (reads of x, fp8 writes) and that as a share of a
  bf16 copy's GB/s on the same tensor (the achievable bandwidth).
* ``--quant-tiles``: the two-layout kernels' tiles swept against ``kernels.BOTH_CONFIG`` (48 amax and 18 cast tiles,
  each bit-checked against the table's outputs, CUDA-graph timed) on ``--M`` x K bf16 tensors, K = 2048 / 4096 /
  8192: whether another tile would be faster on this GPU.
* ``--host``: the host time of one eager forward (no grad, ``--host-tokens`` rows) of ``nn.Linear``, an fp8 Linear
  with a master weight and a ``quantize_weights`` Linear, in µs per call: calls issued back to back without
  synchronizing, so the time is the host's as long as the GPU keeps up (the rows are tiny).
"""
from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.nn as nn

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import bench_ms, env_line, kernel_us, top_kernels  # noqa: E402

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


def host_table(dev, tokens: int, calls: int = 2000, json_path=None, command: str = "") -> None:
    """µs of host time per eager forward call, no grad (see the module docstring). The last column is the floor
    under any fp8 Linear built on ``torch._scaled_mm``: one bare row-wise ``_scaled_mm`` call on operands already
    quantized."""
    import time

    from fp8tensor.quantize import E4M3, quantize

    def per_call(fn) -> float:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls // 5):
                fn()
            best = min(best, (time.perf_counter() - t0) / (calls // 5) * 1e6)
            torch.cuda.synchronize()
        return best

    print(f"# eager forward host time, {tokens} tokens, no grad ({env_line()})\n")
    print("| K→N | nn.Linear µs | fp8 master µs (x) | fp8 quantize_weights µs (x) | bare torch._scaled_mm µs (x) |")
    print("|---|---|---|---|---|")
    rows = []
    for K, N in ((1024, 1024), (4096, 4096)):
        torch.manual_seed(0)
        base = nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
        mods = {"bf16": base, "master": fp8tensor.convert_to_fp8(copy.deepcopy(base)),
                "frozen": fp8tensor.quantize_weights(nn.Sequential(copy.deepcopy(base)))[0]}
        x = torch.randn(tokens, K, device=dev, dtype=torch.bfloat16)
        xq, xs = quantize(x, -1, E4M3, gemm_layout=True)
        wq, ws = quantize(base.weight.detach(), -1, E4M3, gemm_layout=True)
        with torch.no_grad():
            us = {name: per_call(lambda m=m: m(x)) for name, m in mods.items()}
            us["scaled_mm"] = per_call(lambda: torch._scaled_mm(xq, wq.t(), xs, ws.t(), out_dtype=torch.bfloat16,
                                                                use_fast_accum=True))
        cells = {k: f"{us[k]:.1f} ({us[k] / us['bf16']:.1f}x)" for k in ("master", "frozen", "scaled_mm")}
        print(f"| {K}→{N} | {us['bf16']:.1f} | {cells['master']} | {cells['frozen']} | {cells['scaled_mm']} |")
        rows.append({"K→N": f"{K}→{N}", "nn.Linear µs": f"{us['bf16']:.1f}", "fp8 master µs (x)": cells["master"],
                     "fp8 quantize_weights µs (x)": cells["frozen"], "bare torch._scaled_mm µs (x)": cells["scaled_mm"]})
    write_json(json_path, "host_linear", rows, command)


def quant_table(dev, M: int, json_path=None, command: str = "") -> None:
    """``--quant``: see the module docstring."""
    from fp8tensor.numerics import kernels
    from fp8tensor.quantize import E4M3, SCALE_FLOOR

    print(f"# quantization kernels, {M} tokens, bf16 ({env_line()})\n")
    # each kernel's bytes: reads of x (2 B per element) and its fp8 writes (1 B each); the amax kernels read only
    kinds = {"_row_quant_kernel": ("per row", 3), "_col_amax_kernel": ("column amax", 2),
             "_cast_t_kernel": ("transposing cast", 3), "_amax_both_kernel": ("row + column amax", 2),
             "_cast_both_kernel": ("both layouts cast", 4)}
    cols = ["K", "copy GB/s"] + [f"{label} µs (GB/s, % copy)" for label, _ in kinds.values()] + [
        "both layouts, total µs (% copy)"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    rows = []
    for K in (1024, 2048, 4096, 8192, 14336, 28672):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        n = x.numel()
        copy_gbs = 4 * n / bench_ms(lambda: y.copy_(x)) / 1e6
        times = {}
        for fn in (lambda: kernels.quantize_last_dim(x, E4M3, SCALE_FLOOR),
                   lambda: kernels.launch_dim0_t(x, E4M3, SCALE_FLOOR),
                   lambda: kernels.launch_both(x, E4M3, SCALE_FLOOR)):
            times.update(kernel_us(fn))
        cells = []
        for name, (_, per_elem) in kinds.items():
            gbs = per_elem * n / times[name] / 1e3
            cells.append(f"{times[name]:.1f} ({gbs:.0f}, {100 * gbs / copy_gbs:.0f}%)")
        total = times["_amax_both_kernel"] + times["_cast_both_kernel"]
        cells.append(f"{total:.1f} ({100 * 6 * n / total / 1e3 / copy_gbs:.0f}%)")
        print(f"| {K} | {copy_gbs:.0f} | " + " | ".join(cells) + " |")
        rows.append(dict(zip(cols, [str(K), f"{copy_gbs:.0f}", *cells])))
    write_json(json_path, "quant_kernels", rows, command)


def quant_tiles_table(dev, M: int, json_path=None, command: str = "") -> None:
    """``--quant-tiles``: the two-layout kernels' tiles against the table's (``kernels.BOTH_CONFIG``), on ``M`` x K
    bf16 tensors (K = 2048, 4096, 8192). The amax kernel (48 tiles: rows per tile, columns per tile, rows per
    program, warps) and the cast kernel (18 tiles) launched directly; each candidate's outputs compared bit for bit
    with ``launch_both``'s (a mismatch is printed and the candidate dropped); each kernel timed alone as the median of
    CUDA-graph replays of 10 launches (L2 not flushed; the copy's bandwidth likewise, a ``clone`` in a graph)."""
    import itertools

    from fp8tensor.numerics import kernels
    from fp8tensor.quantize import E4M3, SCALE_FLOOR

    def graph_us(fn) -> float:
        fn()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(10):
                fn()
        g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(8):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) * 1e3 / 10)
        return sorted(ts)[len(ts) // 2]

    def amax_call(x, amax, bm, bk, chunk, warps):
        grid = (kernels._cdiv(x.shape[1], bk), kernels._cdiv(x.shape[0], chunk))

        def f():  # (the kernel alone: its atomic maxima of the same x leave amax as it is, so no reset per call)
            kernels._launch(kernels._amax_both_kernel, grid, (x, amax, x.shape[0], x.shape[1], x.stride(0)),
                            dict(CHUNK_M=chunk, BLOCK_M=bm, BLOCK_K=bk), warps, x.device)
        return f

    def cast_call(x, amax, outs, bm, bk, warps):
        Mx, Kx = x.shape
        grid = (kernels._cdiv(Mx, bm), kernels._cdiv(Kx, bk))

        def f():
            kernels._launch(kernels._cast_both_kernel, grid,
                            (x, amax[:Mx], amax[Mx:], *outs, Mx, Kx, x.stride(0)),
                            dict(FMAX=torch.finfo(E4M3).max, EPS=SCALE_FLOOR, BLOCK_M=bm, BLOCK_K=bk), warps,
                            x.device)
        return f

    def same(a, b) -> bool:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == E4M3 else torch.equal(a, b)

    cols = ["K", "copy GB/s", "amax, BOTH_CONFIG µs (GB/s, % copy)", "amax, best of 48 tiles µs (tile)",
            "cast, BOTH_CONFIG µs (GB/s, % copy)", "cast, best of 18 tiles µs (tile)", "launch_both µs"]
    print(f"# two-layout kernels' tiles, {M} tokens, bf16 ({env_line()})\n")
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    c = kernels.BOTH_CONFIG
    rows = []
    for K in (2048, 4096, 8192):
        torch.manual_seed(K)
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16) * torch.rand(M, 1, device=dev, dtype=torch.bfloat16)
        ref = kernels.launch_both(x, E4M3, SCALE_FLOOR)
        amax_ref = torch.cat([x.float().abs().amax(1), x.float().abs().amax(0)])
        n = x.numel()
        copy_gbs = 4 * n / graph_us(lambda: x.clone()) / 1e3
        full = graph_us(lambda: kernels.launch_both(x, E4M3, SCALE_FLOOR))
        chunk = min(c["amax_chunk_m_max"], max(c["amax_chunk_m"], kernels._next_power_of_2(
            kernels._cdiv(M * kernels._cdiv(K, c["amax_block_k"]), c["amax_programs"]))))  # (launch_both's rule)
        amax = torch.zeros(M + K, dtype=torch.float32, device=dev)
        outs = [torch.empty_like(t) for t in ref]
        table_a = graph_us(amax_call(x, amax, c["amax_block_m"], c["amax_block_k"], chunk, c["amax_warps"]))
        table_c = graph_us(cast_call(x, amax_ref, outs, c["cast_block_m"], c["cast_block_k"], c["cast_warps"]))
        timed_a, timed_c = [], []
        for bm, bk, ch, warps in itertools.product((16, 32, 64), (256, 512), (128, 256, 512, 1024), (4, 8)):
            f = amax_call(x, amax, bm, bk, ch, warps)
            amax.zero_()
            f()
            if not torch.equal(amax, amax_ref):
                print(f"(amax tile {(bm, bk, ch, warps)}: other bits, dropped)")
                continue
            timed_a.append((graph_us(f), f"BLOCK_M {bm}, BLOCK_K {bk}, {ch} rows, {warps} warps"))
        for bm, bk, warps in itertools.product((32, 64, 128), (64, 128, 256), (4, 8)):
            f = cast_call(x, amax_ref, outs, bm, bk, warps)
            for o in outs:  # (a sentinel no output holds: NaN bytes, so an element left unwritten fails the check)
                o.view(torch.uint8).fill_(0xFF)
            f()
            if not all(same(o, r) for o, r in zip(outs, ref)):
                print(f"(cast tile {(bm, bk, warps)}: other bits, dropped)")
                continue
            timed_c.append((graph_us(f), f"BLOCK_M {bm}, BLOCK_K {bk}, {warps} warps"))
        if not (timed_a and timed_c):
            raise RuntimeError(f"linear.py --quant-tiles: no candidate tile gave the table's bits at K = {K}")
        ba, bc = min(timed_a), min(timed_c)
        a_gbs, c_gbs = 2 * n / table_a / 1e3, 4 * n / table_c / 1e3
        cells = [str(K), f"{copy_gbs:.0f}", f"{table_a:.1f} ({a_gbs:.0f}, {100 * a_gbs / copy_gbs:.0f}%)",
                 f"{ba[0]:.1f} ({ba[1]})", f"{table_c:.1f} ({c_gbs:.0f}, {100 * c_gbs / copy_gbs:.0f}%)",
                 f"{bc[0]:.1f} ({bc[1]})", f"{full:.1f}"]
        print("| " + " | ".join(cells) + " |", flush=True)
        rows.append(dict(zip(cols, cells)))
    write_json(json_path, "quant_tiles", rows, command)


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


def write_json(path, table: str, rows: list, command: str) -> None:
    """The rows as a ``docs/results`` record (see ``benchmarks/render.py``)."""
    if path:
        from _util import write_record

        write_record(path, table, rows, command)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--M", type=int, default=None, help="tokens (default 16384; --quant: 8192)")
    p.add_argument("--size-rule", action="store_true", help="calibrate the size rule (fp8 / bf16 per Linear shape)")
    p.add_argument("--quick", action="store_true", help="with --size-rule: fewer shapes")
    p.add_argument("--json", default=None, help="write the table as a docs/results record here")
    p.add_argument("--profile", action="store_true", help="print top kernels of fp8tensor rowwise at 4096->4096")
    p.add_argument("--check", action="store_true", help="also print grad error vs fp32 at each shape")
    p.add_argument("--no-peers", action="store_true", help="skip torchao")
    p.add_argument("--fast-accum-backward", action="store_true", help="also time rowwise with fast accumulation in backward")
    p.add_argument("--shapes", default=None, help="KxN,KxN,... instead of the Llama3-8B shapes")
    p.add_argument("--host", action="store_true", help="host time of one eager forward per call (see the docstring)")
    p.add_argument("--host-tokens", type=int, default=16)
    p.add_argument("--quant", action="store_true", help="the quantization kernels' time and bandwidth (--M tokens)")
    p.add_argument("--quant-tiles", action="store_true",
                   help="the two-layout kernels' tiles against BOTH_CONFIG, bit-checked (--M tokens)")
    args = p.parse_args()
    command = "python benchmarks/linear.py " + " ".join(sys.argv[1:])
    if args.size_rule:
        rows: list = []
        torch.manual_seed(0)
        print(f"# size rule ({env_line()})\n")
        size_rule_table(args.quick, rows)
        write_json(args.json, "size_rule", rows, command)
        return
    dev = torch.device("cuda")
    if args.host:
        host_table(dev, args.host_tokens, json_path=args.json, command=command)
        return
    if args.quant:
        quant_table(dev, args.M or 8192, json_path=args.json, command=command)
        return
    if args.quant_tiles:
        quant_tiles_table(dev, args.M or 8192, json_path=args.json, command=command)
        return
    args.M = args.M or 16384
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    vs = variants(not args.no_peers)
    table_rows: list = []
    if args.fast_accum_backward:
        from fp8tensor.recipes import Gemm

        r = fp8tensor.Recipe("rowwise_fastbw", grad_input=Gemm(fast_accum=True), grad_weight=Gemm(fast_accum=True))
        vs["fp8tensor rowwise+fast bwd"] = lambda m: fp8tensor.convert_to_fp8(m, recipe=r)
    print(f"# Linear forward+backward, M={args.M} ({env_line()})\n")
    names = list(vs)
    print("| K→N | bf16 ms | " + " | ".join(f"{n} (x)" for n in names[1:]) + " |")
    print("|" + "---|" * (len(names) + 1))
    for K, N in shapes:
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
