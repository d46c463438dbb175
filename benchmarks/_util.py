"""Shared timing helpers for the GPU benchmarks (CUDA events / triton do_bench, median)."""
from __future__ import annotations

import torch
import torch.nn as nn


def bench_ms(fn, warmup: int = 10, rep: int = 50) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA device (triton.testing.do_bench when available)."""
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup * 5, rep=rep * 5, return_mode="median"))
    except Exception:
        return cuda_event_median_ms(fn, warmup, rep)


def cuda_event_median_ms(fn, warmup: int = 10, rep: int = 50) -> float:
    """Median of ``rep`` CUDA-event timings (ms) of one ``fn()`` each, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def env_line() -> str:
    """One line naming the GPU, torch version and date, for the results table."""
    import datetime

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return f"{datetime.date.today()} · {name} · torch {torch.__version__}"


def top_kernels(fn, n: int = 12) -> str:
    """Profile three calls of ``fn`` (after one) and return the GPU ops (kernels, copies, sets) and GPU time per call,
    then the top CUDA kernels by total time as a text table."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    avgs = prof.key_averages()
    gpu = [a for a in avgs if a.self_device_time_total > 0]  # (kernels, copies and sets: only CUDA is recorded)
    per_call = (f"GPU ops per call: {sum(a.count for a in gpu) / 3:.0f}, GPU µs per call: "
                f"{sum(a.self_device_time_total for a in gpu) / 3:.1f}")
    return per_call + "\n" + avgs.table(sort_by="cuda_time_total", row_limit=n, max_name_column_width=70)


def kernel_us(fn, calls: int = 30) -> dict:
    """Mean GPU time (µs) of each kernel ``fn`` launches, by kernel name, over ``calls`` profiled calls of ``fn``;
    the L2 cache is flushed (a 256 MB write, its fill kernel among the results) before each call, as ``do_bench``
    does."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if e.count and total:
            out[e.key] = total / calls
    return out


def top_host(fn, n: int = 25) -> str:
    """Profile three calls of ``fn`` and return the top host (CPU) ops by self time, with stacks off."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=n, max_name_column_width=60)


def one_process_mesh(device: torch.device, shape: tuple, names=None):
    """A device mesh of ``shape`` (all ones) over a single-process group, created if none exists: NCCL on CUDA, gloo
    on CPU (the one-GPU runs of ``e2e.py`` and ``linear.py --host``)."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


class Layer(nn.Module):
    """The seven projections of a Llama layer (attention q/k/v/o, SwiGLU w1/w2/w3); only the weights matter here."""

    def __init__(self, hidden: int, kv: int, ffn: int):
        super().__init__()
        self.wq = nn.Linear(hidden, hidden, bias=False)
        self.wk = nn.Linear(hidden, kv, bias=False)
        self.wv = nn.Linear(hidden, kv, bias=False)
        self.wo = nn.Linear(hidden, hidden, bias=False)
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)


class Optimizers:
    """Several optimizers stepped and zeroed as one (``step`` / ``zero_grad``)."""

    def __init__(self, opts):
        self.opts = opts

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)


def write_record(path, name: str, rows: list, command: str, **meta) -> None:
    """Write a benchmark's table as a ``docs/results`` record (JSON): ``name``, ``command``, ``date``, ``gpu``,
    ``torch``, ``commit`` (``git rev-parse --short HEAD`` when available), any ``meta`` (e.g. ``software``,
    ``title``, ``notes``), ``columns`` and ``rows`` (each row a list of cells, as ``benchmarks/render.py`` prints
    them). ``rows`` may be dicts (their keys are the columns, in order of first appearance)."""
    import datetime
    import json
    import subprocess

    columns: list = []
    for r in rows:
        if isinstance(r, dict):
            columns += [k for k in r if k not in columns]
    cells = [[r.get(c, "") for c in columns] if isinstance(r, dict) else list(r) for r in rows]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except Exception:
        commit = "unknown"
    record = {"name": name, "command": command, "date": str(datetime.date.today()),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "commit": commit, **meta, "columns": columns,
              "rows": [[c if isinstance(c, str) else json.dumps(c) for c in row] for row in cells]}
    with open(path, "w") as f:
        json.dump(record, f, indent=1, ensure_ascii=False)
        f.write("\n")
