"""The gloo spawn harness itself: a run that loses a rank in torch's gloo transport is repeated once; a Python
error is not (docs/pytorch_issues.md item 3)."""
from __future__ import annotations

import os
import signal

import pytest

pytestmark = pytest.mark.slow


def crash_once(rank: int, world: int, marker: str, seed: int) -> dict:
    """Rank 1 kills itself with SIGSEGV on the first run (no marker file yet) while rank 0 waits in an all-reduce,
    as torch's gloo heap corruption does; on the repeat every rank all-reduces and returns the sum."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    with open(marker + f".rank{rank}", "a") as f:
        f.write("run\n")
    return {"sum": t.item(), "seed": seed}


def python_error(rank: int, world: int, marker: str, seed: int) -> dict:
    """Every run: count it in the marker file, then raise a Python error on rank 0."""
    with open(marker + f".rank{rank}", "a") as f:
        f.write("run\n")
    if rank == 0:
        raise ValueError("a Python error of the test itself")
    return {}


def test_only_gloo_abort_classifies_messages():
    from _spawn import only_gloo_abort

    closed = "rank 0:\nTraceback ...\nRuntimeError: [gloo/transport/tcp/pair.cc:547] Connection closed by peer [::1]:1"
    assert only_gloo_abort(closed)
    assert only_gloo_abort("exit codes [0, -11]")
    assert not only_gloo_abort(closed + "\nrank 1:\nTraceback ...\nAssertionError: wrong value")
    assert not only_gloo_abort("rank 0:\nTraceback ...\nValueError: bad shape")


def test_spawn_repeats_a_gloo_abort_once(tmp_path):
    from _spawn import spawn

    marker = str(tmp_path / "crashed")
    with pytest.warns(UserWarning, match="gloo transport"):
        res = spawn(__name__, "crash_once", 2, tmp_path, extra=(marker,))
    assert [r["sum"] for r in res] == [3.0, 3.0]
    assert open(marker + ".rank0").read().count("run") == 1  # the first run never got past the all-reduce


def test_spawn_does_not_repeat_a_python_error(tmp_path):
    from _spawn import spawn

    marker = str(tmp_path / "runs")
    with pytest.raises(RuntimeError, match="a Python error of the test itself"):
        spawn(__name__, "python_error", 2, tmp_path, extra=(marker,))
    assert open(marker + ".rank0").read().count("run") == 1


def hang_once(rank: int, world: int, marker: str, seed: int) -> dict:
    """Every run: count it, then rank 1 sleeps past the harness's time limit (a hang)."""
    import time

    with open(marker + f".rank{rank}", "a") as f:
        f.write("run\n")
    if rank == 1:
        time.sleep(60)
    return {}


def test_spawn_does_not_repeat_a_hang(tmp_path):
    from _spawn import spawn

    marker = str(tmp_path / "runs")
    with pytest.raises(RuntimeError, match=r"still running after 5 s"):
        spawn(__name__, "hang_once", 2, tmp_path, extra=(marker,), timeout=5)
    assert open(marker + ".rank1").read().count("run") == 1
