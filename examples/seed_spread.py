"""Is fp8's val-loss gap larger than bf16's own seed-to-seed spread? Runs ``examples/train.py`` once per seed.

Each seed changes the initial weights and the training batches (the validation batches stay the same), and
trains bf16 and fp8 from the same start on the same batches. The summary compares fp8's gap with the range
of bf16's final val loss over the seeds::

    python examples/seed_spread.py --seeds 0 1 2                   # the quick-start run, 3 seeds (4 CPU ranks)
    python examples/seed_spread.py --seeds 0 1 2 --nproc 2 -- --tp 2 --steps 1200 ...   # any train.py flags

The GPU main job (the README's one-GPU command; ``bash benchmarks/run_gpu.sh train train-seeds``): bf16 alone
over three seeds, its spread printed beside the fp8 gap of the main run's ``losses.json``::

    python examples/seed_spread.py --seeds 0 1 2 --nproc 1 --mode bf16 --gap-from out/train/losses.json \
        -- --tp 1 --device cuda --compile --cuda-graph --steps 1200 ...      # the README's GPU flags

Finished seeds are read back from ``--out``/seed<N>/losses.json when that run used the same flags, so an
interrupted sweep resumes. The summary is also written to ``--out``/spread.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

TRAIN = Path(__file__).resolve().parent / "train.py"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="values of train.py's --seed")
    p.add_argument("--nproc", type=int, default=4, help="ranks (torchrun --nproc-per-node)")
    p.add_argument("--out", default="out/spread", help="directory for one sub-directory per seed")
    p.add_argument("--mode", choices=("both", "bf16"), default="both",
                   help="bf16: train bf16 alone per seed (its spread), the fp8 gap coming from --gap-from")
    p.add_argument("--gap-from", default=None, metavar="LOSSES_JSON",
                   help="a train.py losses.json of a bf16 + fp8 run: its gap is printed beside bf16's spread")
    p.add_argument("train_args", nargs="*", help="further train.py flags, after `--`")
    args = p.parse_args(argv)
    if len(args.seeds) < 2:
        p.error("a spread needs at least 2 seeds")
    if args.mode != "both":
        args.train_args = [*args.train_args, "--mode", args.mode]
    return args


def gap_of(path) -> float:
    """fp8's val-loss gap in % of bf16's (``(fp8 - bf16) / bf16``) of a ``train.py`` ``losses.json``."""
    runs = json.loads(Path(path).read_text())["runs"]
    return 100 * (runs["fp8"]["val_loss"] - runs["bf16"]["val_loss"]) / runs["bf16"]["val_loss"]


def run_seed(seed: int, args) -> dict:
    out = Path(args.out) / f"seed{seed}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           str(TRAIN), *args.train_args, "--seed", str(seed), "--out", str(out)]
    done = out / "losses.json"
    if done.exists():
        payload = json.loads(done.read_text())
        if payload.get("argv") == cmd[cmd.index(str(TRAIN)) + 1:]:
            print(f"seed {seed}: reusing {done}", flush=True)
            return payload
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=dict(os.environ))
    return json.loads(done.read_text())


def main(argv=None) -> dict:
    args = parse_args(argv)
    rows = {}
    for seed in args.seeds:
        runs = run_seed(seed, args)["runs"]
        rows[seed] = {name: r["val_loss"] for name, r in runs.items()}
    both = args.mode == "both"
    print(f"\n{'seed':>4}  {'bf16':>7}" + (f"  {'fp8':>7}  {'gap':>7}" if both else ""))
    for seed, r in rows.items():
        gap = 100 * (r["fp8"] - r["bf16"]) / r["bf16"] if "fp8" in r and "bf16" in r else float("nan")
        print(f"{seed:>4}  {r.get('bf16', float('nan')):7.4f}"
              + (f"  {r.get('fp8', float('nan')):7.4f}  {gap:+6.2f}%" if both else ""))
    summary = {"seeds": args.seeds, "train_args": args.train_args, "val_loss": rows}
    for name in ("bf16", "fp8"):
        vals = [r[name] for r in rows.values() if name in r]
        if len(vals) >= 2:
            mean = statistics.fmean(vals)
            summary[name] = {"mean": mean, "range_pct": 100 * (max(vals) - min(vals)) / mean,
                             "stdev_pct": 100 * statistics.stdev(vals) / mean}
            print(f"{name}: mean {mean:.4f}, seed-to-seed range {summary[name]['range_pct']:.2f}% "
                  f"(stdev {summary[name]['stdev_pct']:.2f}%) of the mean")
    gaps = [100 * (r["fp8"] - r["bf16"]) / r["bf16"] for r in rows.values() if "fp8" in r and "bf16" in r]
    if args.gap_from:
        gaps = [gap_of(args.gap_from)]
        summary["gap_from"] = args.gap_from
    if gaps and "bf16" in summary:
        mean_gap = statistics.fmean(gaps)
        inside = abs(mean_gap) <= summary["bf16"]["range_pct"]
        summary["mean_gap_pct"], summary["gap_inside_bf16_range"] = mean_gap, inside
        where = (f"of {args.gap_from}" if args.gap_from else
                 f"mean over {len(gaps)} seeds (per seed {min(gaps):+.2f}% to {max(gaps):+.2f}%)")
        print(f"fp8 gap {mean_gap:+.2f}% ({where}) beside bf16's seed-to-seed range "
              f"{summary['bf16']['range_pct']:.2f}% (stdev {summary['bf16']['stdev_pct']:.2f}%): "
              f"{'inside' if inside else 'outside'} it")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "spread.json").write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
