"""Samples per second of ``sync.mode=sync`` against ``sync.mode=async``, same run, side by side.

    OMP_NUM_THREADS=1 .venv/bin/python bench/async_vs_sync.py [--steps 15] [--reps 1] [override ...]

Runs the real ``rlfw train`` (local Ray, DeepSpeed, object-store weight sync) once per mode and rep, with
the same overrides; async uses ``sync.policy=every_step``, so the only difference is that step s + 1's
generation runs while step s trains (one version of staleness). Throughput is generated samples over the
wall time of every step but the first (which carries the one-off compile and the first generation),
summed over steps from ``time/step`` in metrics.jsonl. Alternating the modes across reps spreads drift in
machine load over both. Reward at equal wall time: the mean reward of the last 10 steps each mode had
completed when the faster-finishing run ended (cumulative ``time/step``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rlfw.distributed.cluster import SUBPROCESS_ENV

ENV = SUBPROCESS_ENV
MODES = {"sync": ["sync=sync"], "async": ["sync=async", "sync.policy=every_step"]}


def train_rows(root: Path, name: str, steps: int, overrides: list[str]) -> list[dict[str, float]]:
    """One ``rlfw train`` (W&B off); returns its metrics.jsonl rows."""
    cmd = [
        str(Path(sys.executable).with_name("rlfw")),
        "train",
        f"logger.run_root={root}",
        f"logger.run_name={name}",
        f"trainer.steps={steps}",
        "logger.wandb=false",
        *overrides,
    ]
    subprocess.run(cmd, env=os.environ | ENV, check=True, capture_output=True)
    return [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]


def reward_by(rows: list[dict[str, float]], seconds: float) -> float:
    """Mean reward of the last 10 steps completed within ``seconds`` of cumulative step time."""
    elapsed, done = 0.0, []
    for r in rows:
        elapsed += r["time/step"]
        if elapsed > seconds:
            break
        done.append(r["reward/mean"])
    return statistics.mean(done[-10:]) if done else float("nan")


def run_mode(root: Path, name: str, steps: int, overrides: list[str]) -> dict[str, Any]:
    """One ``rlfw train``; returns samples/s, the median step and the median time the driver waited for
    generation (after the first step)."""
    rows = train_rows(root, name, steps, overrides)[1:]
    return {
        "rows": rows,
        "wall_s": sum(r["time/step"] for r in rows),
        "samples_per_s": sum(r["reward/samples"] for r in rows) / sum(r["time/step"] for r in rows),
        "step_s": statistics.median(r["time/step"] for r in rows),
        "wait_generate_s": statistics.median(r["time/generate"] for r in rows),
        "train_s": statistics.median(r["time/train"] for r in rows),
        "reward_last5": statistics.mean(r["reward/mean"] for r in rows[-5:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="config overrides applied to both modes")
    args = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for rep in range(args.reps):
            for mode, extra in MODES.items():
                results[mode].append(run_mode(root, f"{mode}{rep}", args.steps, [*args.overrides, *extra]))
    equal_wall = min(r["wall_s"] for reps in results.values() for r in reps)
    print(
        "| mode | samples/s | step (s) | wait for generation (s) | train (s) | reward, last 5 steps "
        f"| reward at {equal_wall:.0f} s |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode, reps in results.items():
        med = {k: statistics.median(r[k] for r in reps) for k in reps[0] if k != "rows"}
        at_wall = statistics.median(reward_by(r["rows"], equal_wall) for r in reps)
        print(
            f"| {mode} | {med['samples_per_s']:.1f} | {med['step_s']:.3f} | {med['wait_generate_s']:.3f} "
            f"| {med['train_s']:.3f} | {med['reward_last5']:.3f} | {at_wall:.3f} |"
        )
    speedup = statistics.median(r["samples_per_s"] for r in results["async"]) / statistics.median(
        r["samples_per_s"] for r in results["sync"]
    )
    print(f"\nasync / sync samples per second: {speedup:.2f}x")


if __name__ == "__main__":
    main()
