"""Resyncs under ``sync.policy=ess`` against fixed intervals, async with the discrepancy-lag correction.

    OMP_NUM_THREADS=1 .venv/bin/python bench/resync_ess_vs_interval.py [--steps 60] [--target 0.5]

Every run is the embedded default with ``sync=async correction=dlc`` (one step of generation in flight)
and one resync policy: ``ess`` (push when the lag ratio's ESS/N falls below ``sync.ess_threshold``,
0.5) or ``interval`` every k steps. ``sync.max_staleness`` is raised to 16 so the interval, not the hard
bound, decides. For each run: resyncs over the run, the reward of the first and last 10 steps, and the
first step at which the 10-step moving average of the reward reaches ``--target``, with the resyncs
spent until then: fewer resyncs to the same reward is what the ESS rule is for.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from async_vs_sync import train_rows

POLICIES = {
    "ess (ESS/N < 0.5)": ["sync.policy=ess"],
    "interval 1": ["sync.policy=interval", "sync.interval=1"],
    "interval 2": ["sync.policy=interval", "sync.interval=2"],
    "interval 4": ["sync.policy=interval", "sync.interval=4"],
    "interval 8": ["sync.policy=interval", "sync.interval=8"],
}


def summary(rows: list[dict[str, float]], target: float) -> dict[str, float | None]:
    rewards = [r["reward/mean"] for r in rows]
    moving = [statistics.mean(rewards[max(0, i - 9) : i + 1]) for i in range(len(rewards))]
    reached = next((i for i, m in enumerate(moving) if i >= 9 and m >= target), None)
    return {
        "resyncs": rows[-1]["sync/resyncs"],
        "reward_first10": statistics.mean(rewards[:10]),
        "reward_last10": statistics.mean(rewards[-10:]),
        "step_reaching_target": reached,
        "resyncs_to_target": None if reached is None else rows[reached]["sync/resyncs"],
        "wall_s": sum(r["time/step"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--target", type=float, default=0.5)
    parser.add_argument("overrides", nargs="*", help="config overrides applied to every run")
    args = parser.parse_args()
    common = ["sync=async", "correction=dlc", "sync.max_staleness=16", *args.overrides]
    print(f"target: 10-step mean reward >= {args.target}\n")
    print(
        "| policy | resyncs | reward, first 10 | reward, last 10 | step reaching target | resyncs by then |"
    )
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, extra) in enumerate(POLICIES.items()):
            s = summary(train_rows(Path(tmp), f"run{i}", args.steps, [*common, *extra]), args.target)
            print(
                f"| {label} | {s['resyncs']:.0f} | {s['reward_first10']:.3f} | {s['reward_last10']:.3f} "
                f"| {s['step_reaching_target'] if s['step_reaching_target'] is not None else 'not reached'} "
                f"| {s['resyncs_to_target'] if s['resyncs_to_target'] is not None else '-'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
