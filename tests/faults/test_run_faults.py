"""Faults around a run, end to end: the driver killed or stopped, a trainer rank lost, a diverging run.
Each test asserts the promise: the exit code, the one line that says what happened, and that nothing was
lost or counted twice (metrics compared with an uninterrupted run, without the time keys).

If one of these breaks, a fault a cluster delivers every day (SIGTERM from SLURM, a rank lost to the OOM
killer) loses the steps since the last checkpoint or leaves the user with a traceback and no way on.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.train._run import (
    SMALL,
    command,
    comparable,
    env,
    kill_a_trainer_rank,
    kill_an_engine,
    run_train,
    run_until,
    session_processes,
    state_step_at_least,
    steps_logged_at_least,
    trainer_ranks,
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run root per module, so the cached warm start is built once."""
    return tmp_path_factory.mktemp("runs")


@pytest.mark.slow
def test_resume_after_kill_gives_the_same_metrics(root: Path) -> None:
    args = [*SMALL, "trainer.steps=6", "trainer.checkpoint_every=2"]
    whole = run_train(root, "whole", *args)
    assert whole.returncode == 0, whole.log[-3000:]
    killed = run_until(root, "killed", args, state_step_at_least(3), signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    resumed = run_train(root, "killed", *args, "resume=true")
    assert resumed.returncode == 0, resumed.log[-3000:]
    after = resumed.metrics()
    assert [r["step"] for r in after] == list(range(6))
    for a, b in zip(whole.metrics()[4:], after[4:], strict=True):
        assert comparable(a) == comparable(b)


@pytest.mark.slow
def test_a_run_resumes_at_the_zero_stage_its_checkpoint_was_written_at(root: Path) -> None:
    """A run checkpointed at ZeRO stage 1 (the one-rank default of earlier versions): resumed with the
    stage unset it continues at stage 1 with the metrics of an uninterrupted run; resumed at stage 0,
    which cannot load that optimizer state, it stops with the fix before writing anything; a resume
    refused by a later check leaves the run's files as they were too."""
    args = [*SMALL, "trainer.steps=4", "trainer.checkpoint_every=2"]
    whole = run_train(root, "whole_stage1", *args, "trainer.zero_stage=1")
    assert whole.returncode == 0, whole.log[-3000:]
    first = run_train(root, "stage1", *SMALL, "trainer.steps=2", "trainer.zero_stage=1")
    assert first.returncode == 0, first.log[-3000:]

    def files() -> dict[str, bytes]:
        return {f.name: f.read_bytes() for f in first.run_dir.iterdir() if f.is_file()}

    written = files()
    refused = run_train(root, "stage1", *args, "trainer.zero_stage=0", "resume=true")
    assert refused.returncode == 2, refused.log[-3000:]
    assert "written at ZeRO stage 1" in refused.log and "resume with trainer.zero_stage=1" in refused.log
    assert "Traceback" not in refused.log
    assert files() == written
    # refused by a check that runs after the run's records were rewritten: they are put back
    skipping = ["kernels=default", "engine.prefill_fraction=0.5"]  # no contract to skip prefills under
    refused = run_train(root, "stage1", *args, *skipping, "resume=true")
    assert refused.returncode == 2 and "engine.prefill_fraction=0.5 skips the prefill stream" in refused.log
    assert files() == written
    resumed = run_train(root, "stage1", *args, "resume=true")
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert "DeepSpeed ZeRO stage 1" in resumed.log
    after = resumed.metrics()
    assert [r["step"] for r in after] == list(range(4))
    for a, b in zip(whole.metrics(), after, strict=True):
        assert comparable(a) == comparable(b)


@pytest.mark.slow
def test_a_dead_trainer_rank_stops_the_run_with_the_resume_command(root: Path) -> None:
    """A trainer rank killed mid-run (two ranks; the survivor is stuck in a collective): one line naming
    the rank and the command that continues the run, exit 1, no traceback; that command then finishes
    the run with the metrics of an uninterrupted one."""
    args = [*SMALL, "trainer.num_ranks=2", "trainer.steps=6", "trainer.checkpoint_every=2"]
    whole = run_train(root, "whole_2ranks", *args)
    assert whole.returncode == 0, whole.log[-3000:]
    dead = run_until(root, "rank_died", args, state_step_at_least(1), 0, act=kill_a_trainer_rank)
    assert dead.returncode == 1, dead.log[-3000:]
    (line,) = [line for line in dead.log.splitlines() if "rlfw train: trainer rank" in line]
    assert " died during " in line and "continue the run from the checkpoint of step" in line
    assert "Traceback" not in dead.log
    command = shlex.split(line.split(" with: ", 1)[1])
    assert command[:2] == ["rlfw", "train"] and command[-1] == "resume=true"
    resumed = subprocess.run(
        [str(Path(sys.executable).with_name("rlfw")), *command[1:]],
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = dead.metrics()
    assert [r["step"] for r in after] == list(range(6))
    for a, b in zip(whole.metrics(), after, strict=True):
        assert comparable(a) == comparable(b)


@pytest.mark.slow
def test_a_dead_engine_under_the_collective_transport_is_replaced_and_the_run_goes_on(root: Path) -> None:
    """An engine killed mid-run is replaced at the last published version, and the run ends with the
    metrics of an uninterrupted one (but for the restart count). Where the kill lands is not fixed: in a
    generation, the driver replaces the engine when it collects; between phases, the next weight broadcast
    finds it dead (tests/faults/test_collective_sync_faults.py pins that case)."""
    args = [*SMALL, "trainer.steps=4", "engine.num_actors=2", "sync.transport=collective"]
    whole = run_train(root, "whole_collective", *args)
    assert whole.returncode == 0, whole.log[-3000:]
    lost = run_until(root, "engine_died", args, steps_logged_at_least(1), 0, act=kill_an_engine)
    assert lost.returncode == 0, lost.log[-3000:]
    after = lost.metrics()
    assert [r["step"] for r in after] == list(range(4))
    assert after[-1]["sync/engine_restarts"] == 1
    for a, b in zip(whole.metrics(), after, strict=True):
        assert without_restarts(a) == without_restarts(b)


def without_restarts(row: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in comparable(row).items() if k != "sync/engine_restarts"}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "code", "said"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated (SIGTERM)")],
    ids=["ctrl-c", "sigterm"],
)
def test_ctrl_c_and_sigterm_save_a_checkpoint_and_exit_cleanly(
    root: Path, sig: int, code: int, said: str
) -> None:
    """SIGTERM is what SLURM and Kubernetes send before killing a job. The run cannot end before the
    signal lands (it has far more steps than the test waits for): the test waits on its state."""
    name = f"stopped_{code}"
    overrides = [*SMALL, "trainer.steps=100000", "trainer.checkpoint_every=100000"]
    run = run_until(root, name, overrides, steps_logged_at_least(2), sig)
    assert run.returncode == code, run.log[-3000:]
    assert f"{said}: saving a checkpoint" in run.log
    state = json.loads((run.run_dir / "run_state.json").read_text())
    assert state["tag"].startswith("step") and state["step"] >= 1
    assert len(run.metrics()) == state["step"] + 1  # every logged step is in the checkpoint


@pytest.mark.slow
def test_a_diverging_run_skips_its_updates_and_stops_with_the_fix(root: Path) -> None:
    """``trainer.lr=1e38``: the first update takes the weights near fp32's largest value, the forward
    overflows and the gradients are no longer finite; those updates are skipped (said in the log and in
    each step's row) and the third in a row stops the run, exit 1. (At ``lr=1e3`` the model collapses
    to a uniform output instead, whose gradients are exactly zero: finite, so nothing to skip.)"""
    run = run_train(root, "diverge", *SMALL, "trainer.lr=1e38", "trainer.steps=12")
    assert run.returncode == 1, run.log[-3000:]
    assert "steps in a row had non-finite gradients" in run.log and "lower trainer.lr" in run.log
    rows = run.metrics()
    skipped = [r["step"] for r in rows if r.get("train/skipped_nonfinite") == 1.0]
    assert len(skipped) == 3 and skipped == list(range(skipped[0], skipped[0] + 3))
    assert rows[-1]["step"] == skipped[-1] < 11


@pytest.mark.slow
def test_a_killed_driver_leaves_no_ray_process_behind(root: Path) -> None:
    """SIGKILL to the driver alone (not its process group): every process of its local Ray goes too,
    without waiting for Ray's agents to time out; then ``resume=true`` continues the run."""
    args = [*SMALL, "trainer.steps=1000", "trainer.checkpoint_every=2"]
    log = (root / "driver_killed.log").open("w")
    proc = subprocess.Popen(
        command(root, "driver_killed", args),
        env=env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        ready = state_step_at_least(1)
        while proc.poll() is None and not ready(root / "driver_killed"):
            time.sleep(0.1)
        assert trainer_ranks(proc.pid), "the run's Ray is up"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 90  # a bound for a failing test; the reaper scans every second
        while session_processes(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert session_processes(proc.pid) == []
    finally:
        log.close()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    more = ["trainer.steps=4", "trainer.checkpoint_every=2", "resume=true"]
    resumed = run_train(root, "driver_killed", *SMALL, *more)
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert [r["step"] for r in resumed.metrics()] == list(range(4))


@pytest.mark.slow
def test_two_runs_started_together_get_their_own_folders_and_both_complete(tmp_path: Path) -> None:
    """Two unnamed runs of one config started at once in one run root (the same second, the same
    warm-start cache): separate folders, each with its own metrics (identical, as the config is), both
    exit 0."""
    procs = [
        subprocess.Popen(
            [str(Path(sys.executable).with_name("rlfw")), "train", f"logger.run_root={tmp_path}", *SMALL]
            + ["trainer.steps=2"],
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for _ in range(2)
    ]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [log[-2000:] for log in logs]
    folders = sorted(f for f in tmp_path.iterdir() if f.is_dir() and not f.name.startswith("."))
    assert len(folders) == 2
    rows = [[json.loads(line) for line in (f / "metrics.jsonl").read_text().splitlines()] for f in folders]
    assert [[r["step"] for r in run] for run in rows] == [[0, 1], [0, 1]]
    assert [comparable(r) for r in rows[0]] == [comparable(r) for r in rows[1]]  # same config, same run
