"""A full disk during a checkpoint: the previous checkpoint stays in force and intact, the partial one is
removed, and the run stops with one line that says "no space left" and how to continue.

If one of these breaks, a full disk ends a run in an opaque ``inline_container.cc`` error with a partial
tag folder beside the last good checkpoint.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from rlfw.train import checkpoint
from rlfw.train.checkpoint import CheckpointFailed, save_checkpoint
from rlfw.train.state import RunState, read_state, write_state
from tests.train._run import SMALL, run_train, run_until, state_step_at_least


class _FillingTrainer:
    """Writes part of a checkpoint, then fails the way torch does on a full disk (no errno)."""

    def save(self, folder: str, tag: str) -> None:
        (Path(folder) / tag).mkdir(parents=True)
        (Path(folder) / tag / "mp_rank_00_model_states.pt").write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")


def _with_previous(tmp_path: Path) -> RunState:
    old = tmp_path / "checkpoints" / "step000001"
    old.mkdir(parents=True)
    (old / "mp_rank_00_model_states.pt").write_bytes(b"x" * 4096)
    state = RunState(step=1, version=2, tag="step000001", resyncs=2)
    write_state(tmp_path, state)
    return RunState(step=3, version=4, tag="step000001", resyncs=4)


def test_a_failed_save_on_a_full_disk_keeps_the_previous_checkpoint_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _with_previous(tmp_path)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda _: usage._replace(free=1024))
    weights = cast(Any, None)
    with pytest.raises(
        CheckpointFailed, match=r"checkpoint step000003 could not be written: no space left"
    ) as e:
        save_checkpoint(tmp_path, cast(Any, _FillingTrainer()), weights, state)
    assert "the previous checkpoint (step000001) is intact" in str(e.value) and "resume=true" in str(e.value)
    assert "\n" not in str(e.value)
    assert read_state(tmp_path).tag == "step000001" and state.tag == "step000001"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step000001"]
    assert (tmp_path / "checkpoints" / "step000001" / "mp_rank_00_model_states.pt").stat().st_size == 4096


def test_other_failures_are_named_and_also_leave_the_previous_checkpoint(tmp_path: Path) -> None:
    state = _with_previous(tmp_path)
    with pytest.raises(CheckpointFailed, match=r"\(RuntimeError: \[enforce fail.*step000001\) is intact"):
        save_checkpoint(tmp_path, cast(Any, _FillingTrainer()), cast(Any, None), state)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step000001"]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs (needs the right to mount, as root in CI has)."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(disk: Path, leave: int) -> Path:
    """Fill ``disk`` until ``leave`` bytes are free."""
    filler = disk / "filler"
    with filler.open("wb") as f:
        while (free := shutil.disk_usage(disk).free) > leave:
            f.write(b"\0" * min(free - leave, 1 << 20))
            f.flush()
    return filler


@pytest.mark.slow
def test_a_run_whose_disk_fills_stops_with_the_previous_checkpoint_intact(small_disk: Path) -> None:
    """The disk fills once the first checkpoint is written; the run goes on meanwhile, so the checkpoint
    that fails is whichever comes next: the one before it stays in force and intact, and the run resumes
    from it to the end."""
    args = [*SMALL, "trainer.steps=1000", "trainer.checkpoint_every=2"]
    filled: list[Path] = []

    def fill(_: int) -> None:
        filled.append(_fill(small_disk, leave=256 * 1024))  # room for metrics rows, not a checkpoint

    run = run_until(small_disk, "full", args, state_step_at_least(1), 0, act=fill)
    assert run.returncode == 1, run.log[-3000:]
    (line,) = [line for line in run.log.splitlines() if "rlfw train: stopped:" in line]
    state = json.loads((run.run_dir / "run_state.json").read_text())
    kept = state["tag"]
    assert "no space left" in line and f"the previous checkpoint ({kept}) is intact" in line
    assert "Traceback" not in run.log
    assert kept == f"step{state['step']:06d}" and state["step"] >= 1
    assert sorted(p.name for p in (run.run_dir / "checkpoints").iterdir() if p.is_dir()) == [kept]
    filled[0].unlink()
    steps = state["step"] + 3
    resumed = run_train(
        small_disk, "full", *SMALL, f"trainer.steps={steps}", "trainer.checkpoint_every=2", "resume=true"
    )
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert [r["step"] for r in resumed.metrics()] == list(range(steps))
