"""Host overhead of fp8tensor's Linear: the library's layers vs a bare implementation of the same math.

Three comparisons, each a forward + backward of ``y = x W^T`` (bias-free), timed as the minimum (CPU) or median
(CUDA, synchronized per repetition) wall time of many repetitions, the variants of a comparison interleaved
repetition by repetition (:func:`time_many`), with shapes small enough that the host dominates:

1. ``eager``: an ``nn.Linear`` converted by ``fp8tensor.convert_to_fp8`` vs :class:`BareFp8Linear`, a plain
   ``torch.autograd.Function`` doing the same quantizations (row-wise along each GEMM's contraction dim, e4m3) and
   the same ``torch._scaled_mm`` calls (forward fast accumulation, backward slow) with no subclass at all.
2. ``dtensor``: the converted Linear under ``parallelize_module(ColwiseParallel())`` on a 1-rank mesh vs the bare
   one plus DTensor's own cost (a bf16 ``nn.Linear`` under the same plan minus the plain bf16 Linear): what the
   fp8 subclass adds *inside* DTensor.
3. ``compiled``: a ``torch.compile``-d stack of ``--layers`` converted Linears vs the compiled stack of bare ones.
4. ``graph_check``: what ``fp8tensor.graph_step`` checks on the host before each replay (gradients not replaced,
   parameters' storage addresses and their modules' entries unchanged), for the example Llama's parameters
   (``--layers`` blocks, converted): µs per call, against nothing (the replay itself costs the same either way).

Target: every ratio <= 1.15x. Runs on CPU (gloo) and on CUDA (nccl)::

    PYTHONPATH=. python3 benchmarks/host_overhead.py                      # CPU, small shapes
    PYTHONPATH=. python3 benchmarks/host_overhead.py --device cuda --tokens 1024 --dim 1024
    PYTHONPATH=. python3 benchmarks/host_overhead.py --only eager --profile   # cProfile of the converted Linear
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fp8tensor  # noqa: E402
from fp8tensor.quantize import quantize_rowwise  # noqa: E402

E4M3 = torch.float8_e4m3fn


# ------------------------------------------------------------------------------------------------ bare reference
def _q_last(t: torch.Tensor):
    """Row-wise e4m3 quantization along the last dim of a 2-D tensor: (q row-major, scale (M, 1))."""
    return quantize_rowwise(t, dim=-1, float8_dtype=E4M3)


def _q_first_t(t: torch.Tensor):
    """Quantize ``t`` (M, K) along dim 0 and return the transposed layout: (q (K, M) row-major, scale (K, 1)).

    CUDA: the library's fused dim-0 kernel launched directly (what a hand-written implementation would call);
    elsewhere the plain ops."""
    if t.is_cuda:
        from fp8tensor import kernels as K

        if K.kernel_available(t):
            if torch.compiler.is_compiling():
                return torch.ops.fp8tensor.quantize_dim0_t(t, E4M3)
            return K.launch_dim0_t(t, E4M3, torch.finfo(torch.float32).tiny)
    q, s = quantize_rowwise(t.t(), dim=-1, float8_dtype=E4M3)
    return q.contiguous(), s


class _BareFn(torch.autograd.Function):
    """``x @ W^T`` with the three GEMMs in fp8 (rowwise recipe), plain tensors and ``torch._scaled_mm`` only."""

    @staticmethod
    def forward(ctx, x, w):
        K = x.shape[-1]
        x2 = x.reshape(-1, K)
        xq, xs = _q_last(x2)
        wq, ws = _q_last(w)
        out = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=x.dtype, use_fast_accum=True)
        ctx.save_for_backward(x, w)
        return out.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        K, N = x.shape[-1], w.shape[0]
        g2 = g.reshape(-1, N)
        x2 = x.reshape(-1, K)
        gq, gs = _q_last(g2)  # grad_input = g @ W: g per token over N, W per input column over N
        wq, ws = _q_first_t(w)  # (K, N) row-major == (N, K) column-major
        gx = torch._scaled_mm(gq, wq.t(), scale_a=gs, scale_b=ws.t(), out_dtype=g.dtype, use_fast_accum=False)
        gtq, gts = _q_first_t(g2)  # grad_weight = g^T @ x: both over tokens
        xtq, xts = _q_first_t(x2)
        gw = torch._scaled_mm(gtq, xtq.t(), scale_a=gts, scale_b=xts.t(), out_dtype=g.dtype, use_fast_accum=False)
        return gx.view(x.shape), gw.to(w.dtype)


class BareFp8Linear(nn.Module):
    """Bias-free Linear running :class:`_BareFn` (the reference for the host-overhead ratios)."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.weight = lin.weight

    def forward(self, x):
        return _BareFn.apply(x, self.weight)


# ------------------------------------------------------------------------------------------------ timing
def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_us(step, dev, reps: int, inner: int) -> float:
    """Mean wall µs of ``inner`` back-to-back calls of ``step``: the median over ``reps`` on CUDA, the minimum on CPU
    (a shared CPU adds other processes' time to some repetitions; the minimum is the least disturbed one)."""
    return time_many({"step": step}, dev, reps, inner)["step"]


def time_many(steps: dict, dev, reps: int, inner: int) -> dict:
    """:func:`time_us` of several steps measured *interleaved*: each repetition times ``inner`` calls of every step in
    turn, so a slow spell of the machine (another process, a frequency change) falls on all of them alike and the
    ratios between them stay put. Returns ``{name: µs}``."""
    for step in steps.values():
        for _ in range(max(3, inner)):
            step()
    _sync(dev)
    out = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                step()
            _sync(dev)
            out[name].append((time.perf_counter() - t0) / inner * 1e6)
    pick = statistics.median if dev.type == "cuda" else min
    return {name: pick(v) for name, v in out.items()}


def fwd_bwd(mod, x, gy):
    def step():
        y = mod(x)
        y.backward(gy)
        x.grad = None
        for p in mod.parameters():
            p.grad = None

    return step


def make_linear(dim, dev, dtype, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(dim, dim, bias=False, device=dev, dtype=dtype)


def convert(mod, recipe):
    fp8tensor.convert_to_fp8(mod, recipe=recipe)
    return mod


def one_rank_mesh(dev):
    from _util import one_process_mesh

    return one_process_mesh(dev, (1,))


def tp_wrap(lin, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    wrapper = nn.Sequential(lin)
    parallelize_module(wrapper, mesh, {"0": ColwiseParallel()})
    return wrapper


def profile_setup(name, D, dev, dtype, args, x, gy, steps=200):
    """cProfile ``steps`` forward+backward steps of one setup (``lib``, ``bare``, ``lib_compiled``,
    ``bare_compiled``) and print its top 30 functions by own time."""
    import cProfile
    import pstats

    torch._dynamo.reset()
    if name in ("lib", "bare"):
        lin = make_linear(D, dev, dtype)
        mod = convert(lin, args.recipe) if name == "lib" else BareFp8Linear(lin)
    elif name in ("lib_compiled", "bare_compiled"):
        lins = [make_linear(D, dev, dtype, seed=i) for i in range(args.layers)]
        if name == "lib_compiled":
            mod = torch.compile(convert(nn.Sequential(*lins), args.recipe))
        else:
            mod = torch.compile(nn.Sequential(*[BareFp8Linear(m) for m in lins]))
    else:
        raise ValueError(f"host_overhead --profile: unknown setup {name!r}")
    step = fwd_bwd(mod, x, gy)
    for _ in range(10):
        step()
    _sync(dev)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        step()
    _sync(dev)
    pr.disable()
    print(f"\n## cProfile: {name}, {steps} steps")
    pstats.Stats(pr).sort_stats("tottime").print_stats(30)


def graph_check_row(layers: int, reps: int = 2000):
    """Host time of ``graph_step``'s per-call checks on the example Llama's parameters (CPU model: the checks only
    read Python objects and storage addresses, the same on any device)."""
    import warnings

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from llama import Llama, ModelArgs

    model = Llama(ModelArgs(dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, max_seq_len=16))
    fp8tensor.convert_to_fp8(model)
    params = list(model.parameters())

    def fwd_bwd(tok):
        model(tok).float().square().mean().backward()

    step = fp8tensor.graph_step(fwd_bwd, params, warmup_steps=1)
    tok = torch.randint(0, 256, (1, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(tok), step(tok)  # warm-up, then the call that records what the graph reads
    t0 = time.perf_counter()
    for _ in range(reps):
        step._check_memory()
        step._check_grads()
    us = (time.perf_counter() - t0) / reps * 1e6
    return (f"graph_check: graph_step's checks per call, {len(params)} parameters", us, us, 1.0,
            f"{us / len(params):.2f} µs per parameter")


# ------------------------------------------------------------------------------------------------ main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=None, help="rows of x (default: 16 on CPU, 1024 on CUDA)")
    p.add_argument("--dim", type=int, default=None, help="in = out features (default: 64 on CPU, 1024 on CUDA)")
    p.add_argument("--layers", type=int, default=4, help="Linears in the compiled stack")
    p.add_argument("--recipe", default="rowwise")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--inner", type=int, default=20)
    p.add_argument("--only", default="eager,dtensor,compiled,graph_check")
    p.add_argument("--no-eager-parts", action="store_true",
                   help="eager Linears through the general path (fp8tensor.set_config(eager_fast_path=False): the "
                        "same bits) to compare the two paths")
    p.add_argument("--profile", nargs="?", const="lib", default="",
                   help="cProfile 200 steps of each listed setup (comma-separated: lib, bare, lib_compiled, "
                        "bare_compiled; default lib) and print the top 30 functions by own time")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.no_eager_parts:
        fp8tensor.set_config(eager_fast_path=False)
    cuda = dev.type == "cuda"
    M = args.tokens or (1024 if cuda else 16)
    D = args.dim or (1024 if cuda else 64)
    if not cuda:
        torch.set_num_threads(1)  # CPU fp8 GEMMs are emulated: tiny shapes, one thread, so the host part shows
    only = set(args.only.split(","))
    x = torch.randn(M, D, device=dev, dtype=dtype, requires_grad=True)
    gy = torch.randn(M, D, device=dev, dtype=dtype)
    T = lambda step: time_us(step, dev, args.reps, args.inner)  # noqa: E731
    rows = []

    def row(name, lib, ref, note=""):
        rows.append((name, lib, ref, lib / ref, note))

    if "eager" in only or "dtensor" in only:
        steps = {
            "bf16": fwd_bwd(make_linear(D, dev, dtype), x, gy),
            "bare": fwd_bwd(BareFp8Linear(make_linear(D, dev, dtype)), x, gy),
            "lib": fwd_bwd(convert(make_linear(D, dev, dtype), args.recipe), x, gy),
        }
        if "dtensor" in only:
            mesh = one_rank_mesh(dev)
            steps["bf16_dt"] = fwd_bwd(tp_wrap(make_linear(D, dev, dtype), mesh), x, gy)
            steps["fp8_dt"] = fwd_bwd(tp_wrap(convert(make_linear(D, dev, dtype), args.recipe), mesh), x, gy)
        t = time_many(steps, dev, args.reps, args.inner)
        rows.append(("bf16 nn.Linear (reference only)", t["bf16"], t["bf16"], 1.0, ""))
        if "eager" in only:
            row("eager: converted Linear vs bare", t["lib"], t["bare"])
        if "dtensor" in only:
            row("dtensor: converted Linear under 1-rank TP vs bare + DTensor's bf16 cost", t["fp8_dt"],
                t["bare"] + (t["bf16_dt"] - t["bf16"]), f"bf16 under TP {t['bf16_dt']:.0f} µs")
    if "compiled" in only:
        torch._dynamo.reset()
        stack = nn.Sequential(*[make_linear(D, dev, dtype, seed=i) for i in range(args.layers)])
        bare_stack = torch.compile(nn.Sequential(*[BareFp8Linear(m) for m in stack]))
        lib_mods = nn.Sequential(*[make_linear(D, dev, dtype, seed=i) for i in range(args.layers)])
        lib_stack = torch.compile(convert(lib_mods, args.recipe))
        t = time_many({"bare": fwd_bwd(bare_stack, x, gy), "lib": fwd_bwd(lib_stack, x, gy)}, dev, args.reps,
                      args.inner)
        row(f"compiled: stack of {args.layers} converted Linears vs bare", t["lib"], t["bare"])

    if "graph_check" in only:
        rows.append(graph_check_row(args.layers))

    if args.profile:
        for name in args.profile.split(","):
            profile_setup(name, D, dev, dtype, args, x, gy)

    gpu = torch.cuda.get_device_name(dev) if cuda else "cpu"
    env = f"{time.strftime('%Y-%m-%d')} · {gpu} · torch {torch.__version__}"
    path = "general path (eager_fast_path=False)" if args.no_eager_parts else "default paths"
    print(f"\n# host overhead, {M} tokens x {D}->{D} {args.dtype}, recipe {args.recipe}, forward+backward, {path}; {env}\n")
    print("| comparison | fp8tensor µs | reference µs | ratio | note |")
    print("|---|---|---|---|---|")
    for name, lib, ref, ratio, note in rows:
        print(f"| {name} | {lib:.0f} | {ref:.0f} | {ratio:.2f}x | {note} |")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
