"""Wall time of a local sweep run one job at a time against ``launcher.parallel=2``, the same jobs.

    .venv/bin/python bench/sweep_parallel.py [--rounds 2] [--out FILE] [sweep override ...]

Default sweep (overrides given replace it): a corner of experiment 1 (``recipes/experiments/
discrepancy_lag.yaml``), 4 jobs of 40 steps: the ``none`` discrepancy, sync and pushes every 4 steps, no
correction, seeds 0 and 1. Each round runs the sweep once per setting, alternating which goes first, each
in a fresh folder, and times the whole ``rlfw train -m`` process. Also checks that both settings logged
the same values (every metric but the timings and memory readings), which is what lets experiments run
their jobs two at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlfw.distributed.cluster import SUBPROCESS_ENV
from rlfw.logging.compare import sweep_runs

SWEEP = [
    "recipe=experiments/discrepancy_lag",
    "+experiment/discrepancy=none",
    "+experiment/lag=sync,async4",
    "correction=none",
    "seed=0,1",
]
MACHINE_DEPENDENT = ("time/", "throughput/", "memory/")


def run_sweep(root: Path, name: str, parallel: int, overrides: list[str]) -> float:
    """One ``rlfw train -m``; returns its wall seconds."""
    rlfw = str(Path(sys.executable).with_name("rlfw"))
    cmd = [rlfw, "train", "-m", *overrides, f"logger.run_root={root}", f"logger.run_name={name}"]
    start = time.perf_counter()
    subprocess.run([*cmd, f"launcher.parallel={parallel}"], env=os.environ | SUBPROCESS_ENV, check=True)
    return time.perf_counter() - start


def logged_values(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """Each job's metrics rows without the machine-dependent keys."""
    return {
        run.name: [{k: v for k, v in row.items() if not k.startswith(MACHINE_DEPENDENT)} for row in run.rows]
        for run in sweep_runs(folder)
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args, overrides = parser.parse_known_args()
    overrides = overrides or SWEEP
    walls: dict[int, list[float]] = {1: [], 2: []}
    same = True
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = (1, 2) if r % 2 == 0 else (2, 1)
            for parallel in order:
                walls[parallel].append(run_sweep(Path(tmp), f"r{r}p{parallel}", parallel, overrides))
                print(f"round {r} parallel={parallel}: {walls[parallel][-1]:.1f} s", flush=True)
            same &= logged_values(Path(tmp) / f"r{r}p1") == logged_values(Path(tmp) / f"r{r}p2")
    ratios = [a / b for a, b in zip(walls[1], walls[2], strict=True)]
    result = {
        "sweep": overrides,
        "wall_s": {f"parallel={p}": w for p, w in walls.items()},
        "median_wall_s": {f"parallel={p}": statistics.median(w) for p, w in walls.items()},
        "speedup_per_round": ratios,
        "same_logged_values": same,
        "cpus": os.cpu_count(),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
