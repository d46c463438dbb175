"""Stress test of torch's gloo backend with two collectives in flight at once (no fp8tensor involved).

Why it is here: issuing an fp8 tensor's data and scale all-gathers back to back and waiting on both later
intermittently aborts a rank on CPU (gloo) (``malloc(): unaligned tcache chunk detected``, a segmentation fault, or ``terminate called without an active exception``). This script shows the
cause is in torch / gloo, not in the subclass: plain ``float32`` tensors, two all-gathers issued before either is
waited on. Measured 2026-12-01 on CPU (2 cores), 2 processes, 8000 iterations per run, four runs per mode and torch
version (torch 2.13.0+cpu and 2.14.1+cu130): ``inflight`` aborted a rank in 3 of 4 runs on each version; ``c10d``
(``dist.all_gather_into_tensor(async_op=True)`` twice) in none of these 8, but once in 5 further runs of the same
pattern; ``serial`` (wait before issuing the next) in none of 8. On the CPU fp8tensor waits on each of its
collectives before issuing the next (:func:`fp8tensor.collectives._serial`), so it never has two of its own in
flight.

Usage (CPU)::

    python benchmarks/gloo_inflight.py --mode inflight --iters 8000     # usually aborts a rank
    python benchmarks/gloo_inflight.py --mode serial --iters 8000       # passes

Exit status 0 and ``ok`` when every rank finished; otherwise the spawn error names the signal.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _run(rank: int, world: int, port: int, iters: int, mode: str, rows: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    name = dist.group.WORLD.group_name
    funcol = torch.ops._c10d_functional
    for _ in range(iters):
        a, b = torch.rand(rows, 6), torch.rand(rows, 1)
        if mode == "inflight":  # functional collectives, both issued before either wait
            ga = funcol.all_gather_into_tensor(a, world, name)
            gb = funcol.all_gather_into_tensor(b, world, name)
            funcol.wait_tensor(ga)
            funcol.wait_tensor(gb)
        elif mode == "c10d":  # the same with c10d async work handles
            ga, gb = torch.empty(rows * world, 6), torch.empty(rows * world, 1)
            wa = dist.all_gather_into_tensor(ga, a, async_op=True)
            wb = dist.all_gather_into_tensor(gb, b, async_op=True)
            wa.wait()
            wb.wait()
        else:  # serial: wait before issuing the next
            funcol.wait_tensor(funcol.all_gather_into_tensor(a, world, name))
            funcol.wait_tensor(funcol.all_gather_into_tensor(b, world, name))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="inflight", choices=("inflight", "c10d", "serial"))
    p.add_argument("--iters", type=int, default=8000)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rows", type=int, default=1)
    a = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_run, args=(a.world, port, a.iters, a.mode, a.rows), nprocs=a.world)
    print("ok")


if __name__ == "__main__":
    main()
