"""``rlfw train -m``: sweeps expand as Hydra expands them, are validated whole before any job starts, and
leave one run folder per job (and one W&B group) under one sweep folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import rlfw.sweep
from rlfw.config import ConfigError
from rlfw.sweep import SWEEP_FILE, expand, job_name, plan, run_sweep
from tests.train._run import SMALL, command, env


def test_expansion_follows_hydra_order_and_keeps_common_overrides() -> None:
    common, swept, jobs = expand(["correction=none,tis", "trainer.steps=2", "seed=range(2)"])
    assert common == ["trainer.steps=2"]
    assert swept == {"correction": ["none", "tis"], "seed": ["0", "1"]}
    assert jobs == [
        ["correction=none", "trainer.steps=2", "seed=0"],
        ["correction=none", "trainer.steps=2", "seed=1"],
        ["correction=tis", "trainer.steps=2", "seed=0"],
        ["correction=tis", "trainer.steps=2", "seed=1"],
    ]


def test_bracketed_values_are_not_split_on_their_commas() -> None:
    rewards = "task.rewards=[{ref: a.py:f, weight: 1},{ref: b.py:g, weight: 2}]"
    _, swept, jobs = expand([rewards, "seed=0,1"])
    assert swept == {"seed": ["0", "1"]} and jobs[0] == [rewards, "seed=0"]


def test_job_names_sort_in_launch_order_and_are_safe_folder_names() -> None:
    assert job_name(3, {"correction": "tis", "seed": "1"}) == "03-correction=tis,seed=1"
    assert job_name(0, {"task.data_path": "/a b/c.jsonl"}) == "00-task.data_path=_a_b_c.jsonl"
    assert job_name(7, {}) == "07"


def test_a_bad_job_refuses_the_whole_sweep_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"job .*correction=nope.*not a config option"):
        plan([f"logger.run_root={tmp_path}", "correction=none,nope"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("key", ["logger.run_root=/x,/y", "logger.group=a,b", "logger.run_name=a,b"])
def test_the_keys_that_place_a_sweep_cannot_be_swept(key: str) -> None:
    with pytest.raises(ConfigError, match="cannot be swept"):
        expand([key, "seed=0,1"])


def test_a_recipe_declares_its_sweep_and_the_command_line_replaces_a_key(tmp_path: Path) -> None:
    (tmp_path / "grid.yaml").write_text(
        "defaults:\n  - default\n  - _self_\n"
        "trainer:\n  steps: 3\n"
        "hydra:\n  sweeper:\n    params:\n      correction: none,tis,dlc\n      seed: 0,1\n"
    )
    sweep, first = plan(["-m", "--config-dir", str(tmp_path), "recipe=grid", "seed=5", "logger.run_name=g"])
    assert first.trainer.steps == 3 and first.task.warm_start_steps == 200  # over recipes/default.yaml
    assert sweep.swept == {"correction": ["none", "tis", "dlc"]}
    assert [j.name for j in sweep.jobs] == ["00-correction=none", "01-correction=tis", "02-correction=dlc"]
    assert sweep.folder == (Path("runs") / "g").resolve()
    assert all(f"--config-dir={tmp_path}" in j.overrides and "seed=5" in j.overrides for j in sweep.jobs)


def _sweep(root: Path, name: str, *overrides: str, wandb: bool = False) -> subprocess.CompletedProcess[str]:
    small = [o for o in SMALL if not o.startswith("logger.wandb=")] + [f"logger.wandb={str(wandb).lower()}"]
    cmd = command(root, name, ["-m", *small, "trainer.steps=1", "task.warm_start_steps=0", *overrides])
    return subprocess.run(
        cmd, env=env(), capture_output=True, text=True, timeout=1200, start_new_session=True
    )


@pytest.mark.slow
def test_a_2x2_sweep_makes_four_run_folders_in_one_sweep_folder(tmp_path: Path) -> None:
    out = _sweep(tmp_path, "grid", "correction=none,tis", "seed=0,1", wandb=True)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    folder = tmp_path / "grid"
    record = json.loads((folder / SWEEP_FILE).read_text())
    names = [
        "00-correction=none,seed=0",
        "01-correction=none,seed=1",
        "02-correction=tis,seed=0",
        "03-correction=tis,seed=1",
    ]
    assert [j["name"] for j in record["jobs"]] == names and all(j["exit_code"] == 0 for j in record["jobs"])
    for job, (correction, seed) in zip(
        names, [("none", 0), ("none", 1), ("tis", 0), ("tis", 1)], strict=True
    ):
        config = (folder / job / "config.yaml").read_text()
        assert f"seed: {seed}\n" in config and "group: grid" in config
        assert (folder / job / "metrics.jsonl").read_text().count("\n") == 1
        assert f"name: {correction}" in config
        assert list((folder / job / "wandb").glob("offline-run-*")), "each job is its own W&B run"


@pytest.mark.slow
def test_the_submitit_launcher_runs_the_jobs_and_records_their_exit_codes(tmp_path: Path) -> None:
    # cluster=debug: submitit's in-process executor, the same submission path as SLURM without SLURM.
    out = _sweep(tmp_path, "sub", "launcher=submitit_local", "launcher.cluster=debug", "seed=0,1")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    record = json.loads((tmp_path / "sub" / SWEEP_FILE).read_text())
    assert [(j["name"], j["exit_code"]) for j in record["jobs"]] == [("00-seed=0", 0), ("01-seed=1", 0)]
    assert "submitted as" in out.stdout


def test_cfg_job_with_a_sweep_prints_every_jobs_config(capsys: pytest.CaptureFixture[str]) -> None:
    from rlfw.cli import main

    assert main(["train", "-m", "seed=3,4", "--cfg", "job"]) == 0
    out = capsys.readouterr().out
    assert out.count("# job ") == 2 and "\nseed: 3\n" in out and "\nseed: 4\n" in out


# Stand-ins for `rlfw train` in the launcher tests: each job is a small Python process that sees its
# overrides (its name is in logger.run_name='NN-...') and a shared folder given by the test.
WAIT_FOR_EACH_OTHER = """
import pathlib, sys, time
here = pathlib.Path(sys.argv[1])
name = [a for a in sys.argv if a.startswith("logger.run_name=")][0].split("=", 1)[1].strip("'")
(here / name).touch()
print("job", name, "started", flush=True)
deadline = time.monotonic() + 60
while len(list(here.iterdir())) < 2:  # every job waits until two have started
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.01)
sys.exit(1 if name.startswith("01") else 0)
"""
STOP_THE_SWEEP = """
import os, pathlib, signal, sys
here = pathlib.Path(sys.argv[1])
name = [a for a in sys.argv if a.startswith("logger.run_name=")][0].split("=", 1)[1].strip("'")
(here / name).touch()
signal.signal(signal.SIGINT, lambda *_: sys.exit(130))  # as rlfw train does: checkpoint, exit 130
os.kill(os.getppid(), signal.SIGINT)  # the user presses Ctrl-C: the sweep, not the job, gets it
signal.pause()
sys.exit(4)  # only if a signal other than SIGINT woke the job
"""


def _stand_in(monkeypatch: pytest.MonkeyPatch, script: str, shared: Path) -> None:
    shared.mkdir()
    monkeypatch.setattr(
        rlfw.sweep, "train_command", lambda args: [sys.executable, "-c", script, str(shared), *args]
    )


def test_parallel_jobs_run_at_once_write_their_own_logs_and_record_exit_codes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each job waits until two jobs have started, so the sweep completes only if two run at once (one at
    # a time, the first job would wait out its deadline and exit 3).
    _stand_in(monkeypatch, WAIT_FOR_EACH_OTHER, tmp_path / "started")
    code = run_sweep(
        ["-m", f"logger.run_root={tmp_path}", "logger.run_name=p", "launcher.parallel=2", "seed=0,1,2,3"]
    )
    assert code == 1  # job 01 fails: the sweep says so, and the others still ran
    record = json.loads((tmp_path / "p" / SWEEP_FILE).read_text())
    assert [(j["name"], j["exit_code"]) for j in record["jobs"]] == [
        ("00-seed=0", 0),
        ("01-seed=1", 1),
        ("02-seed=2", 0),
        ("03-seed=3", 0),
    ]
    for job in record["jobs"]:
        assert (tmp_path / "p" / f"{job['name']}.log").read_text() == f"job {job['name']} started\n"
    out = capsys.readouterr().out
    assert "1 of 4 jobs failed: 01-seed=1" in out and "(4 of 4 done)" in out


def test_ctrl_c_reaches_the_running_jobs_once_and_no_other_job_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The first job presses Ctrl-C on the sweep and then waits for the SIGINT the sweep passes on; it
    # exits 130 as a run does after its checkpoint. The second job must never start.
    _stand_in(monkeypatch, STOP_THE_SWEEP, tmp_path / "started")
    code = run_sweep(["-m", f"logger.run_root={tmp_path}", "logger.run_name=s", "seed=0,1"])
    assert code == 130
    assert [p.name for p in (tmp_path / "started").iterdir()] == ["00-seed=0"]
    record = json.loads((tmp_path / "s" / SWEEP_FILE).read_text())
    assert [(j["name"], j["exit_code"]) for j in record["jobs"]] == [("00-seed=0", 130), ("01-seed=1", None)]
    out = capsys.readouterr().out
    assert "Continue: rlfw train -m " in out and "logger.run_name=s resume=true" in out
