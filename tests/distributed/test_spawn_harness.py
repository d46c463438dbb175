"""The gloo spawn harness itself: a run that loses a rank in torch's gloo transport is repeated once; a Python
error, a silent exit with a code of its own, a hang or a second abort is not (docs/pytorch_issues.md item 3)."""
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


def crash_always(rank: int, world: int, marker: str, seed: int) -> dict:
    """Every run: count it, then rank 1 kills itself with SIGSEGV while rank 0 waits in an all-reduce."""
    import torch
    import torch.distributed as dist

    with open(marker + f".rank{rank}", "a") as f:
        f.write("run\n")
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.all_reduce(torch.ones(1))
    return {}


def exit_silently(rank: int, world: int, marker: str, seed: int) -> dict:
    """Every run: count it, then rank 1 leaves with exit code 1 and no traceback (``os._exit``)."""
    import torch
    import torch.distributed as dist

    with open(marker + f".rank{rank}", "a") as f:
        f.write("run\n")
    dist.barrier()
    if rank == 1:
        os._exit(1)
    dist.all_reduce(torch.ones(1))
    return {}


def python_error(rank: int, world: int, marker: str, seed: int) -> dict:
    """Every run: count it in the marker file, then raise a Python error on rank 0."""
    with open(marker + f".rank{rank}", "a") as f:
        f.write("run\n")
    if rank == 0:
        raise ValueError("a Python error of the test itself")
    return {}


GLOO_CLOSED = ("Traceback (most recent call last):\n  ...\nRuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/"
               "pair.cc:547] Connection closed by peer [127.0.0.1]:1421\n")


def test_only_gloo_abort_classifies_failures():
    from _spawn import only_gloo_abort

    assert only_gloo_abort({0: GLOO_CLOSED}, [1, -11])  # the gloo abort: one rank killed, the other's transport
    assert only_gloo_abort({}, [0, -6])  # killed by abort() with nobody left in a collective
    assert only_gloo_abort({0: GLOO_CLOSED, 2: GLOO_CLOSED}, [1, -11, 1])
    assert not only_gloo_abort({0: GLOO_CLOSED}, [1, 1])  # nobody killed by a signal
    assert not only_gloo_abort({}, [1, 1])  # Python-level exits (sys.exit, os._exit, a failed bootstrap)
    assert not only_gloo_abort({}, [0, 0])
    assert not only_gloo_abort({}, [-11, 1])  # a silent positive exit beside the signal
    assert not only_gloo_abort({0: "Traceback ...\nValueError: bad shape\n"}, [1, -11])
    # the transport's words inside a Python error, or a gloo error followed by a Python one, are not the abort
    assert not only_gloo_abort({0: "Traceback ...\nAssertionError: expected 'Connection reset by peer'\n"}, [1, -11])
    assert not only_gloo_abort({0: GLOO_CLOSED + "\nDuring handling ...\nKeyError: 'x'\n"}, [1, -11])


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
    # 15 s: rank 1 must have started (imported torch) before the limit, also on a loaded 2-core machine
    with pytest.raises(RuntimeError, match=r"still running after 15 s"):
        spawn(__name__, "hang_once", 2, tmp_path, extra=(marker,), timeout=15)
    assert open(marker + ".rank1").read().count("run") == 1


@pytest.mark.parametrize("worker", ["crash_always", "exit_silently"])
def test_spawn_repeats_at_most_once_and_never_a_plain_exit(tmp_path, worker):
    """Two gloo aborts in a row fail (one repeat); a rank that exits with code 1 and no traceback is not repeated."""
    import warnings

    from _spawn import spawn

    marker = str(tmp_path / "runs")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError):
            spawn(__name__, worker, 2, tmp_path, extra=(marker,))
    runs = open(marker + ".rank1").read().count("run")
    assert runs == (2 if worker == "crash_always" else 1)
    assert any("gloo transport" in str(w.message) for w in seen) == (worker == "crash_always")
