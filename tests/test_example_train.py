"""End-to-end smoke test of examples/train.py: 2 ranks via torch.distributed.run, tiny model.

Runs the bf16 and fp8 trainings for a few steps on CPU (gloo) and checks that they
finish, that the losses are finite and go down, and that the outputs are written.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train.py"
STEPS = 16

FINAL_RE = re.compile(
    r"^final val loss: bf16 (\d+\.\d{4})  fp8 (\d+\.\d{4})  gap (-?\d+\.\d{2})%$", re.M
)


def _run_train(out_dir: Path, tp: int, extra=()) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(TRAIN),
        "--device", "cpu", "--tp", str(tp), "--mode", "both", "--steps", str(STEPS),
        "--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        "--seq-len", "64", "--batch-size", "4", "--lr", "3e-3", "--warmup", "4",
        "--val-batches", "2", "--max-bytes", "200000", "--out", str(out_dir), *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("tp", [2, 1], ids=["dp1xtp2", "dp2xtp1"])
def test_train_example_runs(tmp_path, tp):
    proc = _run_train(tmp_path, tp)
    assert proc.returncode == 0, f"train.py failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"

    m = FINAL_RE.search(proc.stdout)
    assert m, f"no final line in output:\n{proc.stdout[-3000:]}"
    bf16_val, fp8_val, gap = map(float, m.groups())

    payload = json.loads((tmp_path / "losses.json").read_text())
    runs = payload["runs"]
    assert set(runs) == {"bf16", "fp8"}
    for name, r in runs.items():
        losses = r["train_loss"]
        assert len(losses) == STEPS
        assert all(math.isfinite(x) for x in losses), name
        assert math.isfinite(r["val_loss"]), name
        # learning: clearly below the initial loss (~ln 256 = 5.5)
        first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
        assert last < first - 0.5, (name, losses)
        assert r["val_loss"] < losses[0], name
    assert abs(runs["bf16"]["val_loss"] - bf16_val) < 1e-4
    assert abs(runs["fp8"]["val_loss"] - fp8_val) < 1e-4
    assert abs(100 * (fp8_val - bf16_val) / bf16_val - gap) < 0.02
    # same seed and data: both runs start from the same loss (same initial weights)
    assert abs(runs["bf16"]["train_loss"][0] - runs["fp8"]["train_loss"][0]) < 0.05
    # the fp8 run is close to, but not bit-identical with, the bf16 run
    assert runs["bf16"]["train_loss"] != runs["fp8"]["train_loss"]
    assert abs(gap) < 5.0

    png = tmp_path / "loss_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_example_compiled_tp(tmp_path):
    """``--compile`` with TP=2 (FSDP2 over a 1-rank dp dim): both runs complete and learn, every block shares one
    compiled graph (no recompile-limit fallback to eager), and the fp8 run stays close to bf16."""
    proc = _run_train(tmp_path, 2, extra=("--compile",))
    assert proc.returncode == 0, f"train.py --compile failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    assert "recompile_limit" not in proc.stderr, proc.stderr[-4000:]
    m = FINAL_RE.search(proc.stdout)
    assert m, f"no final line in output:\n{proc.stdout[-3000:]}"
    bf16_val, fp8_val, gap = map(float, m.groups())
    runs = json.loads((tmp_path / "losses.json").read_text())["runs"]
    for name, r in runs.items():
        losses = r["train_loss"]
        assert all(math.isfinite(x) for x in losses) and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, name
    assert abs(gap) < 5.0
