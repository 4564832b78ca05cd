"""Run ``rlfw train`` as a subprocess (its own Ray, its own process group) and read what it wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfw.distributed.cluster import SUBPROCESS_ENV

# A small, fast configuration of the embedded default for tests that check plumbing, not learning.
SMALL = ["algo.prompts_per_step=4", "algo.group_size=4", "task.warm_start_steps=20", "logger.wandb=false"]


SCALAR_KEYS_THAT_VARY = ("time/", "throughput/", "memory/")


def comparable(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row without the keys that depend on the machine's speed and memory use."""
    return {k: v for k, v in row.items() if not k.startswith(SCALAR_KEYS_THAT_VARY)}


@dataclass
class Run:
    returncode: int
    log: str
    run_dir: Path

    def metrics(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]


def command(root: Path, name: str, overrides: list[str]) -> list[str]:
    rlfw = str(Path(sys.executable).with_name("rlfw"))
    return [rlfw, "train", f"logger.run_root={root}", f"logger.run_name={name}", *overrides]


def env() -> dict[str, str]:
    return os.environ | SUBPROCESS_ENV


def run_train(root: Path, name: str, *overrides: str, timeout: float = 600) -> Run:
    out = subprocess.run(
        command(root, name, list(overrides)),
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )
    return Run(out.returncode, out.stdout + out.stderr, root / name)


def trainer_ranks(driver_pid: int) -> list[int]:
    """The pids of a run's trainer rank processes."""
    return _workers(driver_pid, "ray::TrainerWorker")


def engine_actors(driver_pid: int) -> list[int]:
    """The pids of a run's rollout actor processes."""
    return _workers(driver_pid, "ray::RolloutWorker")


def _workers(driver_pid: int, title: str) -> list[int]:
    """Ray's workers of the run's own session (the driver leads it) whose title starts with ``title``."""
    out = subprocess.run(["ps", "-eo", "pid=,sid=,args="], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        pid, sid, args = line.split(maxsplit=2)
        if int(sid) == driver_pid and args.startswith(title):
            found.append(int(pid))
    return found


def session_processes(driver_pid: int) -> list[str]:
    """``pid args`` of every process left in the session the driver led (its Ray included)."""
    out = subprocess.run(["ps", "-eo", "pid=,sid=,args="], capture_output=True, text=True, check=True).stdout
    rows = [line.split(maxsplit=2) for line in out.splitlines()]
    mine = [r for r in rows if int(r[1]) == driver_pid and int(r[0]) != driver_pid]
    return [f"{r[0]} {r[2] if len(r) > 2 else ''}" for r in mine]


def kill_a_trainer_rank(driver_pid: int) -> None:
    """SIGKILL one trainer rank of the run (a rank lost to the OOM killer or a failed node)."""
    ranks = trainer_ranks(driver_pid)
    assert ranks, "the run has no trainer rank process to kill"
    os.kill(ranks[-1], signal.SIGKILL)


def kill_an_engine(driver_pid: int) -> None:
    """SIGKILL one rollout actor of the run (an engine lost to the OOM killer)."""
    engines = engine_actors(driver_pid)
    assert engines, "the run has no rollout actor process to kill"
    os.kill(engines[0], signal.SIGKILL)


def run_until(
    root: Path,
    name: str,
    overrides: list[str],
    ready: Callable[[Path], bool],
    sig: int,
    timeout: float = 600,
    act: Callable[[int], None] | None = None,
) -> Run:
    """Start a run and send ``sig`` once ``ready(run_dir)``: SIGINT to the driver alone (a user's Ctrl-C),
    SIGKILL to its whole process group (the machine going away); or, with ``act``, call it with the
    driver's pid instead (e.g. :func:`kill_a_trainer_rank`)."""
    log_path = root / f"{name}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            command(root, name, overrides),
            env=env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and proc.poll() is None:
                if ready(root / name):
                    if act is not None:
                        act(proc.pid)
                    elif sig == signal.SIGKILL:
                        os.killpg(proc.pid, sig)
                    else:
                        os.kill(proc.pid, sig)
                    break
                time.sleep(0.05)
            code = proc.wait(timeout=120)
        finally:
            _reap_group(proc.pid)  # also when the run ignored the signal: nothing of it outlives the test
    return Run(code, log_path.read_text(), root / name)


def state_step_at_least(step: int) -> Callable[[Path], bool]:
    def ready(run_dir: Path) -> bool:
        state = run_dir / "run_state.json"
        return state.is_file() and json.loads(state.read_text())["step"] >= step

    return ready


def steps_logged_at_least(n: int) -> Callable[[Path], bool]:
    def ready(run_dir: Path) -> bool:
        metrics = run_dir / "metrics.jsonl"
        return metrics.is_file() and len(metrics.read_text().splitlines()) >= n

    return ready


def _reap_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def bare_driver(run_dir: Path, *overrides: str) -> Any:
    """A :class:`~rlfw.train.phases.Driver` with the composed config and a real logger into ``run_dir``,
    and nothing else (no pools, no setup): for the loop's bookkeeping (skipped steps, non-finite ones)."""
    from typing import cast

    from rlfw.compose import load_config
    from rlfw.logging.logger import RunLogger
    from rlfw.train.phases import Driver
    from rlfw.train.state import RunState

    logger = RunLogger(run_dir, False, "disabled", "p", "r", {})
    none = cast(Any, None)
    start = RunState(-1, 0, "", 0)
    return Driver(load_config(list(overrides)), none, none, none, none, logger, run_dir, start)
