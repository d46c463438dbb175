"""Where a GPU waits on the host: attribute the idle gaps of a chrome trace's GPU timeline to the host ranges open at
that moment.

Input: a trace written by ``torch.profiler`` (``benchmarks/e2e.py --profile --trace-dir DIR`` writes
``trace_<size>_<precision>_<setup>.json`` for every fp8tensor variant). GPU activity is every kernel, memcpy and
memset event; a gap is a stretch with none of them running. Each gap longer than ``--min-us`` is attributed to the
host ranges (FSDP2 ``record_function`` ranges, ``## Call CompiledFxGraph`` wrapper ranges, the optimizer step, the
autograd Functions of compiled regions) that contain its midpoint, the shortest (innermost) first. Totals are over
the whole trace (``e2e.py`` profiles 3 steps: divide by 3 for per-step numbers). Under the profiler the host runs
slower than without it, so the absolute numbers are upper bounds; the ranking is what to read.

Usage: ``python benchmarks/trace_gaps.py TRACE.json [--min-us 30] [--top 25]`` (CPU only, no torch needed).
"""
from __future__ import annotations

import argparse
import collections
import json


def gaps(events, min_us: float):
    """``(start_us, length_us)`` of every GPU-idle stretch longer than ``min_us``."""
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    out, end = [], None
    for e in gpu:
        if end is not None and e["ts"] - end > min_us:
            out.append((end, e["ts"] - end))
        end = e["ts"] + e["dur"] if end is None else max(end, e["ts"] + e["dur"])
    return out, gpu


def host_ranges(events):
    keep = ("FSDP::", "## Call CompiledFxGraph", "Optimizer.", "CompiledFunction")
    return [e for e in events if e.get("cat") in ("user_annotation", "cpu_op") and e["name"].startswith(keep)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--min-us", type=float, default=30.0)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    events = [e for e in json.load(open(a.trace))["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    idle, gpu = gaps(events, a.min_us)
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    busy = sum(e["dur"] for e in gpu)
    ranges = host_ranges(events)
    by = collections.Counter()
    for start, length in idle:
        mid = start + length / 2
        names = sorted((r["name"] for r in ranges if r["ts"] <= mid <= r["ts"] + r["dur"]), key=len)
        by[" > ".join(n[:48] for n in names[:2]) or "(no range)"] += length
    print(f"GPU span {span / 1e3:.2f} ms, kernel time {busy / 1e3:.2f} ms, "
          f"{len(idle)} gaps > {a.min_us:g} us totalling {sum(g for _, g in idle) / 1e3:.2f} ms")
    print("| idle ms | host range(s) open at the gap's midpoint |\n|---|---|")
    for name, us in by.most_common(a.top):
        print(f"| {us / 1e3:.2f} | {name} |")


if __name__ == "__main__":
    main()
