"""Where a training step of ``examples/train.py`` spends its time: bf16 vs fp8, per phase, on GPUs.

Builds the example's model exactly as ``examples/train.py`` does (same flags; FSDP2 x TP with sequence parallel,
``--compile``), runs ``--warmup`` steps, then times ``--steps`` steps phase by phase with a device synchronize
between phases (forward, backward, grad-norm clip, AdamW step): wall milliseconds, which include the host-side
(Python / dispatch) time that dominates small models. With ``--profile`` it also prints the top host-side ops of
the fp8 step and the GPU kernel time per step.

Usage (2 GPUs): ``PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/train_step.py --tp 2 --compile
--dim 1024 --layers 4 --heads 16 --kv-heads 4 --seq-len 1024 --batch-size 16 [--variants=bf16,fp8,bf16_reshard,fp8_reshard]``.
``reshard_after_forward`` as ``examples/train.py`` sets it (only when the dp dim has more than one rank); the
``*_reshard`` variants force it (with dp = 1: a re-gather, and for fp8 a re-quantization, before backward).
``--sync-debug``: print the Python stack of every host-device synchronization in one fp8 step.
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, ".."))

import train as ex  # noqa: E402
from llama import Llama, ModelArgs, fp8_module_filter, parallelize_llama  # noqa: E402


def build(args, mesh, device, variant: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    margs = ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                      max_seq_len=max(args.seq_len, 16))
    torch.manual_seed(args.seed)
    model = Llama(margs).to(device)
    if variant.startswith("fp8"):
        import fp8tensor

        fp8tensor.convert_to_fp8(model, recipe=args.recipe, module_filter_fn=fp8_module_filter)
    parallelize_llama(model, mesh["tp"], mesh["dp"], sequence_parallel=args.sequence_parallel,
                      mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                      compile=args.compile,
                      reshard_after_forward=mesh["dp"].size() > 1 or variant.endswith("_reshard"),
                      sp_fp8_comm=variant == "fp8_comm")
    return model


def _sync_stacks(fn) -> None:
    """Run ``fn`` with CUDA sync debug mode on and print each distinct Python stack that synchronized."""
    import traceback
    import warnings

    seen = set()
    orig = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return orig(message, category, filename, lineno, file, line)
        stack = "".join(traceback.format_stack(limit=14)[:-2])
        if stack not in seen:
            seen.add(stack)
            print(f"\n--- sync #{len(seen)}: {message}\n{stack}", flush=True)

    warnings.showwarning = show
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            fn()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = orig


def main() -> None:
    extra = [a for a in sys.argv[1:] if a.startswith("--variants=") or a in ("--profile", "--sync-debug")]
    rest = [a for a in sys.argv[1:] if a not in extra]
    variants = ["bf16", "fp8"]
    for a in extra:
        if a.startswith("--variants="):
            variants = a.split("=", 1)[1].split(",")
    profile = "--profile" in extra
    args = ex.parse_args(rest)
    device, mesh = ex.setup(args)
    corpus = ex.load_corpus(args.data, max_bytes=min(args.max_bytes, 8_000_000))
    train_data, _ = ex.split_corpus(corpus)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = {}
    for variant in variants:
        model = build(args, mesh, device, variant)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        batches = ex.RandomWindows(train_data, args.batch_size, args.seq_len, seed=0,
                                   shard=mesh["dp"].get_local_rank(), num_shards=mesh["dp"].size())
        phases = {"forward": 0.0, "backward": 0.0, "clip": 0.0, "optimizer": 0.0}

        def step(timed: bool):
            x, y = next(batches)
            x, y = x.to(device), y.to(device)
            marks = [time.perf_counter()]

            def mark():
                if timed:
                    sync()
                    marks.append(time.perf_counter())

            if timed:
                sync()
                marks[0] = time.perf_counter()
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            mark()
            loss.backward()
            mark()
            ex.grad_norm_clip_(model.parameters(), 1.0)
            mark()
            opt.step()
            opt.zero_grad(set_to_none=True)
            mark()
            if timed:
                for (name, _), a, b in zip(phases.items(), marks, marks[1:]):
                    phases[name] += (b - a) * 1e3
            return loss

        for _ in range(args.warmup if args.warmup is not None else 5):
            step(False)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(False)
        sync()
        total = (time.perf_counter() - t0) * 1e3 / args.steps
        for _ in range(args.steps):
            step(True)
        if "--sync-debug" in extra and cuda and dist.get_rank() == 0:
            _sync_stacks(lambda: step(False))
        elif "--sync-debug" in extra and cuda:
            step(False)
        rows[variant] = dict(total=total, **{k: v / args.steps for k, v in phases.items()})
        if profile and cuda:  # every rank runs the profiled steps (they hold collectives); rank 0 prints
            from torch.profiler import ProfilerActivity, profile as prof_ctx

            with prof_ctx(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step(False)
                sync()
            if dist.get_rank() == 0:
                ka = prof.key_averages()
                gpu_us = sum(e.self_device_time_total for e in ka) / 3
                print(f"\n## {variant}: GPU kernel time {gpu_us / 1e3:.2f} ms per step (wall {total:.2f} ms)")
                print(ka.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=90))
                print(ka.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=90))
        del model, opt
        torch._dynamo.reset()
        if cuda:
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        tok = args.batch_size * args.seq_len * mesh["dp"].size()
        print(f"\n# train step, dim {args.dim} x {args.layers} layers, seq {args.seq_len}, batch {args.batch_size}, "
              f"dp {mesh['dp'].size()} x tp {mesh['tp'].size()}, compile {args.compile}; "
              f"{torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}\n")
        print("| variant | step ms | tokens/s | vs bf16 | forward | backward | clip | optimizer |")
        print("|---|---|---|---|---|---|---|---|")
        b = rows.get("bf16", next(iter(rows.values())))["total"]
        for v, r in rows.items():
            print(f"| {v} | {r['total']:.2f} | {tok / r['total'] * 1e3:,.0f} | {b / r['total']:.3f}x | "
                  f"{r['forward']:.2f} | {r['backward']:.2f} | {r['clip']:.2f} | {r['optimizer']:.2f} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
