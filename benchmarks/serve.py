"""Serving speed: forward without grad of the example Llama, bf16 vs fp8tensor (``quantize_weights``) vs torchao's fp8
inference (``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``, the recipe Hugging Face documents),
each eager and with ``torch.compile(mode="reduce-overhead")``.

Models: ``--model 8b``: the example Llama (``examples/llama.py``) at Llama3-8B layer shapes (dim 4096, FFN 14336, 32
heads, 8 kv heads, 2 layers, byte vocabulary), no KV cache; ``--model readme``: the README model (dim 1024, 4 layers).
Rows: decode at batch 1, 8, 64 (one token per sequence) and prefill of 1 and 4 sequences of 2048 tokens. Times:
``triton.testing.do_bench`` medians (ms per forward, the L2 cache flushed between calls); speed-up = bf16 ms / ms, in
the same mode. Every variant runs in its own ``try``: a failure prints an error cell and the table goes on.
``--profile ROW``: the top CUDA kernels of each variant's forward at that row (eager: also the top host ops).
``--parallel``: one process per variant, row and mode, compiling side by side; once all have compiled and warmed up (or
failed, or 85% of ``--time-limit`` has passed: the cells timed then are listed below the table) they take turns (a file lock) for the timed part; meant for ``--modes compile`` (eager rows are bound by the host, so they are timed without other processes
compiling beside them).

    python benchmarks/serve.py [--model 8b|readme] [--rows decode1,decode8,decode64,prefill1,prefill4]
                               [--modes eager,compile] [--variants bf16,fp8tensor,torchao] [--profile decode8]
                               [--parallel]
    python benchmarks/serve.py --host    # host time per eager call: F.linear, nn.Linear, a quantize_weights Linear
    python benchmarks/serve.py --host-shapes [--host-ms 1,8,16,64]   # eager: host and GPU µs per Linear, 8B shapes
    python benchmarks/serve.py --crossover [--ms 16,32,48,64,96,128] [--sweep-all]   # decode GEMM vs dual fp8 per M
    python benchmarks/serve.py --host-compiled decode1 [--variants bf16,fp8tensor]   # compiled: host vs GPU per call
    python benchmarks/serve.py --agreement [--device cpu|cuda] [--seq 64] [--no-aoti]   # export / AOTI vs eager
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import traceback

_T0 = time.time()  # (the --parallel parent's clock starts before the imports)

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, ".."))

import fp8tensor  # noqa: E402
from _util import env_line, top_host, top_kernels  # noqa: E402
from llama import Llama, ModelArgs  # noqa: E402

ROWS = {"decode1": (1, 1), "decode8": (8, 1), "decode64": (64, 1), "prefill1": (1, 2048), "prefill4": (4, 2048)}
MODELS = {
    "8b": dict(dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, ffn_hidden=14336, max_seq_len=2048),
    "readme": dict(dim=1024, n_layers=4, n_heads=16, n_kv_heads=4, max_seq_len=2048),
}


def variant(name: str, bf16: torch.nn.Module) -> torch.nn.Module:
    if name == "bf16":
        return bf16
    m = copy.deepcopy(bf16)
    if name == "fp8tensor":
        return fp8tensor.quantize_weights(m)
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    quantize_(m, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return m


def bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


class _GpuLock:
    """Exclusive use of the GPU for the timed part (``--lock FILE``): the processes of ``--parallel`` compile side
    by side and time one at a time."""

    def __init__(self, path):
        self.path, self.f = path, None

    def __enter__(self):
        if self.path:
            import fcntl

            self.f = open(self.path, "a")
            fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.f is not None:
            import fcntl

            fcntl.flock(self.f, fcntl.LOCK_UN)
            self.f.close()
            self.f = None


def _mark_ready(a) -> None:
    """With ``--parallel``: this process has compiled and warmed up, or failed (the parent marks processes that end)."""
    if a.lock:
        open(os.path.join(os.path.dirname(a.lock), f"ready.{os.getpid()}"), "w").close()


def _all_ready(a) -> bool:
    """With ``--parallel``: whether every process has marked itself ready (True without ``--parallel``)."""
    if not a.lock:
        return True
    d = os.path.dirname(a.lock)
    return len([f for f in os.listdir(d) if f.startswith("ready.")]) >= a.peers


def _barrier(a) -> bool:
    """With ``--parallel``: mark this process ready, then wait until every process is (or the barrier time passes).
    Returns whether every process was ready (True without ``--parallel``): False means this process may be timed
    while others still compile and warm up, sharing the host's cores and the GPU."""
    if not a.lock:
        return True
    _mark_ready(a)
    while not _all_ready(a):
        if time.time() >= a.start + a.barrier_s:
            return False
        time.sleep(0.2)
    return True


def measure(a, args: ModelArgs, bf16: torch.nn.Module, names: list, rows: list, modes: list, emit) -> dict:
    """``{(mode, row): {variant: ms or error text}}``; ``emit(mode, row, cells)`` after each row."""
    models = {}
    for n in names:
        try:
            models[n] = variant(n, bf16)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc(file=sys.stderr)
            models[n] = f"{type(e).__name__}"
    out, settled = {}, {}
    for mode in modes:
        for r in rows:  # one static graph per row and variant
            B, T = ROWS[r]
            ids = torch.randint(0, args.vocab_size, (B, T), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
            v = {}
            for n in names:
                m = models[n]
                if isinstance(m, str):
                    v[n] = m
                    _mark_ready(a)
                    continue
                t0 = time.time()
                ready = False
                try:
                    torch._dynamo.reset()
                    fwd = torch.compile(m, mode="reduce-overhead") if mode == "compile" else m

                    def call(f=fwd, compiled=mode == "compile", x=ids):
                        if compiled:
                            torch.compiler.cudagraph_mark_step_begin()
                        with torch.no_grad():
                            return f(x)
                    for _ in range(3):  # compile, record the graphs (outside the GPU lock)
                        call()
                    torch.cuda.synchronize()
                    # (--parallel: no process times while another still compiles and warms up, unless the barrier's
                    # time passed first)
                    settled[(mode, r, n)] = _barrier(a)
                    ready = True
                    with _GpuLock(a.lock):
                        if not settled[(mode, r, n)]:  # (the others may have become ready while this one waited)
                            settled[(mode, r, n)] = _all_ready(a)
                        v[n] = bench(call)
                        if a.profile == r:
                            print(f"<!-- {n} {mode} {r}: top kernels\n{top_kernels(call)}\n-->", flush=True)
                            if mode == "eager":
                                print(f"<!-- {n} {mode} {r}: host\n{top_host(call)}\n-->", flush=True)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc(file=sys.stderr)
                    v[n] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
                finally:
                    if not ready:
                        _mark_ready(a)
                print(f"<!-- {n} {mode} {r}: {time.time() - t0:.0f} s -->", file=sys.stderr, flush=True)
            out[(mode, r)] = v
            emit(mode, r, v)
            if a.json:  # (after each row: a parent past its time limit still prints the rows measured)
                import json

                with open(a.json + ".tmp", "w") as f:
                    json.dump({**{f"{k[0]}|{k[1]}": w[names[0]] for k, w in out.items()},
                               **{f"settled|{k[0]}|{k[1]}": ok for k, ok in settled.items() if k[2] == names[0]}}, f)
                os.replace(a.json + ".tmp", a.json)
        torch._dynamo.reset()
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖ / ‖b‖`` in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def agreement(a) -> None:
    """How closely each serving form of an fp8 model agrees with eager fp8, and the same for bf16 (``--agreement``):
    a Hugging Face ``LlamaForCausalLM`` (random weights, 2 layers, dim 256; ``use_cache=False``) in bf16 and its
    ``quantize_weights`` copy; logits from eager, ``ep.module()``, ``ep.run_decompositions()`` and an AOTInductor
    package (``--no-aoti`` skips it); ``‖out − eager‖ / ‖eager‖`` and ``‖out − ref‖ / ‖ref‖`` against the float64
    model. Runs on the CPU (``--device cpu``, the default for this mode) or CUDA."""
    import datetime
    import tempfile

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024, use_cache=False)
    bf16 = LlamaForCausalLM(cfg).to(a.agree_device, torch.bfloat16).eval()
    f64 = copy.deepcopy(bf16).double()
    fp8 = fp8tensor.quantize_weights(copy.deepcopy(bf16))
    ids = torch.randint(0, cfg.vocab_size, (2, a.agree_seq), device=a.agree_device)
    seq = torch.export.Dim("seq", min=1, max=1024)
    with torch.no_grad():
        ref = f64(ids).logits
    name = torch.cuda.get_device_name() if a.agree_device == "cuda" else "CPU"
    print(f"# serving agreement · {datetime.date.today()} · {name} · torch {torch.__version__} · HF Llama 2 layers "
          f"dim 256, 2 x {a.agree_seq} tokens")
    print()
    print("| precision | form | vs eager (same precision) | vs float64 |")
    print("|---|---|---|---|")
    tmp = tempfile.mkdtemp(prefix="fp8agree_")
    for label, m in (("bf16", bf16), ("fp8", fp8)):
        with torch.no_grad():
            eager = m(ids).logits
            ep = torch.export.export(m, (ids,), dynamic_shapes=({1: seq},))
            forms = {"eager": eager, "ep.module()": ep.module()(ids).logits}
            dec = ep.run_decompositions()
            forms["run_decompositions()"] = dec.module()(ids).logits
            if not a.no_aoti:
                pkg = torch._inductor.aoti_compile_and_package(dec, package_path=os.path.join(tmp, f"{label}.pt2"))
                forms["AOTInductor"] = torch._inductor.aoti_load_package(pkg)(ids).logits
        for form, out in forms.items():
            print(f"| {label} | {form} | {rel(out, eager):.2e} | {rel(out, ref):.2e} |", flush=True)



def host_per_call() -> None:
    """Host time per eager call (µs, 2000 calls after 50, one synchronization at each end) of a 256 x 256 bf16 weight
    on one token: ``F.linear``, the decode GEMM's launch alone, a bf16 ``nn.Linear`` and a ``quantize_weights``
    Linear; the host cost that makes eager decode host-bound."""
    from fp8tensor import kernels

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
    print(f"# host time per eager call, 256 x 256 weight, one token ({env_line()})\n")
    print("| call | µs |\n|---|---|")
    with torch.no_grad():
        for k, fn in {"F.linear bf16": lambda: torch.nn.functional.linear(x, lin.weight),
                      "decode GEMM launch": lambda: kernels.launch_w8_mm(x, w8, s, None),
                      "nn.Linear bf16": lambda: lin(x),
                      "nn.Linear after quantize_weights": lambda: q(x)}.items():
            print(f"| {k} | {per_call(fn):.1f} |", flush=True)


def host_per_shape(a) -> None:
    """Where an eager decode step's time goes, per Linear (``--host-shapes``): at each Llama3-8B Linear shape and
    token count (``--host-ms``; inputs ``(M, 1, K)`` as the decode rows pass them), the host time to issue one call
    while the GPU is held busy (``torch.cuda._sleep``, so that no call waits for the GPU) and the GPU time per call
    (CUDA events around the same 200 calls, queued behind the sleep), µs: bf16 ``F.linear`` and ``nn.Linear``, a
    ``quantize_weights`` Linear, its decode GEMM alone (``launch_w8_mm``) as the eager call runs it (one launch) and
    as a CUDA graph runs it (the K split and its reduce launch), and past ``W8_MM_CONFIG["max_m"]`` tokens the
    activations' row quantization alone (host time). Each host time is the best of three passes of 200 calls
    (``--record PATH``: the table as a docs/results record)."""
    from fp8tensor import kernels
    from fp8tensor.quantize import E4M3, quantize

    def host_gpu(fn, n=200):
        # (host: the best of three passes of n calls issued behind a torch.cuda._sleep, so that no call waits for the
        # GPU; GPU: the same pass's calls timed by events, queued behind the sleep. A pass whose calls the GPU caught
        # up with before the last was issued is repeated with a longer sleep.)
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        best, cycles = None, int(1e8)
        while best is None or len(best) < 3:
            torch.cuda._sleep(cycles)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            host = (time.perf_counter() - t0) / n * 1e6
            covered = not e0.query()  # (the sleep still ran when the last call was issued)
            e1.record()
            torch.cuda.synchronize()
            if not covered:
                if cycles >= 2**36:
                    raise RuntimeError("serve.py --host-shapes: the GPU kept up with the host through the sleep")
                cycles *= 2
                continue
            best = (best or []) + [(host, e0.elapsed_time(e1) * 1e3 / n)]
        return min(best)

    ms = [int(m) for m in a.host_ms.split(",")]
    print(f"# host and GPU time per eager call, Llama3-8B Linear shapes ({env_line()}); µs\n")
    cols = ["GEMM (N x K)", "tokens", "bf16 F.linear host / GPU", "bf16 nn.Linear host", "fp8 Linear host / GPU",
            "decode GEMM GPU, one launch", "decode GEMM GPU, K split", "activations' quantization host"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols), flush=True)
    rows: list = []
    torch.manual_seed(0)
    with torch.no_grad():
        for name, N, K, _ in GEMMS_8B:
            lin = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
            q = fp8tensor.quantize_weights(torch.nn.Sequential(torch.nn.Linear(K, N, bias=False, device="cuda",
                                                                               dtype=torch.bfloat16)))[0]
            w8, s = q.weight.qdata, q.weight.scale
            for m in ms:
                x = torch.randn(m, 1, K, device="cuda", dtype=torch.bfloat16)
                x2 = x.reshape(-1, K)
                bh, bg = host_gpu(lambda: torch.nn.functional.linear(x, lin.weight))
                nh, _ = host_gpu(lambda: lin(x))
                fh, fg = host_gpu(lambda: q(x))
                if m > kernels.W8_MM_CONFIG["max_m"]:
                    xq, xs = quantize(x2, -1, E4M3)
                    xin, kw = xq, dict(x_scale=xs, out_dtype=x.dtype)
                    qh = f"{host_gpu(lambda: quantize(x2, -1, E4M3))[0]:.1f}"
                else:
                    xin, kw, qh = x2, {}, "-"
                _, og = host_gpu(lambda: kernels.launch_w8_mm(xin, w8, s, None, one_launch=True, **kw))
                _, sg = host_gpu(lambda: kernels.launch_w8_mm(xin, w8, s, None, one_launch=False, **kw))
                cells = [f"{name} ({N} x {K})", str(m), f"{bh:.1f} / {bg:.1f}", f"{nh:.1f}", f"{fh:.1f} / {fg:.1f}",
                         f"{og:.1f}", f"{sg:.1f}", qh]
                print("| " + " | ".join(cells) + " |", flush=True)
                rows.append(cells)
    if a.record:
        from _util import write_record

        write_record(a.record, "serve_host_shapes", [dict(zip(cols, r)) for r in rows],
                     "python benchmarks/serve.py " + " ".join(sys.argv[1:]))


def _guard_check_us(model: torch.nn.Module, tokens: torch.Tensor) -> str:
    """µs per check of the guards of ``model``'s compiled ``forward(tokens)`` (a module whose ``forward`` is user code
    taking ``tokens``, as the example Llama's: its most recent dynamo cache entry's guard manager, called without
    grad as the compiled calls run): the median of 7 rounds of 1000 checks. ``-`` where this torch has no such entry
    to call, or the call raises."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        entries = _debug_get_cache_entry_list(type(model).forward.__code__)
        if not entries:
            return "-"
        check, frame = entries[0].guard_manager.check, {"self": model, "tokens": tokens}
        rounds = []
        with torch.no_grad():
            if not check(frame):
                return "- (guards fail outside the call)"
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(1000):
                    check(frame)
                rounds.append((time.perf_counter() - t0) * 1e3)
        return f"{sorted(rounds)[3]:.1f}"
    except Exception:  # noqa: BLE001 - a private dynamo API: any change of it leaves the other columns measured
        return "-"


def host_compiled(args: ModelArgs, names: list, row: str) -> None:
    """Where a compiled forward's wall time goes when it exceeds its kernel time (``--host-compiled ROW``): per
    variant, ``torch.compile(mode="reduce-overhead")`` at that row, then per call (µs): the host time to issue it
    (100 calls while a ``torch.cuda._sleep`` holds the GPU, so that no call waits for the GPU; median of 5, flagged
    where the GPU went idle before the last call), the time of dynamo's guard check of the compiled forward (its
    guard manager called directly: :func:`_guard_check_us`), the wall time
    (CUDA events around 300 calls back to back), the GPU time of its kernels and their count (torch profiler, three
    calls), the compiled graphs that ran without a CUDA graph (inductor's ``cudagraph_skips``) and, where torch's AOTAutograd unwraps tensor-subclass
    graph inputs in Python on every call (torch 2.11; 2.12 and later generate that code), the time of that unwrap
    (``runtime_unwrap_tensor_subclasses``, timed around each call). Last, the top host functions of 200 calls of
    fp8tensor's compiled forward (of the last variant if fp8tensor is not among them) under cProfile."""
    import cProfile
    import io
    import pstats

    import importlib.util

    unwrap, python_unwrap = [0.0, 0], False
    try:  # torch 2.11: a Python function of the runtime wrapper, called on every call (2.12 and later generate the
        # unwrap's code, subclass_codegen, and no longer call it, though the function is still defined)
        import torch._functorch._aot_autograd.runtime_wrappers as rw

        real = getattr(rw, "runtime_unwrap_tensor_subclasses", None)
        if real is not None and importlib.util.find_spec("torch._functorch._aot_autograd.subclass_codegen") is None:
            def timed(*args_, **kw):
                t = time.perf_counter()
                out = real(*args_, **kw)
                unwrap[0] += time.perf_counter() - t
                unwrap[1] += 1
                return out
            rw.runtime_unwrap_tensor_subclasses = timed
            python_unwrap = True
    except ImportError:
        pass
    B, T = ROWS[row]
    bf16 = Llama(args).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, args.vocab_size, (B, T), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    print(f"# compiled forward, host vs GPU · {row} ({B} x {T}) · {env_line()} · µs per call\n")
    print("| variant | issue (host) | guard check | wall | GPU kernels | GPU ops | CUDA-graph skips | subclass unwrap "
          "(AOTAutograd, calls per forward) |")
    print("|---|---|---|---|---|---|---|---|")
    profiled, target = None, "fp8tensor" if "fp8tensor" in names else names[-1]
    from torch._dynamo.utils import counters

    for n in names:
        torch._dynamo.reset()
        counters.clear()
        c = torch.compile(variant(n, bf16), mode="reduce-overhead")

        def call(f=c):
            torch.compiler.cudagraph_mark_step_begin()
            with torch.no_grad():
                return f(ids)
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        issues, idle = [], 0
        for _ in range(5):  # the GPU held busy (0.15-0.2 s) while the host issues 100 calls: none waits for the GPU
            torch.cuda._sleep(int(3e8))
            busy = torch.cuda.Event()
            busy.record()  # (completes when the sleep does)
            t0 = time.perf_counter()
            for _ in range(100):
                call()
            issues.append((time.perf_counter() - t0) / 100 * 1e6)
            idle += busy.query()  # the sleep ended before the last call was issued: calls may have waited
            torch.cuda.synchronize()
        issue = f"{sorted(issues)[2]:.1f}" + (f" (GPU idle before the end in {idle} of 5)" if idle else "")
        guards = _guard_check_us(c._orig_mod, ids)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        unwrap[:] = [0.0, 0]
        s.record()
        for _ in range(300):
            call()
        e.record()
        torch.cuda.synchronize()
        wall = s.elapsed_time(e) / 300 * 1e3
        if unwrap[1]:
            un = f"{unwrap[0] / 300 * 1e6:.1f} ({unwrap[1] / 300:.0f})"
        else:  # (torch 2.11 with no subclass among the graph's inputs; 2.12 and later: generated code, not timed)
            un = "0 (no subclass input)" if python_unwrap else "- (generated code)"
        ops, gpu = top_kernels(call, n=1).splitlines()[0].split("GPU ops per call: ")[-1].split(", GPU µs per call: ")
        skips = counters["inductor"]["cudagraph_skips"]
        print(f"| {n} | {issue} | {guards} | {wall:.1f} | {gpu} | {ops} | {skips} | {un} |", flush=True)
        if n == target:  # (before the next variant's dynamo reset, which would make this one compile again)
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(200):
                call()
            pr.disable()
            torch.cuda.synchronize()
            out = io.StringIO()
            pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(20)
            profiled = f"<!-- {n}: cProfile of 200 compiled calls\n{out.getvalue()[:6000]}\n-->"
    if profiled:
        print("\n" + profiled)


#: Llama3-8B's Linear shapes ``(name, N, K)`` and how many of each a layer has (``--crossover``).
GEMMS_8B = (("wq, wo", 4096, 4096, 2), ("wk, wv", 1024, 4096, 2), ("w1, w3", 14336, 4096, 2), ("w2", 4096, 14336, 1))
#: Tile candidates ``(block_n, block_k, warps, programs_per_sm)`` of the weight-only form, timed with ``--sweep-all``
#: (the 64- and 128-row blocks' weight-only tiles; the table's stages and min_k_tiles).
TILE_CANDIDATES = ((32, 128, 4, 4), (64, 128, 4, 4), (64, 128, 4, 8), (128, 128, 8, 4), (64, 64, 4, 4),
                   (128, 64, 8, 2), (64, 128, 8, 2), (128, 128, 4, 2))
#: With ``--sweep-all``, also timed at every M, the 16- and 32-row blocks included: deeper pipelines
#: ``(block_n, block_k, warps, programs_per_sm, stages, min_k_tiles)`` that keep more weight bytes in flight per SM
#: (the decode GEMM streams the weight at about half of HBM's bandwidth). All compile for sm_90 without register
#: spills at 16 rows (``tests/_kernels_sm90.py``'s method).
DEEP_CANDIDATES = ((32, 256, 4, 2, 4, 2), (32, 256, 4, 4, 4, 2), (64, 256, 4, 2, 4, 2), (32, 512, 4, 1, 3, 2),
                   (64, 256, 8, 2, 3, 2), (128, 256, 8, 1, 4, 2), (32, 128, 4, 2, 5, 4), (64, 128, 4, 4, 5, 4),
                   (16, 256, 4, 4, 4, 2))


#: With ``--sweep-all``, also timed at one token: gemv tiles (no MMA; one row)
#: ``(block_n, block_k, warps, programs_per_sm, min_k_tiles)``, one pipeline stage.
GEMV_CANDIDATES = ((8, 1024, 4, 4, 1), (32, 256, 4, 4, 1), (32, 256, 4, 8, 1), (16, 512, 4, 4, 1),
                   (16, 512, 4, 8, 1), (64, 256, 8, 8, 1), (16, 256, 4, 8, 1), (32, 512, 8, 2, 1))


def _graph_us(calls: list, reps: int = 20) -> float:
    """GPU µs per call of ``calls`` (one per weight copy), captured as one CUDA graph on a side stream after a warm-up
    there (Triton's compiles), median of ``reps`` replays."""
    cur = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        for c in calls:
            c()
    cur.wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / len(calls))
    del g
    return sorted(times)[len(times) // 2]


#: Tile candidates of the fp8 x fp8 form (the 32- and 64-row blocks): ``(block_n, block_k, warps, programs_per_sm,
#: stages, min_k_tiles, swap_ab)``.
FP8X_CANDIDATES = ((64, 128, 4, 4, 3, 4, True), (64, 256, 4, 4, 3, 2, True), (64, 256, 4, 4, 4, 2, True),
                   (64, 256, 4, 8, 3, 2, True), (128, 256, 8, 2, 3, 2, True), (64, 512, 4, 4, 2, 1, True),
                   (64, 128, 4, 4, 3, 4, False), (64, 256, 4, 4, 3, 2, False), (32, 256, 4, 4, 3, 2, False),
                   (64, 256, 4, 1, 3, 4, False), (64, 256, 4, 2, 3, 2, False), (32, 256, 4, 1, 4, 4, False))


def _f8f8_call(x, w, tiles=None):
    """One no-grad Linear of ``quantize_weights`` weight ``w`` through the decode GEMM's fp8 x fp8 form: ``x``
    quantized per row by the row kernel, then ``launch_w8_mm`` with ``x_scale`` (its K split for small M)."""
    from fp8tensor import kernels
    from fp8tensor.quantize import SCALE_FLOOR

    def call():
        xq, xs = kernels.quantize_last_dim(x, w.qdata.dtype, SCALE_FLOOR, checked=True)
        return kernels.launch_w8_mm(xq, w.qdata, w.scale, None, x_scale=xs, out_dtype=x.dtype, tiles=tiles)
    return call


def crossover(a) -> None:
    """Where the decode GEMM's weight-only form should hand over to its fp8 x fp8 form, and that to cuBLAS's dual-fp8
    GEMM (``--crossover``; sets ``W8_MM_CONFIG["max_m"]`` and ``max_m_fp8x``), and which tiles the row blocks should
    have.

    Per Llama3-8B Linear shape and token count M (``--ms``): GPU µs per GEMM of the weight-only kernel (the table's
    tiles; with ``--sweep-all`` also the best of :data:`TILE_CANDIDATES` and :data:`DEEP_CANDIDATES`, named; past
    ``max_m`` the best of :data:`FP8X_CANDIDATES` for the fp8 x fp8 form instead), of the dual-fp8 path (the
    no-grad Linear with ``weight_only_decode=False``: the activations' row-wise quantization and ``torch._scaled_mm``),
    of the decode GEMM's fp8 x fp8 form (the activations quantized per row by the row kernel, then ``launch_w8_mm``
    with ``x_scale``: cuBLAS's dual-fp8 GEMM has no K split for small M) and of bf16 ``F.linear``. Each is one CUDA graph over enough copies of the weight (at least 2, and 512 MB of fp8
    weights) that they stream from HBM as in a model, replayed; no host time. Last, per M: a layer's GEMMs summed
    (wq, wk, wv, wo, w1, w3, w2) and the largest M up to which the weight-only kernel wins at every M of the sweep."""
    import math

    import torch.nn as nn

    from fp8tensor import kernels

    ms = [int(m) for m in a.ms.split(",")]
    print(f"# decode GEMM crossover · {env_line()} · GPU µs per GEMM (CUDA graph over weight copies, median of 20); "
          f"W8_MM_CONFIG max_m={kernels.W8_MM_CONFIG['max_m']}, max_m_fp8x={kernels.W8_MM_CONFIG['max_m_fp8x']}")
    print()
    print("| GEMM (N x K) | M | w8 | w8 best tile (block_n, block_k, warps, programs_per_sm, stages, min_k_tiles, "
          "swap_ab[, gemv]) | dual fp8 | fp8 x fp8, K split | bf16 | fastest |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    layer = {m: {"w8": 0.0, "dual": 0.0, "f8f8": 0.0, "bf16": 0.0} for m in ms}
    for name, N, K, count in GEMMS_8B:
        copies = max(2, math.ceil(512 * 2**20 / (N * K)))
        torch.manual_seed(0)
        hp = [nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        bf16_w = [lin.weight.detach() for lin in hp]
        fp8 = [fp8tensor.quantize_weights(nn.Sequential(lin))[0] for lin in hp]
        del hp
        for m in ms:
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
            cell = {}

            def w8(tiles=None):
                return _graph_us([lambda f=f: kernels.launch_w8_mm(x, f.weight.qdata, f.weight.scale, None,
                                                                   tiles=tiles) for f in fp8])

            bm = kernels._w8_mm_bucket(m)  # (the table's row block of m tokens)
            try:
                cell["w8"] = w8()
            except Exception as e:  # noqa: BLE001
                cell["w8"] = f"{type(e).__name__}"
            best = "-"
            fp8x = m > kernels.W8_MM_CONFIG["max_m"]
            if fp8x or a.sweep_all:
                base = kernels.W8_MM_CONFIG["tiles"][bm]
                if fp8x:
                    cands = list(FP8X_CANDIDATES)
                else:
                    mma = kernels.W8_MM_CONFIG["tiles"][max(16, bm)]  # (the MMA candidates: stages, min_k_tiles)
                    cands = [(bn, bk, w, pps, mma["stages"], mma["min_k_tiles"], False)
                             for bn, bk, w, pps in TILE_CANDIDATES] + [(*c, False) for c in DEEP_CANDIDATES]
                    if m == 1:
                        cands += [(bn, bk, w, pps, 1, mkt, False, True) for bn, bk, w, pps, mkt in GEMV_CANDIDATES]
                timed = []
                for bn, bk, warps, pps, stages, mkt, swap, *gemv in cands:
                    tiles = dict(base, block_n=bn, block_k=bk, warps=warps, programs_per_sm=pps, stages=stages,
                                 min_k_tiles=mkt, swap_ab=swap, gemv=bool(gemv))
                    try:
                        t = (_graph_us([_f8f8_call(x, f.weight, tiles) for f in fp8]) if fp8x else w8(tiles))
                        timed.append((t, (bn, bk, warps, pps, stages, mkt, swap, *(["gemv"] if gemv else []))))
                    except Exception:  # noqa: BLE001 (out of shared memory / registers: not a candidate)
                        pass
                if timed:
                    t, cand = min(timed)
                    best = f"{t:.1f} {cand}"
                    cell["best"] = t
            with torch.no_grad(), fp8tensor.config(weight_only_decode=False):
                try:
                    cell["dual"] = _graph_us([lambda f=f: f(x) for f in fp8])
                except Exception as e:  # noqa: BLE001
                    cell["dual"] = f"{type(e).__name__}"
            try:  # the decode GEMM's fp8 x fp8 form: x quantized per row (one kernel), the K split as above
                cell["f8f8"] = _graph_us([_f8f8_call(x, f.weight) for f in fp8])
            except Exception as e:  # noqa: BLE001
                cell["f8f8"] = f"{type(e).__name__}"
            cell["bf16"] = _graph_us([lambda w=w: torch.nn.functional.linear(x, w) for w in bf16_w])
            nums = {k: v for k, v in cell.items() if isinstance(v, float)}
            own = "f8f8" if fp8x else "w8"  # (the form whose tiles were swept)
            w8_best = min([v for k, v in nums.items() if k == "w8" or (k == "best" and own == "w8")], default=math.inf)
            f8_best = min([v for k, v in nums.items() if k == "f8f8" or (k == "best" and own == "f8f8")],
                          default=math.inf)
            label = {"w8": "w8", "best": "fp8 x fp8 best tile" if fp8x else "w8 best tile", "dual": "dual fp8",
                     "f8f8": "fp8 x fp8, K split", "bf16": "bf16"}
            fastest = label[min(nums, key=nums.get)] if nums else "-"
            for k, v in (("w8", w8_best), ("dual", cell["dual"]), ("f8f8", f8_best), ("bf16", cell["bf16"])):
                layer[m][k] += count * v if isinstance(v, float) else math.inf
            fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else str(v)  # noqa: E731
            print(f"| {name} ({N} x {K}) | {m} | {fmt(cell['w8'])} | {best} | {fmt(cell['dual'])} | "
                  f"{fmt(cell['f8f8'])} | {fmt(cell['bf16'])} | {fastest} |", flush=True)
        del fp8, bf16_w
        torch.cuda.empty_cache()
    print()
    print("| M | layer: w8 (best) µs | dual fp8 µs | fp8 x fp8, K split (best) µs | bf16 µs | best fp8 / bf16 |")
    print("|---|---|---|---|---|---|")
    w8_wins, f8_wins = [], []
    for m in ms:
        v = layer[m]
        w8_wins.append(v["w8"] <= min(v["dual"], v["f8f8"]))
        f8_wins.append(min(v["w8"], v["f8f8"]) <= v["dual"])
        print(f"| {m} | {v['w8']:.1f} | {v['dual']:.1f} | {v['f8f8']:.1f} | {v['bf16']:.1f} | "
              f"{min(v['w8'], v['dual'], v['f8f8']) / v['bf16']:.3f} |", flush=True)

    def upto(wins):
        ok = [m for m, good in zip(ms, [all(wins[:i + 1]) for i in range(len(wins))]) if good]
        return ok[-1] if ok else "none"
    print()
    print(f"weight-only fastest for a whole layer at every M up to: {upto(w8_wins)} (W8_MM_CONFIG max_m); the decode "
          f"GEMM (either form) ahead of cuBLAS's dual fp8 at every M up to: {upto(f8_wins)} (max_m_fp8x)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", action="store_true", help="only the host time per eager call (see host_per_call)")
    ap.add_argument("--host-shapes", action="store_true",
                    help="only the host and GPU time per eager call at Llama3-8B shapes (see host_per_shape)")
    ap.add_argument("--host-ms", default="1,8,16,64", help="with --host-shapes: token counts")
    ap.add_argument("--record", default=None, help="with --host-shapes: write the table as a docs/results record here")
    ap.add_argument("--crossover", action="store_true",
                    help="only the decode GEMM against the dual-fp8 GEMM per Llama3-8B shape and token count, and "
                         "tile candidates past 32 tokens (see crossover)")
    ap.add_argument("--ms", default="16,32,48,64,96,128", help="with --crossover: token counts (at most 128)")
    ap.add_argument("--sweep-all", action="store_true",
                    help="with --crossover: time the tile candidates (and DEEP_CANDIDATES) at every token count")
    ap.add_argument("--agreement", action="store_true",
                    help="only how closely export / AOTInductor forms agree with eager (see agreement; CPU or CUDA)")
    ap.add_argument("--device", dest="agree_device", default="cpu", help="with --agreement")
    ap.add_argument("--seq", dest="agree_seq", type=int, default=64, help="with --agreement: tokens per sequence")
    ap.add_argument("--no-aoti", action="store_true", help="with --agreement: skip the AOTInductor package")
    ap.add_argument("--model", choices=sorted(MODELS), default="8b")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--variants", default="bf16,fp8tensor,torchao")
    ap.add_argument("--profile", default=None, help="a row whose compiled forward is profiled per variant")
    ap.add_argument("--parallel", action="store_true",
                    help="one process per variant, row and mode: they compile side by side, then take turns on the GPU to be timed")
    ap.add_argument("--time-limit", type=float, default=0,
                    help="with --parallel: seconds (from the start) after which unfinished processes are stopped")
    ap.add_argument("--lock", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--peers", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--start", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--barrier-s", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--host-compiled", default=None, metavar="ROW", choices=list(ROWS),
                    help="only the compiled forward's host time, wall time, kernel time and subclass unwrap per call "
                         "at ROW, per variant (see host_compiled)")
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.agreement:
        agreement(a)
        return
    if not torch.cuda.is_available():
        print("benchmarks/serve.py: needs CUDA")
        return
    if a.host:
        host_per_call()
        return
    if a.host_shapes:
        host_per_shape(a)
        return
    if a.crossover:
        crossover(a)
        return
    if a.host_compiled:
        host_compiled(ModelArgs(**MODELS[a.model]), a.variants.split(","), a.host_compiled)
        return
    rows, modes, names = a.rows.split(","), a.modes.split(","), a.variants.split(",")
    torch._dynamo.config.automatic_dynamic_shapes = False  # one static graph per row (as a server's fixed buckets)
    cell = lambda x: f"{x:.3f}" if isinstance(x, float) else str(x)  # noqa: E731

    def emit(mode, r, v):
        if a.json:
            return
        B, T = ROWS[r]
        base = v.get("bf16")
        ratio = lambda x: f"{base / x:.2f}x" if isinstance(x, float) and isinstance(base, float) else "-"  # noqa
        tps = " / ".join(f"{B * T / v[n] * 1e3:,.0f}" if isinstance(v[n], float) else "-" for n in names)
        print(f"| {r} ({B} x {T}) | {mode} | " + " | ".join(cell(v[n]) for n in names) + " | "
              + " | ".join(ratio(v[n]) for n in names if n != "bf16") + f" | {tps} |", flush=True)

    if not a.json:
        print(f"# serve {a.model} · {env_line()} · do_bench medians, ms per forward (no grad); speed-up vs bf16, "
              "same mode" + (" · one process per variant, row and mode, compiled side by side, then timed one at a time" if a.parallel else ""))
        print()
        print("| row (batch x tokens) | mode | " + " | ".join(f"{n} ms" for n in names) + " | "
              + " | ".join(f"{n} vs bf16" for n in names if n != "bf16") + " | tokens/s (" + " / ".join(names) + ") |")
        print("|---|---|" + "---|" * (2 * len(names) - (1 if "bf16" in names else 0) + 1), flush=True)
    if a.parallel:  # one process per variant, row and mode; results as JSON files, merged here
        import json
        import shutil
        import subprocess
        import tempfile

        tmp = tempfile.mkdtemp()
        lock = os.path.join(tmp, "gpu.lock")
        jobs = [(n, r, mode) for mode in modes for r in rows for n in names]
        barrier_s = 0.85 * a.time_limit if a.time_limit else 3600.0
        procs = {}
        for n, r, mode in jobs:
            cmd = [sys.executable, os.path.abspath(__file__), "--model", a.model, "--rows", r, "--modes", mode,
                   "--variants", n, "--lock", lock, "--json", os.path.join(tmp, f"{n}.{r}.{mode}.json"),
                   "--peers", str(len(jobs)), "--start", str(_T0), "--barrier-s", str(barrier_s)]
            if a.profile:
                cmd += ["--profile", a.profile]
            log = open(os.path.join(tmp, f"{n}.{r}.{mode}.log"), "w")  # (profiles: printed after the table)
            # (one compile worker each: the processes themselves use the cores)
            procs[(n, r, mode)] = subprocess.Popen(cmd, stdout=log,
                                                   env=dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1"))
        pending, killed = dict(procs), set()
        while pending:
            for key, p in list(pending.items()):
                if p.poll() is not None:  # ended (perhaps before it marked itself ready: mark it for the others)
                    open(os.path.join(tmp, f"ready.{p.pid}"), "w").close()
                    del pending[key]
            if pending and a.time_limit and time.time() >= _T0 + a.time_limit:
                for key, p in pending.items():
                    p.kill()
                    p.wait()
                    killed.add(key)
                break
            time.sleep(0.2)
        res, unsettled = {}, []
        for (n, r, mode), p in procs.items():
            try:
                with open(os.path.join(tmp, f"{n}.{r}.{mode}.json")) as f:
                    got = json.load(f)
                res[(n, r, mode)] = got[f"{mode}|{r}"]
                if not got.get(f"settled|{mode}|{r}", True):
                    unsettled.append(f"{n} {mode} {r}")
            except (FileNotFoundError, KeyError):
                res[(n, r, mode)] = ("stopped at the time limit" if (n, r, mode) in killed
                                     else f"process failed (exit code {p.returncode})")
        for mode in modes:
            for r in rows:
                emit(mode, r, {n: res[(n, r, mode)] for n in names})
        if unsettled:
            print(f"\nTimed before every process had compiled (the barrier's {barrier_s:.0f} s passed first; the "
                  "others may have shared the host's cores and the GPU, compiling and warming up): "
                  + "; ".join(unsettled) + ".", flush=True)
        if a.profile:
            for n, r, mode in jobs:
                with open(os.path.join(tmp, f"{n}.{r}.{mode}.log")) as f:
                    text = f.read().strip()
                if text:
                    print(text, flush=True)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    torch.manual_seed(0)
    args = ModelArgs(**MODELS[a.model])
    bf16 = Llama(args).to("cuda", torch.bfloat16).eval()
    measure(a, args, bf16, names, rows, modes, emit)


if __name__ == "__main__":
    main()
