"""Where a GPU waits on the host: attribute the idle gaps of a chrome trace's GPU timeline to the host ranges open at
that moment.

Input: a trace written by ``torch.profiler`` (``benchmarks/e2e.py --profile --trace-dir DIR`` writes
``trace_<size>_<precision>_<setup>.json`` for every fp8tensor variant). GPU activity is every kernel, memcpy and
memset event; a gap is a stretch with none of them running. Each gap longer than ``--min-us`` is attributed to the
host ranges (FSDP2 ``record_function`` ranges, ``## Call CompiledFxGraph`` wrapper ranges, the optimizer step, the
autograd Functions of compiled regions) that contain its midpoint, the shortest (innermost) first. Totals are over
the whole trace (``e2e.py`` profiles 3 steps: divide by 3 for per-step numbers). Under the profiler the host runs
slower than without it, so the absolute numbers are upper bounds; the ranking is what to read.

``--largest N`` also lists the N longest gaps, each with the GPU activity before and after it and the innermost CPU
events (any op, on any thread) open at its midpoint.

Usage: ``python benchmarks/trace_gaps.py TRACE.json [--min-us 30] [--top 25] [--largest 20]`` (CPU only, no torch
needed; a ``.json.gz`` trace is read directly).
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json


def gaps(events, min_us: float, neighbours: bool = False):
    """``(start_us, length_us)`` of every GPU-idle stretch longer than ``min_us`` (with ``neighbours``:
    ``(start_us, length_us, event_before, event_after)``)."""
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    out, end, last = [], None, None
    for e in gpu:
        if end is not None and e["ts"] - end > min_us:
            out.append((end, e["ts"] - end, last, e) if neighbours else (end, e["ts"] - end))
        if end is None or e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e
    return out, gpu


def largest(events, min_us: float, n: int) -> None:
    """Print the ``n`` longest gaps with their neighbouring GPU activity and the CPU events open at the midpoint."""
    cpu = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    idle, _ = gaps(events, min_us, neighbours=True)
    print(f"\n{n} longest gaps (ms; GPU activity before -> after; innermost CPU events open at the midpoint):")
    for start, length, before, after in sorted(idle, key=lambda g: -g[1])[:n]:
        mid = start + length / 2
        open_ = sorted((c for c in cpu if c["ts"] <= mid <= c["ts"] + c["dur"]), key=lambda c: c["dur"])[:3]
        where = "; ".join(f"{c['name'][:60]} ({c['dur'] / 1e3:.2f} ms, tid {c.get('tid')})" for c in open_)
        print(f"{length / 1e3:6.2f}  {before['name'][:36]} -> {after['name'][:36]}  |  {where or '-'}")


def host_ranges(events):
    keep = ("FSDP::", "## Call CompiledFxGraph", "Optimizer.", "CompiledFunction")
    return [e for e in events if e.get("cat") in ("user_annotation", "cpu_op") and e["name"].startswith(keep)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--min-us", type=float, default=30.0)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--largest", type=int, default=0, metavar="N")
    a = p.parse_args(argv)
    opener = gzip.open if a.trace.endswith(".gz") else open
    with opener(a.trace, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
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
    if a.largest:
        largest(events, a.min_us, a.largest)


if __name__ == "__main__":
    main()
