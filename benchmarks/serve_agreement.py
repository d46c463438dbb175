"""How closely each serving form of an fp8 model agrees with eager fp8 (and the same for bf16, for the reason).

A Hugging Face ``LlamaForCausalLM`` (random weights, 2 layers, dim 256; ``use_cache=False``) in bf16, and its
``fp8tensor.quantize_weights`` copy; logits of one batch of random tokens from: eager, ``torch.export``'s
``ep.module()``, the program after ``ep.run_decompositions()``, and an AOTInductor package of it (``--no-aoti`` skips
the compile). Each row: ``‖out − eager‖ / ‖eager‖`` of the same precision, and ``‖out − ref‖ / ‖ref‖`` against the
float64 model (the bf16 weights in float64). Runs on the CPU (default) or CUDA (``--device cuda``).

    python benchmarks/serve_agreement.py [--device cpu|cuda] [--seq 64] [--no-aoti]
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import tempfile

import torch

import fp8tensor


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--no-aoti", action="store_true")
    a = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024, use_cache=False)
    bf16 = LlamaForCausalLM(cfg).to(a.device, torch.bfloat16).eval()
    f64 = copy.deepcopy(bf16).double()
    fp8 = fp8tensor.quantize_weights(copy.deepcopy(bf16))
    ids = torch.randint(0, cfg.vocab_size, (2, a.seq), device=a.device)
    seq = torch.export.Dim("seq", min=1, max=1024)
    with torch.no_grad():
        ref = f64(ids).logits
    name = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    print(f"# serving agreement · {datetime.date.today()} · {name} · torch {torch.__version__} · HF Llama 2 layers "
          f"dim 256, 2 x {a.seq} tokens")
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


if __name__ == "__main__":
    main()
