"""Serving latency: eager fp8 vs AOTInductor fp8 vs eager bf16 vs AOTInductor bf16, forward only, no grad.

Models: (a) the README's example model (``examples/llama.py``: dim 1024, 4 layers, 16 heads, 4 kv heads, vocab 256),
token ids in, logits out; (b) one Llama3-8B-shaped transformer block (dim 4096, FFN 14336, 32 heads, 8 kv heads),
hidden states in and out. Each at batch 1 with 1 token (decode) and with 64 tokens (prefill).

fp8 = ``fp8tensor.quantize_weights`` of the bf16 model (e4m3 weights, row-wise scales). AOTI = ``torch.export`` with a
dynamic sequence dim (one package per model and dtype, serving both lengths), ``torch._inductor.aoti_compile_and_package``
and ``aoti_load_package``. Times: median of CUDA-event timings of one forward each (after warm-up). Every variant runs
in its own ``try``: a failure prints an error row and the table goes on.

    python benchmarks/serve.py [--rep 50] [--only readme|layer]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, ".."))

import fp8tensor  # noqa: E402
from _util import cuda_event_median_ms  # noqa: E402
from llama import Llama, ModelArgs, TransformerBlock, rope_table  # noqa: E402

DEV = "cuda"
TOKENS = (1, 64)


class OneLayer(nn.Module):
    """One transformer block with its rope table as a buffer: ``[B, T, dim] -> [B, T, dim]``."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.block = TransformerBlock(0, args)
        self.register_buffer("rope", rope_table(args.head_dim, args.max_seq_len, args.rope_theta), persistent=False)

    def forward(self, x):
        return self.block(x, self.rope)


def median_ms(fn, warmup: int, rep: int) -> float:
    """Median of ``rep`` CUDA-event timings of ``fn()`` after ``warmup`` calls (``_util.bench_ms``'s timing loop)."""
    return cuda_event_median_ms(fn, warmup, rep)


def build(which: str):
    """``(bf16 model, input maker (T -> input), dynamic_shapes)``."""
    torch.manual_seed(0)
    if which == "readme":
        args = ModelArgs(dim=1024, n_layers=4, n_heads=16, n_kv_heads=4, vocab_size=256, max_seq_len=1024)
        m = Llama(args)
        make = lambda T: torch.randint(0, args.vocab_size, (1, T), device=DEV)  # noqa: E731
    else:
        args = ModelArgs(dim=4096, n_layers=1, n_heads=32, n_kv_heads=8, ffn_hidden=14336, max_seq_len=1024)
        m = OneLayer(args)
        make = lambda T: torch.randn(1, T, args.dim, device=DEV, dtype=torch.bfloat16)  # noqa: E731
    m = m.to(DEV, torch.bfloat16).eval()
    return m, make, ({1: torch.export.Dim("seq", min=1, max=512)},)


def aoti(m, x, dynamic_shapes, tmp: str, name: str):
    ep = torch.export.export(m, (x,), dynamic_shapes=dynamic_shapes)
    path = torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(tmp, f"{name}.pt2"))
    return torch._inductor.aoti_load_package(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rep", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--only", choices=["readme", "layer"], default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/serve.py: needs CUDA")
        return
    name = torch.cuda.get_device_name()
    print(f"# serve · {name} · torch {torch.__version__} · median of {a.rep} CUDA-event timings, ms per forward")
    print()
    print("| model | tokens | eager bf16 | AOTI bf16 | eager fp8 | AOTI fp8 | AOTI fp8 vs AOTI bf16 | AOTI vs eager fp8 |")
    print("|---|---|---|---|---|---|---|---|")
    tmp = tempfile.mkdtemp(prefix="fp8serve_")
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "gpu"))
    from test_gpu_export import aoti_loads  # a crash-safe check (subprocess) that AOTI packages load at all

    aoti_ok, detail = aoti_loads(tmp)
    if not aoti_ok:
        print(f"<!-- AOTInductor cannot load a package of a plain bf16 nn.Linear in this PyTorch build ({detail}): "
              f"AOTI columns skipped -->", flush=True)
    for which in ([a.only] if a.only else ["readme", "layer"]):
        label = {"readme": "README model (dim 1024, 4 layers)", "layer": "Llama3-8B layer (4096, ffn 14336)"}[which]
        runs, errors = {}, {}
        t0 = time.time()
        try:
            bf16, make, ds = build(which)
            variants = {"eager bf16": bf16, "eager fp8": fp8tensor.quantize_weights(copy.deepcopy(bf16))}
        except Exception as e:  # noqa: BLE001
            print(f"| {label} | - | build failed: {type(e).__name__}: {str(e)[:150]} |")
            continue
        with torch.no_grad():
            for v, m in list(variants.items()):
                runs[v] = m
                aname = v.replace("eager", "AOTI")
                if not aoti_ok:
                    errors[aname] = "AOTInductor packages do not load in this PyTorch build (plain bf16 too)"
                    continue
                try:
                    runs[aname] = aoti(m, make(16), ds, tmp, f"{which}_{aname.split()[1]}")
                except Exception as e:  # noqa: BLE001
                    errors[aname] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    traceback.print_exc(file=sys.stderr)
            for T in TOKENS:
                x = make(T)
                ms = {}
                for v in ("eager bf16", "AOTI bf16", "eager fp8", "AOTI fp8"):
                    if v in errors:
                        ms[v] = None
                        continue
                    try:
                        ms[v] = median_ms(lambda: runs[v](x), a.warmup, a.rep)
                    except Exception as e:  # noqa: BLE001
                        errors[v] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                        ms[v] = None
                cell = lambda v: f"{ms[v]:.3f}" if ms[v] is not None else "error"  # noqa: E731
                ratio = lambda p, q: (f"{ms[q] / ms[p]:.2f}x" if ms[p] and ms[q] else "-")  # noqa: E731
                print(f"| {label} | {T} | {cell('eager bf16')} | {cell('AOTI bf16')} | {cell('eager fp8')} | "
                      f"{cell('AOTI fp8')} | {ratio('AOTI fp8', 'AOTI bf16')} | {ratio('AOTI fp8', 'eager fp8')} |",
                      flush=True)
        for v, err in errors.items():
            print(f"| {label} | error | {v}: {err} |")
        print(f"<!-- {which}: {time.time() - t0:.0f} s including AOTI compiles -->", flush=True)
        runs, variants = {}, {}  # (free the models before the next one)
        torch.cuda.empty_cache()
    print()
    print("Speedup columns: time of the second variant / time of AOTI fp8 (> 1: AOTI fp8 is faster).")


if __name__ == "__main__":
    main()
