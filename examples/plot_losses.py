"""Plot the loss curves that ``examples/train.py`` writes to ``losses.json``.

``train.py`` calls :func:`plot` for its ``loss_curve.png``; to redraw a saved run::

    python examples/plot_losses.py docs/results/train_2xh200_losses.json docs/img/train_2xh200_loss.png

Upper panel: each run's training loss per step (averaged over the data-parallel ranks) as a faint line, and its
centred moving average over ``window`` steps (the window is in the legend; drawn where the window is full) as a
solid / dashed line; the final
validation losses are in the legend. Lower panel (when both runs exist): the relative difference
``(fp8 - bf16) / bf16`` of the two *smoothed training* losses, in percent.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def moving_average(xs: list[float], window: int) -> tuple[list[int], list[float]]:
    """Centred moving average over ``window`` steps (odd), where the window is full.

    Returns ``(steps, values)``: 1-based step numbers ``half + 1 .. len(xs) - half`` (``half = window // 2``) and
    the mean of ``xs`` over the ``window`` steps centred on each.
    """
    half = window // 2
    csum = [0.0]
    for x in xs:
        csum.append(csum[-1] + x)
    steps = list(range(half + 1, len(xs) - half + 1))
    return steps, [(csum[s + half] - csum[s - half - 1]) / window for s in steps]


def smoothing_window(n_steps: int) -> int:
    """About 4% of the run, odd, at least 1 (e.g. 49 steps for 1200 steps, 5 for 120)."""
    w = max(1, n_steps // 25)
    return w if w % 2 else w + 1


def plot(payload: dict, path: str | Path) -> Path:
    """Draw ``payload`` (the content of a ``losses.json``) into the PNG file ``path``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, cfg = payload["runs"], payload["config"]
    both = "bf16" in runs and "fp8" in runs
    fig, axes = plt.subplots(2 if both else 1, 1, figsize=(7.5, 7 if both else 4.5), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1.4] if both else [1]})
    ax = axes[0, 0]
    style = {"bf16": ("tab:blue", "-"), "fp8": ("tab:orange", "--")}
    window = smoothing_window(max(len(r["train_loss"]) for r in runs.values()))
    for name, r in runs.items():
        color, ls = style.get(name, (None, "-"))
        steps = range(1, len(r["train_loss"]) + 1)
        ax.plot(steps, r["train_loss"], color=color, alpha=0.25, lw=0.7, label=f"{name}: training loss per step")
    for name, r in runs.items():
        color, ls = style.get(name, (None, "-"))
        steps = range(1, len(r["train_loss"]) + 1)
        ax.plot(*moving_average(r["train_loss"], window), color=color, ls=ls, lw=1.6,
                label=f"{name}: training loss, moving average over {window} steps "
                      f"(final val loss {r['val_loss']:.4f})")
    dp = payload["world_size"] // cfg["tp"]
    title = f"byte-level Llama {cfg['dim']}d x {cfg['layers']}L, dp={dp} x tp={cfg['tp']}, {cfg['steps']} steps"
    gap = payload.get("val_gap_pct")
    if gap is not None and not (isinstance(gap, float) and math.isnan(gap)):
        title += f"\nfp8 ({cfg['recipe']}) final val loss {gap:+.2f}% vs bf16"
    ax.set(ylabel="cross-entropy (nats/byte)", title=title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if both:
        steps, b = moving_average(runs["bf16"]["train_loss"], window)
        _, f = moving_average(runs["fp8"]["train_loss"], window)
        rel = [100.0 * (fv - bv) / bv for bv, fv in zip(b, f)]
        ax2 = axes[1, 0]
        ax2.plot(steps[:len(rel)], rel, color="tab:red")
        ax2.axhline(0.0, color="k", lw=0.6)
        ax2.set(ylabel="fp8 vs bf16 (%)",
                title=f"smoothed training loss: (fp8 - bf16) / bf16, moving average over {window} steps")
        ax2.title.set_fontsize(9)
        ax2.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("training step")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("losses_json", help="a losses.json written by examples/train.py")
    p.add_argument("png", help="output PNG file")
    args = p.parse_args(argv)
    print(plot(json.loads(Path(args.losses_json).read_text()), args.png))


if __name__ == "__main__":
    main()
