"""Wall time of a whole short ``rlfw train`` (start-up, steps, shut-down) at this checkout against another
revision, alternated run by run.

    .venv/bin/python bench/startup_ab.py --rev HEAD~2 [--reps 4] [--steps 3] [-- OVERRIDE ...]

The other revision is checked out into a temporary git worktree and run with this checkout's virtual
environment, its package put first on ``PYTHONPATH`` (Ray passes that on to the actors). Both sides run
the embedded default (a fresh ``logger.run_root`` per side, warm-started once before timing) with
``trainer.steps=--steps``; a short run is mostly start-up: imports, Ray, actors, W&B, shut-down. Prints
the median wall seconds per side and the median of the paired ratios, then one JSON line.
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

sys.path.insert(0, str(Path(__file__).parent))
import machine  # noqa: E402
from revision_ab import other_revision  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def timed_run(code_root: Path, run_root: Path, steps: int, overrides: list[str]) -> float:
    """Seconds of one ``rlfw train`` whose ``rlfw`` package comes from ``code_root``."""
    env = os.environ | {"PYTHONPATH": str(code_root), "RLFW_PROGRESS": "0"}
    # `python -m rlfw`: each side's own entry point (the installed `rlfw` script names this checkout's)
    args = [
        sys.executable,
        "-m",
        "rlfw",
        "train",
        f"trainer.steps={steps}",
        f"logger.run_root={run_root}",
        *overrides,
    ]
    t0 = time.perf_counter()
    out = subprocess.run(args, cwd=code_root, env=env, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{code_root}: rlfw train exited {out.returncode}:\n{out.stderr[-3000:]}")
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", required=True, help="the other revision (B)")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("overrides", nargs="*", help="config overrides for both sides")
    a = p.parse_args()
    folder = tempfile.TemporaryDirectory(prefix="rlfw-startup-")
    tmp = Path(folder.name)
    with folder, other_revision(a.rev, tmp) as other:
        sides = {"this": ROOT, a.rev: other}
        runs = {name: tmp / f"runs-{i}" for i, name in enumerate(sides)}
        for name, code in sides.items():  # warm start cached, extension built: not timed
            timed_run(code, runs[name], 1, a.overrides)
        times: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(a.reps):
            for name, code in sides.items():
                times[name].append(timed_run(code, runs[name], a.steps, a.overrides))
    ratios = [x / y for x, y in zip(times["this"], times[a.rev], strict=True)]
    for name, t in times.items():
        print(f"{name:>10}: median {statistics.median(t):6.2f} s  ({', '.join(f'{x:.2f}' for x in t)})")
    print(f"this / {a.rev}: median of paired ratios {statistics.median(ratios):.3f}")
    record = {"machine": machine.describe(), "rev": a.rev, "steps": a.steps, "overrides": a.overrides}
    print(json.dumps(record | {"seconds": times, "ratios": ratios}))


if __name__ == "__main__":
    main()
