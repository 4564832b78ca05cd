"""Run folders: claimed atomically, never shared, never left behind by a run that did not start.

If one of these breaks, two runs started in the same second interleave their metrics and overwrite each
other's checkpoints, a named run that died before its first checkpoint can be neither rerun nor resumed,
or every failed start leaves a folder holding only ``config.yaml``.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from rlfw.compose import load_config
from rlfw.config import ConfigError
from rlfw.train.run import train
from rlfw.train.state import STATE_FILE, make_run_dir


def test_unnamed_runs_started_together_get_separate_folders(tmp_path: Path) -> None:
    folders: list[Path] = []
    barrier = threading.Barrier(8)

    def start() -> None:
        barrier.wait()  # all eight claim in the same second
        folders.append(make_run_dir(str(tmp_path), None, resume=False).path)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(folders)) == 8 and all(f.is_dir() for f in folders)


def test_a_named_folder_is_refused_without_resume_and_says_what_to_do(tmp_path: Path) -> None:
    make_run_dir(str(tmp_path), "a", resume=False)
    with pytest.raises(FileExistsError, match=r"resume=true to continue that run from the start"):
        make_run_dir(str(tmp_path), "a", resume=False)
    (tmp_path / "a" / STATE_FILE).write_text("{}")
    with pytest.raises(FileExistsError, match=r"from its last checkpoint, or pick another logger\.run_name"):
        make_run_dir(str(tmp_path), "a", resume=False)


def test_resume_continues_a_checkpoint_or_starts_a_run_that_never_saved_one_afresh(tmp_path: Path) -> None:
    fresh = make_run_dir(str(tmp_path), "died_early", resume=True)  # no folder yet: a plain start
    assert not fresh.resuming and fresh.created
    again = make_run_dir(str(tmp_path), "died_early", resume=True)  # folder, no checkpoint: afresh
    assert not again.resuming and not again.created
    (tmp_path / "died_early" / STATE_FILE).write_text("{}")
    assert make_run_dir(str(tmp_path), "died_early", resume=True).resuming


def test_a_run_that_fails_its_checks_leaves_no_folder(tmp_path: Path) -> None:
    run = load_config(
        [f"logger.run_root={tmp_path}", "logger.run_name=bad", "model=hf", f"model.path={tmp_path}"]
    )
    with pytest.raises(Exception, match="config.json"):
        train(run)
    assert not (tmp_path / "bad").exists()


def test_a_run_root_that_cannot_hold_folders_names_the_key(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("")
    for name in (None, "named"):
        with pytest.raises(ConfigError, match=r"^logger\.run_root=.*a_file/runs: cannot create the run"):
            make_run_dir(str(tmp_path / "a_file" / "runs"), name, False)
