"""End-to-end training step on one GPU: bf16 vs fp8tensor vs torchao, with and without FSDP2, and under DTensor.

Method (docs/benchmarks.md, "Training step"): ``examples/llama.py``'s Llama (byte vocabulary), random tokens; each block
``torch.compile``-d; fused AdamW; step = forward + cross-entropy + backward + optimizer step + zero_grad; median
of ``--steps`` (15) steps after ``--warmup`` (5); ``torch._dynamo.reset()`` between variants. fp8 is applied to the
block Linears only (``fp8_module_filter``). GPU kernel time per step from ``torch.profiler`` (CUDA activity, 3
steps); wall / GPU > 1 is time the GPU waited on the host.

Variants: ``<precision>@<setup>`` (comma-separated in ``--variants``):

* precision: ``bf16``; ``rowwise`` / ``rowwise_gw_hp`` (fp8tensor recipes); ``ao_tensorwise``, ``ao_rowwise``,
  ``ao_rowwise_gw_hp`` (torchao.float8, skipped when not importable); ``ao_tensorwise_ag`` (torchao tensorwise with
  its fp8 FSDP2 all-gather). A ``.inductor`` suffix on an fp8tensor precision (``rowwise.inductor``) compiles that
  variant under ``with fp8tensor.config(compiled_quantization="inductor"):`` (token-dim quantizations as plain ops that
  inductor generates and fuses) instead of fp8tensor's kernels.
* setup: ``fsdp`` (default; FSDP2 over a 1-rank mesh, float32 master, ``MixedPrecisionPolicy(bf16, fp32 reduce)``,
  ``reshard_after_forward=False``), ``plain`` (no FSDP2: bf16 parameters, bf16 master), ``tp`` (block Linears under
  ``parallelize_module`` on a 1-rank TP mesh, then FSDP2 over the 1-rank dp mesh of the same 2-D mesh), ``tp_plain``
  (the TP mesh, no FSDP2).

A ``+graph`` suffix on the setup (``rowwise@fsdp+graph``) captures the step's forward + loss + backward as one CUDA
graph with :func:`fp8tensor.graph_step` (warm-up calls, capture, replays; the optimizer step outside the graph,
``zero_grad(set_to_none=False)``): the same for every precision, bf16 and torchao included.

A ``+cg`` suffix on the setup (``rowwise@fsdp+cg``) compiles that variant's blocks with ``mode="reduce-overhead"``
(CUDA graphs per block, inductor's CUDA-graph trees); ``--mode`` sets the mode of the variants without it. CUDA-graph
trees record a block's graphs again while FSDP2's unsharded parameters still move between steps: give such variants
``--warmup 25`` (the re-records settle within ~20 steps for fp8tensor; the counters printed per variant say whether
any happened in the timed steps).

Suffixes of an fp8tensor precision: ``.sized`` (``size_rule=True``), ``.inductor`` (``compiled_quantization=
"inductor"``), ``.hpag`` (``fp8_all_gather=False``: plain weights, gathered by FSDP2 in bf16), ``.fp8ag``
(``fp8_all_gather=True``: master weights gathered in fp8 with their row scales); neither: ``convert_to_fp8``'s default
rule (on one GPU over NCCL, the bf16 all-gather; with gloo on the CPU, the fp8 one).

Ratios are to the ``bf16`` row of the same setup and suffix (``+graph`` rows to graphed bf16).
Two timings per variant: the median of ``--steps`` steps, each synchronized before and after (the table of record),
and the mean of the same number of steps run back to back with one synchronization at each end, where the host may
run ahead into the next step as in a training loop that does not read the loss every step.

Sizes (one command each; all variants fit in one run of < 9 minutes)::

    PYTHONPATH=. python3 benchmarks/e2e.py --size 2048      # dim 2048, FFN 8192, 16/8 heads, 6 layers, seq 4096 x 2
    PYTHONPATH=. python3 benchmarks/e2e.py --size 4096      # dim 4096, FFN 14336, 32/8 heads, 4 layers, seq 8192
    PYTHONPATH=. python3 benchmarks/e2e.py --size 8192      # dim 8192, FFN 28672, 64/8 heads, 2 layers, seq 8192
    PYTHONPATH=. python3 benchmarks/e2e.py --size readme    # README example: dim 1024, 4 layers, seq 1024 x 16
    PYTHONPATH=. python3 benchmarks/e2e.py --size moe       # the MoE model: dim 2048, 4 layers, 8 experts, top-2
    PYTHONPATH=. python3 benchmarks/e2e.py --size moe-fine  # fine-grained MoE: 64 experts, top-8, expert hidden 768
    ... --variants bf16@fsdp,rowwise@fsdp --profile          # + top host ops of the fp8 step, chrome trace in $OUT

CPU smoke run: ``--device cpu --size tiny --no-compile``.

``--graph-check`` (any device, CPU included): host time of ``fp8tensor.graph_step``'s checks before each replay
(gradients not replaced, parameters' storage addresses and their modules' entries unchanged) on the example Llama's
parameters (4 blocks, converted): µs per call, paid while the GPU still runs the previous step.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.append(os.path.join(HERE, ".."))  # after PYTHONPATH and site-packages (PYTHONPATH may name another fp8tensor)

from llama import Llama, ModelArgs, fp8_module_filter  # noqa: E402

SIZES = {
    "tiny": dict(dim=128, ffn=384, heads=4, kv_heads=2, layers=2, seq=64, batch=2),
    "readme": dict(dim=1024, ffn=None, heads=16, kv_heads=4, layers=4, seq=1024, batch=16),
    "2048": dict(dim=2048, ffn=8192, heads=16, kv_heads=8, layers=6, seq=4096, batch=2),
    "4096": dict(dim=4096, ffn=14336, heads=32, kv_heads=8, layers=4, seq=8192, batch=1),
    "8192": dict(dim=8192, ffn=28672, heads=64, kv_heads=8, layers=2, seq=8192, batch=1),
    # the example's MoE model (every block's MLP a token-choice top-k MoE of grouped SwiGLU experts): "moe" 8 experts,
    # top-2, expert hidden 4096 (16384 routed rows per layer); "moe-fine" fine-grained as Qwen3-30B-A3B, 64 experts,
    # top-8, expert hidden 768 (65536 routed rows)
    "moe": dict(dim=2048, ffn=8192, heads=16, kv_heads=8, layers=4, seq=4096, batch=2, experts=8, top_k=2,
                moe_hidden=4096),
    "moe-fine": dict(dim=2048, ffn=8192, heads=16, kv_heads=8, layers=4, seq=4096, batch=2, experts=64, top_k=8,
                     moe_hidden=768),
}
MOE_KEYS = ("experts", "top_k", "moe_hidden")
DEFAULT_VARIANTS = ("bf16@fsdp,rowwise@fsdp,rowwise_gw_hp@fsdp,ao_tensorwise@fsdp,ao_rowwise@fsdp,"
                    "bf16@plain,rowwise@plain,ao_tensorwise@plain,bf16@tp,rowwise@tp")
SETUPS = ("fsdp", "plain", "tp", "tp_plain")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="2048", choices=sorted(SIZES))
    for k in ("dim", "ffn", "heads", "kv_heads", "layers", "seq", "batch", *MOE_KEYS):
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=None, help=f"override the size's {k}")
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--mode", default=None, help="torch.compile mode of the blocks (e.g. reduce-overhead)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--cudagraph-params", default="static", choices=("static", "copy"),
                   help="'copy' makes dynamo treat parameters as ordinary graph inputs, so CUDA-graph trees copy "
                        "them into the graph's buffers on every replay instead of recording again when FSDP2 moves "
                        "an unsharded parameter (an experiment: patches dynamo for the whole process, so every "
                        "variant of the run, bf16 included, is compiled under it; recorded in the JSON and header)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--profile", action="store_true", help="print top host ops of every variant")
    p.add_argument("--trace-dir", default=os.environ.get("OUT"), help="write chrome traces here with --profile")
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    p.add_argument("--record", default=None, metavar="PATH",
                   help="write the table as a docs/results record here (name: the file's stem; benchmarks/render.py)")
    p.add_argument("--kernels", action="store_true", help="print the top GPU kernels of every variant")
    p.add_argument("--gc", default="on", choices=("on", "step"),
                   help="Python garbage collector: on (default) or step (disabled in steps, gc.collect() between "
                        "measured steps outside the timing, as torchtitan's GarbageCollection does)")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="run N more steps of every variant under cProfile and print the top Python functions")
    p.add_argument("--sync-debug", action="store_true",
                   help="run one more step with torch.cuda.set_sync_debug_mode('warn') and print where it synced")
    a = p.parse_args(argv)
    size = dict(SIZES[a.size])
    for k in ("dim", "ffn", "heads", "kv_heads", "layers", "seq", "batch", *MOE_KEYS):
        if getattr(a, k) is not None:
            if k in MOE_KEYS and "experts" not in size:
                p.error(f"--{k.replace('_', '-')}: only for the MoE sizes (moe, moe-fine)")
            size[k] = getattr(a, k)
    a.cfg = size
    return a


def moe_line(c: dict) -> str:
    """The header's MoE part of a size (empty for dense sizes)."""
    if "experts" not in c:
        return ""
    return (f"; MoE: {c['experts']} experts, top-{c['top_k']}, expert hidden {c['moe_hidden']} (grouped experts in "
            "fp8 for fp8tensor; torchao's rows convert the Linears only)")


def setup_dist(device):
    from _util import one_process_mesh

    return one_process_mesh(device, (1, 1), ("dp", "tp"))


def ao_available() -> bool:
    try:
        import torchao.float8  # noqa: F401

        return True
    except Exception:
        return False


def build(precision: str, setup: str, args, mesh, device, mode=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    c = args.cfg
    margs = ModelArgs(dim=c["dim"], n_layers=c["layers"], n_heads=c["heads"], n_kv_heads=c["kv_heads"],
                      ffn_hidden=c["ffn"], max_seq_len=max(c["seq"], 16),
                      **(dict(moe=True, n_experts=c["experts"], top_k=c["top_k"], moe_hidden=c["moe_hidden"])
                         if "experts" in c else {}))
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(margs)
    fsdp = setup in ("fsdp", "tp")
    if not fsdp:
        model = model.to(torch.bfloat16)  # no FSDP2: bf16 parameters (bf16 master)
    precision, flags = split_suffixes(precision)
    inductor_quant = ".inductor" in flags  # compiled_quantization="inductor" for this variant
    sized = ".sized" in flags  # fp8tensor's size-aware choice on (small Linears stay bf16)
    # FSDP2's weight all-gather: ".hpag" plain weights gathered in bf16, ".fp8ag" masters gathered in fp8, else the
    # library's rule (bf16 on one host over NCCL, as here on a GPU; fp8 with gloo)
    gather = False if ".hpag" in flags else True if ".fp8ag" in flags else None
    if precision in ("rowwise", "rowwise_gw_hp"):
        import fp8tensor

        print(f"# {precision}: fp8tensor from {os.path.dirname(fp8tensor.__file__)}", flush=True)
        fp8tensor.set_config(compiled_quantization="inductor" if inductor_quant else "kernels")

        fp8tensor.convert_to_fp8(model, recipe=precision, module_filter_fn=fp8_module_filter, size_rule=sized,
                                 fp8_all_gather=gather)
    elif precision.startswith("ao_"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        name = precision[3:]
        ag = name.endswith("_ag")
        name = name[:-3] if ag else name
        cfg = Float8LinearConfig.from_recipe_name(name)
        if ag:
            import dataclasses

            cfg = dataclasses.replace(cfg, enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=cfg, module_filter_fn=fp8_module_filter)
    elif precision != "bf16":  # (check_variant refuses these first; never run an unknown variant as bf16)
        raise SystemExit(f"e2e.py: unknown precision {precision!r}")
    if setup in ("tp", "tp_plain"):
        from torch.distributed.tensor.parallel import parallelize_module
        from llama import block_tp_plan

        for block in model.layers:
            parallelize_module(block, mesh["tp"], block_tp_plan(sequence_parallel=False))
    if not args.no_compile:
        for block in model.layers:
            block.compile(mode=mode) if mode else block.compile()
    if fsdp:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
        fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
    return model


def _is_gemm(name: str) -> bool:
    """Whether a profiler kernel name is a matrix-multiply kernel (cuBLAS ``nvjet*``, ``*gemm*``, CUTLASS)."""
    low = name.lower()
    return low.startswith("nvjet") or any(s in low for s in ("gemm", "cutlass", "xmma"))


def device_activity(prof) -> dict:
    """``{name: (µs, count)}`` of the GPU activity (kernels, memcpy, memset) in a profile; user annotations (e.g.
    inductor's "## Call CompiledFxGraph ##" ranges on the GPU timeline) are not activity and would count kernels
    twice, and CPU ops (which carry their kernels' device time when CPU activity is profiled) are left out."""
    from torch.autograd import DeviceType

    out: dict = {}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False) or e.name.startswith("##"):
            continue
        us, n = out.get(e.name, (0.0, 0))
        out[e.name] = (us + e.self_device_time_total, n + 1)
    return out


def kernel_ms(prof) -> float:
    """Milliseconds of GPU activity per profile (:func:`device_activity`)."""
    return sum(us for us, _ in device_activity(prof).values()) / 1e3


def _alloc_stats() -> dict:
    """Counters of the CUDA caching allocator that mean host stalls: device allocations and frees (cudaMalloc /
    cudaFree synchronize), retries after freeing cached blocks, and full synchronizations."""
    st = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")
    return {k: int(st.get(k, 0)) for k in keys}


def _cudagraph_counters() -> dict:
    """Counters of inductor's CUDA-graph trees on device 0 (``mode="reduce-overhead"``): ``failures`` = new
    recordings of a graph already recorded (for any reason, a moved parameter included: the number to watch),
    ``rerecords`` = those the trees count toward their re-record limit (on torch <= 2.11 this includes moved
    parameters; newer torch leaves them out), and memory-pool checkpoints. Empty without CUDA-graph trees."""
    try:
        from torch._inductor import cudagraph_trees as cgt

        mgr = cgt.get_container(0).tree_manager
    except Exception:
        return {}
    if mgr is None:
        return {}
    rerec = sum(sum(d.values()) for d in getattr(mgr, "num_rerecord", {}).values())
    return dict(rerecords=int(rerec), failures=int(getattr(mgr, "debug_fail_counter", 0)),
                checkpoints=int(getattr(mgr, "debug_checkpointing_counter", 0)))


def host_profile(variant: str, step, n: int, sync) -> None:
    """Print the Python functions of ``n`` steps under ``cProfile`` (self time and cumulative), per step."""
    import cProfile
    import pstats

    sync()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for i in range(n):
        step(i)
    prof.disable()
    sync()
    print(f"\n## {variant}: cProfile of {n} steps ({(time.perf_counter() - t0) * 1e3 / n:.1f} ms per step under "
          f"the profiler; times below are totals over the {n} steps)")
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(35)
    st.sort_stats("cumulative").print_stats(60)


def sync_report(variant: str, step, sync) -> None:
    """Run one step with CUDA sync debugging on and print every distinct place that synchronized the host."""
    import warnings

    sync()
    seen = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message).lower():
            key = (w.filename, w.lineno)
            seen[key] = seen.get(key, 0) + 1
    print(f"\n## {variant}: {sum(seen.values())} synchronizing calls in one step")
    for (f, l), n in sorted(seen.items(), key=lambda kv: -kv[1]):
        print(f"{n:5d}  {f}:{l}")


def make_optimizer(model, fused: bool):
    """One AdamW (lr 1e-4) over ``model.parameters()``, as users and torchtitan build it. Only where torch's fused
    kernel refuses the list (it must be all DTensors or all plain tensors: ``tp_plain``, DTensor block weights next
    to a plain embedding, norms and head) one fused AdamW per kind."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    kinds = {isinstance(p, DTensor) for p in params}
    if len(kinds) <= 1 or not fused:
        return torch.optim.AdamW(params, lr=1e-4, fused=fused)
    groups = {}
    for p in params:
        groups.setdefault(isinstance(p, DTensor), []).append(p)
    from _util import Optimizers

    return Optimizers([torch.optim.AdamW(ps, lr=1e-4, fused=fused) for ps in groups.values()])


def host_ops(ka, n: int = 8) -> dict:
    """Self CPU time per step (profiler over 3 steps) of the top ``n`` host ops, with the compiled graphs' calls and
    FSDP2's per-block hooks each summed into one entry: ``{"total_ms": ..., "ops": [[name, ms, calls], ...]}``."""
    groups: dict = {}
    total = 0.0
    for e in ka:
        total += e.self_cpu_time_total
        k = e.key
        if k.startswith("## Call CompiledFxGraph"):
            k = "compiled graphs (launch code)"
        elif k.startswith("FSDP::") and "(" in k:
            k = k.split(" (")[0] + " (all blocks)"
        ms, calls = groups.get(k, (0.0, 0))
        groups[k] = (ms + e.self_cpu_time_total, calls + e.count)
    top = sorted(groups.items(), key=lambda kv: -kv[1][0])[:n]
    return dict(total_ms=total / 3e3, ops=[[k, v[0] / 3e3, round(v[1] / 3, 1)] for k, v in top])


def run_variant(variant: str, args, mesh, device):
    precision, setup, extra = check_variant(variant)
    mode = "reduce-overhead" if extra == "cg" else args.mode
    if precision.startswith("ao_") and not ao_available():
        print(f"# {variant}: torchao not importable, skipped", flush=True)
        return None
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    c = args.cfg
    model = build(precision, setup, args, mesh, device, mode)
    opt = make_optimizer(model, fused=cuda)
    g = torch.Generator(device="cpu").manual_seed(1)
    batches = [torch.randint(0, 256, (c["batch"], c["seq"] + 1), generator=g).to(device) for _ in range(4)]
    precompute = None
    if precision == "ao_tensorwise_ag":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute = precompute_float8_dynamic_scale_for_fsdp

    graphs = mode is not None and "overhead" in mode
    whole = extra == "graph"

    def fwd_bwd(tok):
        logits = model(tok[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tok[:, 1:].flatten())
        loss.backward()
        return loss.detach()

    if whole:
        import fp8tensor

        fwd_bwd = fp8tensor.graph_step(fwd_bwd, model, warmup_steps=min(3, max(1, args.warmup - 1)))

    def step(i):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        loss = fwd_bwd(batches[i % len(batches)])
        opt.step()
        opt.zero_grad(set_to_none=not whole)
        if precompute is not None:
            precompute(model)
        return loss

    t_compile = time.perf_counter()
    warm_times = []
    for i in range(args.warmup):
        t0 = time.perf_counter()
        step(i)
        sync()
        warm_times.append((time.perf_counter() - t0) * 1e3)
    sync()
    t_compile = time.perf_counter() - t_compile
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    alloc0 = _alloc_stats() if cuda else {}
    cg0 = _cudagraph_counters() if cuda else {}
    if args.gc == "step":
        gc.disable()
    for i in range(args.steps):
        if args.gc == "step":
            gc.collect(1)
        sync()
        t0 = time.perf_counter()
        step(i)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    # The same number of steps back to back, synchronized only before and after: the host may run ahead of the
    # GPU into the next step, as in a training loop that does not read the loss every step.
    sync()
    t0 = time.perf_counter()
    for i in range(args.steps):  # (with --gc step the collector stays off in here: nothing collected in the window)
        step(i)
    sync()
    pipe_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    alloc = {k: v - alloc0.get(k, 0) for k, v in _alloc_stats().items()} if cuda else {}
    cg = {k: v - cg0.get(k, 0) for k, v in _cudagraph_counters().items()} if cuda else {}
    ms = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    gpu_ms = float("nan")
    host_top = kernels = None
    if cuda:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.profile else [])
        with profile(activities=acts) as prof:
            for i in range(3):
                step(i)
            sync()
        ka = prof.key_averages()
        gpu_ms = kernel_ms(prof) / 3
        if args.kernels:
            print(f"\n## {variant}: top GPU kernels (ms per step)")
            ks = sorted(device_activity(prof).items(), key=lambda kv: -kv[1][0])  # (name, (us, count))
            for name, (us, n) in ks[:70]:
                print(f"{us / 3e3:9.3f} {n // 3:5d}  {name[:110]}")
            other = [(k, us, n) for k, (us, n) in ks if not _is_gemm(k)]
            kernels = dict(gemm_ms=sum(us for k, (us, n) in ks if _is_gemm(k)) / 3e3,
                           other_ms=sum(us for _, us, _ in other) / 3e3, launches=sum(n for _, (_, n) in ks) / 3,
                           top=[(k, us / 3e3, n / 3) for k, us, n in other[:6]])
        if args.profile:
            print(f"\n## {variant}: top host ops (3 steps), wall {ms:.2f} ms, GPU {gpu_ms:.2f} ms per step")
            print(ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=80))
            print(ka.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=80))
            host_top = host_ops(ka)
            if args.trace_dir:
                os.makedirs(args.trace_dir, exist_ok=True)
                prof.export_chrome_trace(os.path.join(args.trace_dir, f"trace_{args.size}_{precision}_{setup}{'_cg' if graphs else ''}.json"))
    if args.gc == "step":
        gc.enable()
    if args.cprofile:
        host_profile(variant, step, args.cprofile, sync)
    if args.sync_debug and cuda:
        sync_report(variant, step, sync)
    loss = float(step(0).detach().float())
    row = dict(variant=variant, precision=precision, setup=setup, extra=extra, mode=mode or "default", ms=ms, tok_s=c["batch"] * c["seq"] / ms * 1e3,
               gpu_ms=gpu_ms, peak_gib=peak, warmup_s=t_compile, loss=loss, min_ms=min(times), times_ms=times,
               alloc=alloc, cudagraphs=cg, warmup_ms=warm_times, pipe_ms=pipe_ms, host_top=host_top,
               kernels=kernels)
    print(f"# {variant}: {ms:.2f} ms/step (min {min(times):.2f}; back to back {pipe_ms:.2f}), GPU {gpu_ms:.2f} ms, peak {peak:.2f} GiB, "
          f"warm-up {t_compile:.1f} s, loss {loss:.3f}; steps (ms): {' '.join(f'{t:.1f}' for t in times)}; caching "
          f"allocator in the timed steps: {alloc}"
          + (f"; CUDA-graph trees in the timed steps: {cg}; warm-up steps (ms): "
             f"{' '.join(f'{t:.0f}' for t in warm_times)}" if cg else ""), flush=True)
    if whole:
        fwd_bwd.close()
    del model, opt, fwd_bwd
    torch._dynamo.reset()
    gc.collect()  # an FSDP2 model is only freed by the cycle collector: else the next variant's peak includes it
    if cuda:
        torch.cuda.empty_cache()
    return row


PRECISIONS = ("bf16", "rowwise", "rowwise_gw_hp", "ao_tensorwise", "ao_rowwise", "ao_rowwise_gw_hp", "ao_tensorwise_ag")


SUFFIXES = (".inductor", ".sized", ".hpag", ".fp8ag")


def split_suffixes(precision: str) -> tuple[str, set]:
    """``(base, {suffix, ...})`` of ``<base>[.sized][.inductor][.hpag|.fp8ag]``, the suffixes in any order."""
    flags: set = set()
    while True:
        sfx = next((x for x in SUFFIXES if precision.endswith(x)), None)
        if sfx is None:
            return precision, flags
        if sfx in flags:
            raise SystemExit(f"e2e.py: suffix {sfx} given twice in {precision + sfx!r}")
        flags.add(sfx)
        precision = precision[: -len(sfx)]


def check_variant(variant: str) -> tuple[str, str, str]:
    """``(precision, setup, suffix)`` of ``<precision>[.sized][.inductor][.hpag|.fp8ag]@<setup>[+cg|+graph]``
    (suffixes in any order, fp8tensor precisions only; see the module docstring); SystemExit naming the variant on
    a typo (before anything runs: a misspelled precision must not silently run as bf16)."""
    precision, _, setup = variant.partition("@")
    if "@" in variant and not setup:
        raise SystemExit(f"e2e.py: empty setup in {variant!r}; expected one of {SETUPS}")
    setup, _, extra = (setup or "fsdp").partition("+")
    base, flags = split_suffixes(precision)
    if base not in PRECISIONS or (flags and not base.startswith("rowwise")) or {".hpag", ".fp8ag"} <= flags:
        raise SystemExit(f"e2e.py: unknown precision {precision!r} in {variant!r}; expected one of {PRECISIONS} "
                         f"(fp8tensor's with suffixes {SUFFIXES}, one of .hpag / .fp8ag)")
    if setup not in SETUPS:
        raise SystemExit(f"e2e.py: unknown setup {setup!r} in {variant!r}; expected one of {SETUPS}")
    if flags & {".hpag", ".fp8ag"} and setup not in ("fsdp", "tp"):
        raise SystemExit(f"e2e.py: {variant!r}: .hpag / .fp8ag choose FSDP2's all-gather; setup {setup!r} has none")
    if extra not in ("", "cg", "graph"):
        raise SystemExit(f"e2e.py: unknown suffix +{extra} in {variant!r}; expected +graph or +cg")
    return precision, setup, extra


def _params_not_static() -> None:
    """Experiment behind ``--cudagraph-params copy``: dynamo marks every ``nn.Parameter`` it sees as a static input
    (``torch._dynamo.variables.builder.VariableBuilder.mark_static_input``), so CUDA-graph trees record a graph
    again whenever a parameter's address changes, which FSDP2's per-step unshard does. Skipping the mark for
    parameters makes them ordinary inputs, copied into the graph's own buffers on each replay."""
    from torch._dynamo.variables import builder

    orig = builder.VariableBuilder.mark_static_input

    def mark_static_input(self, value, guard):
        if isinstance(value, torch.nn.Parameter):
            return None
        return orig(self, value, guard)

    builder.VariableBuilder.mark_static_input = mark_static_input


def _ratio(rows: list, r: dict, key: str) -> str:
    """``r[key]`` over the bf16 row of the same setup and suffix, as ``"1.234x"``; "—" without one."""
    base = min((b[key] for b in rows if b["precision"] == "bf16" and b["setup"] == r["setup"]
                and b["extra"] == r["extra"]), default=None)
    return f"{base / r[key]:.3f}x" if base else "—"


def graph_check_us(layers: int = 4, reps: int = 2000) -> tuple:
    """(µs per call, parameters) of ``graph_step``'s per-call checks on the example Llama's parameters (a CPU model:
    the checks only read Python objects and storage addresses, the same on any device)."""
    import warnings

    import fp8tensor

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
    return (time.perf_counter() - t0) / reps * 1e6, len(params)


def main(argv=None):
    if argv is None and "--graph-check" in sys.argv[1:]:
        us, n = graph_check_us()
        print(f"graph_step checks per call: {us:.1f} µs for {n} parameters ({us / n:.2f} µs per parameter)")
        return us
    args = parse(argv)
    for v in (v.strip() for v in args.variants.split(",")):
        if v:
            check_variant(v)
    if args.cudagraph_params == "copy":
        _params_not_static()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    mesh = setup_dist(device)
    rows = []
    for v in args.variants.split(","):
        v = v.strip()
        if not v:
            continue
        try:
            r = run_variant(v, args, mesh, device)
        except Exception as e:  # keep the other rows of a long run
            import traceback

            traceback.print_exc()
            print(f"# {v}: FAILED ({type(e).__name__}: {e})", flush=True)
            torch._dynamo.reset()
            r = None
        if r is not None:
            rows.append(r)
    c = args.cfg
    env = (f"{time.strftime('%Y-%m-%d')} · "
           f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'} · torch {torch.__version__}")
    print(f"\n# e2e step, size {args.size}: dim {c['dim']}, FFN {c['ffn'] or 'default'}, {c['heads']}/{c['kv_heads']} "
          f"heads, {c['layers']} layers, seq {c['seq']} x batch {c['batch']}"
          f"{moe_line(c)}; compile "
          f"{'off' if args.no_compile else (args.mode or 'default')}"
          f"{'; parameters copied into CUDA graphs (--cudagraph-params copy)' if args.cudagraph_params == 'copy' else ''}"
          f"; {env}\n")
    print("| variant | step ms | tokens/s | vs bf16 | GPU ms/step | wall / GPU | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = _ratio(rows, r, "ms")
        print(f"| {r['variant']} | {r['ms']:.2f} | {r['tok_s']:,.0f} | {ratio} | {r['gpu_ms']:.2f} | "
              f"{r['ms'] / r['gpu_ms']:.2f} | {r['peak_gib']:.1f} |")
    print("\nSteps back to back (one synchronization before and after the steps, none between them): mean ms per "
          "step\n")
    print("| variant | ms/step | vs bf16 | wall / GPU |")
    print("|---|---|---|---|")
    for r in rows:
        ratio = _ratio(rows, r, "pipe_ms")
        print(f"| {r['variant']} | {r['pipe_ms']:.2f} | {ratio} | {r['pipe_ms'] / r['gpu_ms']:.2f} |")
    if args.record:
        from _util import write_record

        table = [{"variant": r["variant"], "step ms": f"{r['ms']:.2f}", "tokens/s": f"{r['tok_s']:,.0f}",
                  "vs bf16": _ratio(rows, r, "ms"), "GPU ms/step": f"{r['gpu_ms']:.2f}",
                  "wall / GPU": f"{r['ms'] / r['gpu_ms']:.2f}", "peak GiB": f"{r['peak_gib']:.1f}"} for r in rows]
        b2b = "; ".join(f"{r['variant']} {r['pipe_ms']:.2f} ({_ratio(rows, r, 'pipe_ms')})" for r in rows)
        write_record(args.record, os.path.splitext(os.path.basename(args.record))[0], table,
                     "PYTHONPATH=. python benchmarks/e2e.py " + " ".join(
                         a for i, a in enumerate(sys.argv[1:]) if a != "--record" and sys.argv[i] != "--record"),
                     notes=[f"Back to back (one synchronization before and after, none between; ms per step and "
                            f"ratio): {b2b}."])
        prof = [r for r in rows if r.get("host_top")]
        if prof:  # --profile: the top host ops per step of each variant, side by side
            stem = os.path.splitext(args.record)[0] + "_host"
            depth = max(len(r["host_top"]["ops"]) for r in prof)
            cols = []
            for i in range(depth):
                row = {}
                for r in prof:
                    op = r["host_top"]["ops"][i] if i < len(r["host_top"]["ops"]) else ["", 0, 0]
                    head = (f"{r['variant']} (wall {r['ms']:.1f} ms, GPU {r['gpu_ms']:.1f}; self CPU "
                            f"{r['host_top']['total_ms']:.1f} ms/step)")
                    row[head] = f"`{op[0][:60]}`" if op[0] else ""
                    row[f"ms ({r['variant']})"] = f"{op[1]:.2f}" if op[0] else ""
                    row[f"calls ({r['variant']})"] = str(op[2]) if op[0] else ""
                cols.append(row)
            write_record(stem + ".json", os.path.basename(stem), cols, "PYTHONPATH=. python benchmarks/e2e.py " +
                         " ".join(a for i, a in enumerate(sys.argv[1:]) if a != "--record" and sys.argv[i] != "--record"),
                         notes=["Top host ops by self CPU time per step (torch profiler over 3 steps, divided by 3); "
                                "compiled graphs' calls and FSDP2's per-block hooks summed over the blocks."])
        ker = [r for r in rows if r.get("kernels")]
        if ker:  # --kernels: GPU kernel time per step split into GEMMs and the rest, beside bf16's
            base = next((r["kernels"]["other_ms"] for r in ker if r["precision"] == "bf16"
                         and r["setup"] == ker[0]["setup"]), None)
            table = [{"variant": r["variant"], "GPU ms": f"{r['gpu_ms']:.2f}",
                      "GEMM ms": f"{r['kernels']['gemm_ms']:.2f}", "other kernels ms": f"{r['kernels']['other_ms']:.2f}",
                      "other − bf16's ms": "" if base is None else f"{r['kernels']['other_ms'] - base:+.2f}",
                      "launches per step": f"{r['kernels']['launches']:.0f}",
                      "top other kernels: ms per step (launches per step)": "; ".join(
                          f"`{k[:48]}` {ms:.2f} ({n:.0f})" for k, ms, n in r["kernels"]["top"])} for r in ker]
            stem = os.path.splitext(args.record)[0] + "_kernels"
            write_record(stem + ".json", os.path.basename(stem), table, "PYTHONPATH=. python benchmarks/e2e.py " +
                         " ".join(a for i, a in enumerate(sys.argv[1:]) if a != "--record" and sys.argv[i] != "--record"),
                         notes=["GPU kernel time per step from the torch profiler (3 steps, divided by 3). GEMM: "
                                "cuBLAS / CUTLASS matrix kernels (`nvjet*`, `*gemm*`); other: everything else "
                                "(attention, norms, activations, quantization, optimizer, copies). `other − bf16's` is "
                                "the non-GEMM time a variant adds over bf16 in the same run: for the fp8 variants, "
                                "what quantization costs."])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(size=args.size, cfg=c, env=env, mode=args.mode, cudagraph_params=args.cudagraph_params,
                           rows=rows), f, indent=1)
    import torch.distributed as dist

    dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
