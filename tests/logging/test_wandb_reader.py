"""The offline W&B run, read back from its `.wandb` transaction log, holds exactly what was logged."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlfw.logging.logger import RunLogger
from rlfw.logging.metrics import is_hist_key, required_keys
from rlfw.logging.wandb_reader import BLOCK, WandbLogError, has_exit_record, read_offline_run
from rlfw.logging.wandb_sink import WandbSink, wait_for_exit_record
from tests.logging._builders import full_metrics

STEPS = 30  # ~5 KB a step with five histograms: the log spans several 32 KiB blocks


def wandb_logger(run_dir: Path, resume_from_step: int | None = None) -> RunLogger:
    return RunLogger(
        run_dir,
        wandb_enabled=True,
        wandb_mode="offline",
        project="rlfw-test",
        run_name="reader",
        config_dict={"seed": 0},
        resume_from_step=resume_from_step,
    )


def wandb_file(run_dir: Path) -> Path:
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    return path


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    run_dir = tmp_path_factory.mktemp("run")
    with wandb_logger(run_dir) as log:
        rows = [log.log(step, full_metrics(step, moe=True)) for step in range(STEPS)]
    return run_dir, rows


def test_the_log_spans_several_blocks(logged_run: tuple[Path, list[dict]]) -> None:
    assert wandb_file(logged_run[0]).stat().st_size > 3 * BLOCK


def test_scalars_read_back_exactly(logged_run: tuple[Path, list[dict]]) -> None:
    run_dir, logged = logged_run
    history = read_offline_run(run_dir)
    assert [h["_step"] for h in history] == list(range(STEPS))
    for row, h in zip(logged, history, strict=True):
        for key in required_keys(moe=True):
            if not is_hist_key(key):
                assert h[key] == row[key], key


def test_histograms_read_back_as_logged(logged_run: tuple[Path, list[dict]]) -> None:
    run_dir, logged = logged_run
    history = read_offline_run(run_dir)
    for row, h in zip(logged, history, strict=True):
        for key in (k for k in required_keys(moe=True) if is_hist_key(k)):
            assert h[key]["_type"] == "histogram"
            assert h[key]["values"] == row[key]["counts"]
            assert h[key]["bins"] == row[key]["edges"]


def test_jsonl_and_wandb_agree(logged_run: tuple[Path, list[dict]]) -> None:
    run_dir, _ = logged_run
    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    history = read_offline_run(run_dir)
    assert [r["step"] for r in jsonl] == [h["_step"] for h in history]
    assert [r["grad_norm"] for r in jsonl] == [h["grad_norm"] for h in history]


def test_resume_merges_segments_like_the_jsonl(tmp_path: Path) -> None:
    with wandb_logger(tmp_path) as log:
        for step in range(4):
            log.log(step, {"grad_norm": float(step)})
    with wandb_logger(tmp_path, resume_from_step=2) as log:
        for step in (2, 3, 4):
            log.log(step, {"grad_norm": 10.0 + step})
    segments = sorted(tmp_path.glob("wandb/offline-run-*"))
    assert len(segments) == 2 and len({p.name.split("-")[3] for p in segments}) == 1  # same run id
    got = [(h["_step"], h["grad_norm"]) for h in read_offline_run(tmp_path)]
    assert got == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0), (4, 14.0)]


def test_a_record_cut_short_at_the_end_is_ignored(
    tmp_path: Path, logged_run: tuple[Path, list[dict]]
) -> None:
    data = wandb_file(logged_run[0]).read_bytes()
    cut = tmp_path / "wandb" / "offline-run-x" / "run-x.wandb"
    cut.parent.mkdir(parents=True)
    cut.write_bytes(data[: 2 * BLOCK + 100])
    steps = [h["_step"] for h in read_offline_run(tmp_path)]
    assert 0 < len(steps) < STEPS and steps == list(range(len(steps)))


def test_a_damaged_record_is_an_error(tmp_path: Path, logged_run: tuple[Path, list[dict]]) -> None:
    data = bytearray(wandb_file(logged_run[0]).read_bytes())
    data[BLOCK + 500] ^= 0xFF
    bad = tmp_path / "wandb" / "offline-run-x" / "run-x.wandb"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(bytes(data))
    with pytest.raises(WandbLogError, match="corrupt chunk"):
        read_offline_run(tmp_path)


def test_a_foreign_file_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "wandb" / "offline-run-x" / "run-x.wandb"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"LEVELDB" + bytes(100))
    with pytest.raises(WandbLogError, match="not a W&B transaction log"):
        read_offline_run(tmp_path)


def test_no_run_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no offline W&B run"):
        read_offline_run(tmp_path)


class LateWriter:
    """A W&B run whose finish() returns before its log is complete, as wandb 0.31's did in about a
    third of runs: the last bytes land 0.3 s later."""

    def __init__(self, path: Path, data: bytes) -> None:
        self.settings = SimpleNamespace(sync_file=str(path))
        self.path, self.data = path, data
        path.write_bytes(data[: 2 * BLOCK])

    def finish(self) -> None:
        threading.Timer(0.3, self.path.write_bytes, args=(self.data,)).start()


def test_close_returns_only_once_the_log_is_complete(
    tmp_path: Path, logged_run: tuple[Path, list[dict]]
) -> None:
    late = LateWriter(tmp_path / "run-x.wandb", wandb_file(logged_run[0]).read_bytes())
    WandbSink(late, offline=True).close()
    assert has_exit_record(tmp_path / "run-x.wandb")


def test_an_unfinished_log_is_waited_for_then_warned_about(
    tmp_path: Path, logged_run: tuple[Path, list[dict]]
) -> None:
    cut = tmp_path / "run-x.wandb"
    cut.write_bytes(wandb_file(logged_run[0]).read_bytes()[: 2 * BLOCK])
    assert not has_exit_record(cut)
    with pytest.warns(UserWarning, match="did not finish writing"):
        wait_for_exit_record(cut, timeout_s=0.1)
