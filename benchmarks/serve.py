"""Serving speed: forward without grad of the example Llama, bf16 vs fp8tensor (``quantize_weights``) vs torchao's fp8
inference (``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``, the recipe Hugging Face documents),
each eager and with ``torch.compile(mode="reduce-overhead")``.

Models: ``--model 8b``: the example Llama (``examples/llama.py``) at Llama3-8B layer shapes (dim 4096, FFN 14336, 32
heads, 8 kv heads, 2 layers, byte vocabulary), no KV cache; ``--model readme``: the README model (dim 1024, 4 layers).
Rows: decode at batch 1, 8, 64 (one token per sequence) and prefill of 1 and 4 sequences of 2048 tokens. Times:
``triton.testing.do_bench`` medians (ms per forward, the L2 cache flushed between calls); speed-up = bf16 ms / ms, in
the same mode. Every variant runs in its own ``try``: a failure prints an error cell and the table goes on.
``--profile ROW``: the top CUDA kernels of each variant's compiled forward at that row.

    python benchmarks/serve.py [--model 8b|readme] [--rows decode1,decode8,decode64,prefill1,prefill4]
                               [--modes eager,compile] [--variants bf16,fp8tensor,torchao] [--profile decode8]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, ".."))

import fp8tensor  # noqa: E402
from _util import env_line, top_kernels  # noqa: E402
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="8b")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--variants", default="bf16,fp8tensor,torchao")
    ap.add_argument("--profile", default=None, help="a row whose compiled forward is profiled per variant")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/serve.py: needs CUDA")
        return
    rows, modes, names = a.rows.split(","), a.modes.split(","), a.variants.split(",")
    torch._dynamo.config.automatic_dynamic_shapes = False  # one static graph per row (as a server's fixed buckets)
    torch.manual_seed(0)
    args = ModelArgs(**MODELS[a.model])
    bf16 = Llama(args).to("cuda", torch.bfloat16).eval()
    print(f"# serve {a.model} · {env_line()} · do_bench medians, ms per forward (no grad); speed-up vs bf16, same mode")
    print()
    print("| row (batch x tokens) | mode | " + " | ".join(f"{n} ms" for n in names)
          + " | " + " | ".join(f"{n} vs bf16" for n in names if n != "bf16") + " | tokens/s (" + " / ".join(names) + ") |")
    print("|---|---|" + "---|" * (2 * len(names) - (1 if "bf16" in names else 0) + 1))
    models = {}
    for n in names:
        try:
            models[n] = variant(n, bf16)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc(file=sys.stderr)
            models[n] = f"{type(e).__name__}"
    cell = lambda x: f"{x:.3f}" if isinstance(x, float) else str(x)  # noqa: E731
    for mode in modes:
        for r in rows:  # one line per row as soon as it is measured (one static graph per row and variant)
            B, T = ROWS[r]
            ids = torch.randint(0, args.vocab_size, (B, T), device="cuda")
            v = {}
            for n in names:
                m = models[n]
                if isinstance(m, str):
                    v[n] = m
                    continue
                t0 = time.time()
                try:
                    torch._dynamo.reset()
                    fwd = torch.compile(m, mode="reduce-overhead") if mode == "compile" else m

                    def call(f=fwd, compiled=mode == "compile", x=ids):
                        if compiled:
                            torch.compiler.cudagraph_mark_step_begin()
                        with torch.no_grad():
                            return f(x)
                    v[n] = bench(call)
                    if a.profile == r and mode == "compile":
                        print(f"<!-- {n} {mode} {r}: top kernels\n{top_kernels(call)}\n-->", flush=True)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc(file=sys.stderr)
                    v[n] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
                print(f"<!-- {n} {mode} {r}: {time.time() - t0:.0f} s -->", file=sys.stderr, flush=True)
            base = v.get("bf16")
            ratio = lambda x: f"{base / x:.2f}x" if isinstance(x, float) and isinstance(base, float) else "-"  # noqa
            tps = " / ".join(f"{B * T / v[n] * 1e3:,.0f}" if isinstance(v[n], float) else "-" for n in names)
            print(f"| {r} ({B} x {T}) | {mode} | " + " | ".join(cell(v[n]) for n in names) + " | "
                  + " | ".join(ratio(v[n]) for n in names if n != "bf16") + f" | {tps} |", flush=True)
        torch._dynamo.reset()

if __name__ == "__main__":
    main()
