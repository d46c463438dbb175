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
    skip = 1 if tp == 2 else 3  # the tok/s of the dp2xtp1 run leaves out its first 3 steps
    proc = _run_train(tmp_path, tp, extra=("--timing-skip", str(skip), "--log-every", "5"))
    assert proc.returncode == 0, f"train.py failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    # stdout is a pipe, not a terminal: no progress bar, one line every --log-every steps and at the last, per run
    assert "it/s" not in proc.stdout + proc.stderr and "\r" not in proc.stdout + proc.stderr
    want = sorted({s for s in range(5, STEPS + 1, 5)} | {STEPS})
    for name in ("bf16", "fp8"):
        got = [int(n) for n in re.findall(rf"^{name} step (\d+)/{STEPS}  loss [\d.]+  gnorm [\d.]+  tokens/s [\d,]+$",
                                          proc.stdout, re.M)]
        assert got == want, (name, got, proc.stdout[-3000:])
    note = "the first step, which includes" if skip == 1 else f"the first {skip} steps, which include"
    assert len(re.findall(rf"[\d,]+ tok/s \(after {note} compile / warm-up\)", proc.stdout)) == 2, proc.stdout[-3000:]

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


# ------------------------------------------------------------------------------------------------ bad inputs
# Arguments are checked before the process group exists: rank 0 prints one line, the launcher exits non-zero,
# and no rank prints a traceback of the script (torchrun's own ChildFailedError report is not the script's).
ERROR_PREFIX = "examples/train.py: error: "


def _assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    lines = [ln for ln in out.splitlines() if ln.startswith(ERROR_PREFIX)]
    assert len(lines) == 1, out[-3000:]
    for frag in fragments:
        assert frag in lines[0], (frag, lines[0])
    assert 'examples/train.py", line' not in out, out[-3000:]  # no traceback through the script
    assert "final val loss" not in out


def _run_plain(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(TRAIN), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def _run_torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(TRAIN), "--device", "cpu", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def test_train_example_without_torchrun_hints_at_torchrun():
    """``python examples/train.py`` (world size 1, default --tp 2): one line naming torchrun, exit status 2."""
    proc = _run_plain()
    _assert_one_line_error(proc, "world size 1", "--tp 2", "torchrun --nproc-per-node")
    assert proc.returncode == 2


def test_train_example_steps_zero():
    _assert_one_line_error(_run_plain("--tp", "1", "--steps", "0"), "--steps must be at least 1, got 0")


def test_train_example_corpus_too_small(tmp_path):
    """A corpus whose validation split cannot hold one sequence: one line, before any process group."""
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("x" * 1000)
    _assert_one_line_error(_run_plain("--tp", "1", "--data", str(tiny)),
                           "corpus: the validation split has 50 bytes, fewer than --seq-len + 1 = 129")


def _load_train_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_example_train", TRAIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("args, world, fragment", [
    (("--tp", "0"), 1, "--tp must be at least 1, got 0"),
    (("--batch-size", "0"), 2, "--batch-size must be at least 1"),
    (("--val-batches", "0"), 2, "--val-batches must be at least 1"),
    (("--warmup", "-1"), 2, "--warmup must be at least 0"),
    (("--lr", "0"), 2, "--lr must be a positive number"),
    (("--lr", "nan"), 2, "--lr must be a positive number"),
    (("--tp", "3"), 4, "world size 4 is not divisible by --tp 3"),
    (("--dim", "100"), 2, "--dim 100 is not divisible by --heads 8"),
    (("--kv-heads", "3"), 2, "--heads 8 is not divisible by --kv-heads 3"),
    (("--dim", "24"), 2, "head dim --dim / --heads = 3 must be even"),
    (("--tp", "4", "--kv-heads", "2"), 4, "--kv-heads = 2 is not divisible by --tp 4"),
    (("--seq-len", "127"), 2, "--seq-len 127 is not divisible by --tp 2"),
    (("--no-sequence-parallel", "--sp-fp8-comm"), 2, "--sp-fp8-comm needs sequence parallelism"),
    (("--data", "/nonexistent/corpus.txt"), 2, "--data path does not exist"),
    (("--timing-skip", "0"), 2, "--timing-skip must be at least 1"),
    (("--steps", "10", "--timing-skip", "10"), 2, "--timing-skip 10 leaves no timed step of --steps 10"),
    (("--cuda-graph", "--device", "cpu"), 2, "--cuda-graph needs CUDA"),
    (("--cuda-graph", "--device", "cpu", "--steps", "2"), 2, "--cuda-graph needs CUDA"),
    (("--experts", "4", "--top-k", "1"), 2, "--experts, --top-k only apply to the MoE model: add --moe"),
    (("--cuda-graph", "--device", "cuda", "--compile-mode", "reduce-overhead"), 2,
     "--cuda-graph already captures the whole step"),
])
def test_train_example_check_args(args, world, fragment):
    """Each bad combination is named by ``check_args`` (run before any collective); good ones pass."""
    train = _load_train_module()
    problem = train.check_args(train.parse_args(list(args)), world, world)
    assert problem is not None and fragment in problem, problem
    assert "\n" not in problem


def test_train_example_check_args_accepts_good_runs():
    train = _load_train_module()
    for args, world in ((["--seq-len", "127", "--no-sequence-parallel"], 2), ([], 4), (["--tp", "1"], 1),
                        (["--tp", "4", "--heads", "8", "--kv-heads", "4"], 8), (["--warmup", "0"], 2)):
        assert train.check_args(train.parse_args(args), world, world) is None, args


def test_train_example_compile_mode_implies_compile():
    """``--compile-mode`` compiles the blocks with that mode (it implies ``--compile``); ``--timing-skip`` is the
    number of first steps the reported tok/s leaves out, and the final line says how many."""
    train = _load_train_module()
    a = train.parse_args(["--compile-mode", "reduce-overhead", "--timing-skip", "25"])
    assert a.compile and a.compile_mode == "reduce-overhead" and a.timing_skip == 25
    b = train.parse_args([])
    assert not b.compile and b.compile_mode is None and b.timing_skip == 1
    assert train._timing_note(1) == "after the first step, which includes compile / warm-up"
    assert train._timing_note(25) == "after the first 25 steps, which include compile / warm-up"


def test_train_example_bad_arguments_torchrun():
    """Under torchrun (2 gloo ranks): a sequence length that sequence parallelism cannot split, and a --tp that
    does not divide the world, each fail up front with one line from rank 0 (not a gloo abort on every rank)."""
    proc = _run_torchrun(2, "--seq-len", "127")
    _assert_one_line_error(proc, "--seq-len 127 is not divisible by --tp 2", "--no-sequence-parallel")
    assert "SIGABRT" not in proc.stderr
    proc = _run_torchrun(2, "--tp", "4", "--heads", "8", "--kv-heads", "4")
    _assert_one_line_error(proc, "world size 2 is not divisible by --tp 4")


def test_plot_losses_moving_average_and_saved_run(tmp_path):
    """examples/plot_losses.py: centred moving average where the window is full; redraws the saved 2xH200 run."""
    sys.path.insert(0, str(ROOT / "examples"))
    import plot_losses

    xs = [float(i * i % 7) for i in range(20)]
    steps, ys = plot_losses.moving_average(xs, 5)
    assert steps == list(range(3, 19))
    for s, y in zip(steps, ys):
        assert y == pytest.approx(sum(xs[s - 3:s + 2]) / 5)
    assert plot_losses.smoothing_window(1200) == 49 and plot_losses.smoothing_window(120) == 5
    assert plot_losses.smoothing_window(3) == 1
    payload = json.loads((ROOT / "docs" / "results" / "train_2xh200_losses.json").read_text())
    png = plot_losses.plot(payload, tmp_path / "loss.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_seed_spread_summary_from_finished_runs(tmp_path, capsys):
    """examples/seed_spread.py reads finished seeds back (same flags) and compares the gaps with bf16's range."""
    sys.path.insert(0, str(ROOT / "examples"))
    import seed_spread

    vals = {0: (2.00, 2.01), 1: (2.04, 2.03), 2: (2.02, 2.02)}  # bf16 range 2% of the mean, gaps within
    for seed, (b, f) in vals.items():
        out = tmp_path / f"seed{seed}"
        out.mkdir()
        argv = ["--steps", "7", "--seed", str(seed), "--out", str(out)]
        payload = {"argv": argv, "runs": {"bf16": {"val_loss": b}, "fp8": {"val_loss": f}}}
        (out / "losses.json").write_text(json.dumps(payload))
    summary = seed_spread.main(["--seeds", "0", "1", "2", "--out", str(tmp_path), "--", "--steps", "7"])
    assert summary["bf16"]["range_pct"] == pytest.approx(100 * 0.04 / 2.02)
    gaps = [100 * (f - b) / b for b, f in vals.values()]
    assert summary["mean_gap_pct"] == pytest.approx(sum(gaps) / 3)
    assert summary["gap_inside_bf16_range"] is True
    assert "beside bf16's seed-to-seed range 1.98%" in capsys.readouterr().out
    assert json.loads((tmp_path / "spread.json").read_text())["val_loss"]["1"] == {"bf16": 2.04, "fp8": 2.03}


def test_seed_spread_bf16_alone_beside_the_main_runs_gap(tmp_path, capsys):
    """The GPU main job's check: bf16 alone over three seeds (``--mode bf16`` reaches train.py), its spread printed
    beside the fp8 gap of the main run's losses.json (``--gap-from``); a gap larger than bf16's range is outside."""
    sys.path.insert(0, str(ROOT / "examples"))
    import seed_spread

    for seed, b in {0: 0.930, 1: 0.932, 2: 0.931}.items():  # bf16 range 0.2% / 0.931
        out = tmp_path / f"seed{seed}"
        out.mkdir()
        argv = ["--steps", "7", "--mode", "bf16", "--seed", str(seed), "--out", str(out)]
        (out / "losses.json").write_text(json.dumps({"argv": argv, "runs": {"bf16": {"val_loss": b}}}))
    main_run = tmp_path / "main.json"
    main_run.write_text(json.dumps({"runs": {"bf16": {"val_loss": 0.9300}, "fp8": {"val_loss": 0.9256}}}))
    summary = seed_spread.main(["--seeds", "0", "1", "2", "--mode", "bf16", "--gap-from", str(main_run),
                                "--out", str(tmp_path), "--", "--steps", "7"])
    gap = 100 * (0.9256 - 0.9300) / 0.9300  # -0.473%
    assert summary["mean_gap_pct"] == pytest.approx(gap)
    assert summary["bf16"]["range_pct"] == pytest.approx(100 * 0.002 / 0.931)
    assert summary["gap_inside_bf16_range"] is False
    out = capsys.readouterr().out
    assert f"fp8 gap {gap:+.2f}% (of {main_run}) beside bf16's seed-to-seed range 0.21%" in out and "outside" in out


@pytest.mark.parametrize("extra", [("--shared-expert",), ("--compile",)], ids=["eager", "compiled"])
def test_train_example_moe_runs(tmp_path, extra):
    # MoE MLPs (4 experts, top-2): both runs train, the fp8 run's experts use fp8 grouped GEMMs and track bf16.
    # "eager" adds a shared expert; "compiled" (--compile) compiles each block around its eagerly run grouped
    # experts (examples/llama.py, exclude_experts_from_compile)
    pytest.importorskip("matplotlib")  # loss_curve.png
    steps = 8
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(TRAIN),
        "--device", "cpu", "--tp", "1", "--mode", "both", "--steps", str(steps), "--moe", "--experts", "4",
        "--top-k", "2", *extra, "--dim", "64", "--layers", "1", "--heads", "4", "--kv-heads", "2",
        "--seq-len", "32", "--batch-size", "4", "--lr", "3e-3", "--warmup", "2", "--timing-skip", "1",
        "--val-batches", "1", "--max-bytes", "100000", "--out", str(tmp_path),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"train.py --moe {extra} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    m = FINAL_RE.search(proc.stdout)
    assert m, proc.stdout[-3000:]
    bf16_val, fp8_val, gap = map(float, m.groups())
    runs = json.loads((tmp_path / "losses.json").read_text())["runs"]
    for name, r in runs.items():
        losses = r["train_loss"]
        assert len(losses) == steps and all(math.isfinite(x) for x in losses), name
        assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2, name  # learning
    assert abs(gap) < 5.0  # fp8 experts track bf16 at this scale


def test_train_example_moe_needs_tp1():
    _assert_one_line_error(_run_plain("--tp", "2", "--moe"),
                           "--moe runs with --tp 1 (data parallel FSDP2; the experts have no tensor-parallel plan), "
                           "got --tp 2")
