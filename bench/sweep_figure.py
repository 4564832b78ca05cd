"""A static figure of a sweep for the write-up: per metric, each group's mean over seeds with its 95% band.

    .venv/bin/python bench/sweep_figure.py SWEEP_DIR OUT.png [KEY ...] [--with SWEEP_DIR ...]

The same groups, means and intervals as ``rlfw report``'s interactive page (:mod:`rlfw.logging.compare`),
drawn with matplotlib into one small PNG that a Markdown file can show. Default keys: reward, the
KV-staleness factor, throughput.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from rlfw.logging import metrics as m  # noqa: E402
from rlfw.logging.compare import COLOURS, collect, group_curve, group_runs  # noqa: E402

DEFAULT_KEYS = (m.REWARD_MEAN, m.DECODE_KV_MAX_ABS_LOG, m.THROUGHPUT_TOKENS_PER_S)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sweep", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("keys", nargs="*", default=list(DEFAULT_KEYS))
    more = "more sweep or run folders of the same experiment, grouped with the first"
    ap.add_argument("--with", dest="more", nargs="*", type=Path, default=[], help=more)
    a = ap.parse_args()
    runs = collect([a.sweep, *a.more])
    groups = group_runs(runs)
    fig, axes = plt.subplots(1, len(a.keys), figsize=(4.2 * len(a.keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], a.keys, strict=True):
        for i, group in enumerate(groups):
            steps, means, halves = group_curve(group, key)
            colour = COLOURS[i % len(COLOURS)]
            lo = [mu - h for mu, h in zip(means, halves, strict=True)]
            hi = [mu + h for mu, h in zip(means, halves, strict=True)]
            ax.plot(steps, means, color=colour, label=f"{group.label} (n={len(group.runs)})", lw=1.4)
            ax.fill_between(steps, lo, hi, color=colour, alpha=0.18, lw=0)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    name = a.sweep.name if not a.more else f"{len(runs)} runs"
    fig.suptitle(f"{name}: group means over seeds, 95% bands", fontsize=9)
    # Below the panels, not over the first one: a group's label lists every key that differs.
    handles, labels = axes[0][0].get_legend_handles_labels()
    columns = 1 if max(map(len, labels), default=0) > 60 else min(len(labels), 3)
    fig.legend(handles, labels, loc="lower center", ncol=columns, fontsize=7, frameon=False)
    rows = -(-len(labels) // columns)
    fig.tight_layout(rect=(0, 0.045 * rows + 0.02, 1, 1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(a.out)


if __name__ == "__main__":
    main()
