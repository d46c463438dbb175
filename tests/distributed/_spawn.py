"""Spawn harness of the multi-process gloo tests: one process per rank, a fresh seed per run (``FP8TENSOR_TEST_SEED``
replays one), per-rank result dicts and tracebacks sent back to the parent."""
from __future__ import annotations

import datetime
import faulthandler
import importlib
import os
import random
import re
import socket
import sys
import traceback
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def fresh_seed() -> int:
    """A fresh seed for the spawned workers (``FP8TENSOR_TEST_SEED`` replays one); printed for failure reports."""
    seed = int(os.environ.get("FP8TENSOR_TEST_SEED") or random.SystemRandom().randrange(2**31))
    print(f"FP8TENSOR_TEST_SEED={seed} (spawned workers)")
    return seed


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, module, fn_name, extra, out_dir, seed, errq) -> None:
    """Process entry: init gloo, run ``module.fn_name(rank, world, *extra, seed)``, save its result dict."""
    import torch.distributed as dist

    faulthandler.enable()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for p in (str(HERE), str(HERE.parent)):
        if p not in sys.path:
            sys.path.insert(0, p)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
        fn = getattr(importlib.import_module(module), fn_name)
        res = fn(rank, world, *extra, seed)
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        errq.put((rank, traceback.format_exc()))
        raise


#: What the surviving ranks report when another rank died of torch's gloo heap corruption (docs/pytorch_issues.md
#: item 3), as the last line of their traceback: gloo's TCP transport names its source file, then the reason.
_GLOO_TRANSPORT = re.compile(r"gloo/transport/tcp/\S+\] .*(Connection reset by peer|Connection closed by peer)")


class RankFailure(RuntimeError):
    """A spawned run failed: ``errors`` maps each rank that reported a Python exception to its traceback text,
    ``exitcodes`` lists every rank's exit code (negative: killed by that signal)."""

    def __init__(self, errors: dict, exitcodes: list):
        self.errors, self.exitcodes = errors, exitcodes
        text = "\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(errors.items()))
        super().__init__(text or f"exit codes {exitcodes}")


def only_gloo_abort(errors: dict, exitcodes: list) -> bool:
    """Whether a failed run is only torch's gloo abort: some rank was killed by a signal (a segmentation fault, the C
    library's abort) without reporting anything, every rank that reported an exception ended in gloo's transport
    ("Connection reset / closed by peer" as its last line), and no rank exited with a positive code of its own."""
    lost = [r for r, code in enumerate(exitcodes) if code is not None and code < 0 and r not in errors]
    if not lost:
        return False
    for r, code in enumerate(exitcodes):
        if r in errors:
            last = errors[r].strip().splitlines()[-1] if errors[r].strip() else ""
            if not _GLOO_TRANSPORT.search(last):
                return False
        elif code not in (0, None) and code > 0:
            return False
    return True


class _TimedOut(RuntimeError):
    """A rank was still running at the time limit: a hang, never repeated."""


def _spawn_once(module, fn_name, world, out_dir, extra, timeout) -> list[dict]:
    import torch.multiprocessing as mp

    for r in range(world):  # no result of an earlier run can be read as this run's
        Path(out_dir, f"rank{r}.pt").unlink(missing_ok=True)
    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    port = free_port()
    seed = fresh_seed()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, module, fn_name, tuple(extra), str(out_dir), seed, errq))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = {}
    while not errq.empty():
        rank, tb = errq.get()
        errors[rank] = tb
    if hung:
        raise _TimedOut(f"ranks {hung} still running after {timeout} s (killed)\n"
                        + "\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(errors.items())))
    exitcodes = [p.exitcode for p in procs]
    if errors or any(code != 0 for code in exitcodes):
        raise RankFailure(errors, exitcodes)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def spawn(module: str, fn_name: str, world: int, out_dir, extra: tuple = (), timeout: float = 900) -> list[dict]:
    """Run ``module.fn_name(rank, world, *extra, seed)`` on ``world`` gloo processes; return the per-rank result
    dicts, or raise ``RuntimeError`` with every rank's traceback.

    torch's gloo backend now and then kills a rank (heap corruption when two collectives of one process group are in
    flight, DTensor's own plain-tensor collectives included: docs/pytorch_issues.md item 3). A run that fails that
    way and only that way (:func:`only_gloo_abort`) is repeated once, with fresh processes and seed, and a warning
    names the first failure; a second such failure, any Python error, any wrong value or a rank still running after
    ``timeout`` seconds (a hang, not repeated) fails the test."""
    try:
        return _spawn_once(module, fn_name, world, out_dir, extra, timeout)
    except RankFailure as err:
        if not only_gloo_abort(err.errors, err.exitcodes):
            raise
        warnings.warn(f"gloo: a rank of {module}.{fn_name} died in torch's gloo transport (docs/pytorch_issues.md "
                      f"item 3); running again: {str(err)[-300:]}")
    return _spawn_once(module, fn_name, world, out_dir, extra, timeout)
