"""metrics.jsonl: every required key on every line, strict JSON, one line per step across resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlfw.logging.histogram import decode_hist, encode_hist
from rlfw.logging.logger import RunLogger
from rlfw.logging.metrics import is_hist_key, required_keys
from tests.logging._builders import full_metrics


def lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def jsonl_logger(run_dir: Path, resume_from_step: int | None = None) -> RunLogger:
    return RunLogger(run_dir, wandb_enabled=False, resume_from_step=resume_from_step)


@pytest.mark.parametrize("moe", [False, True])
def test_every_line_carries_every_required_key(tmp_path: Path, moe: bool) -> None:
    with jsonl_logger(tmp_path) as log:
        for step in range(3):
            log.log(step, full_metrics(step, moe))
    rows = lines(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert set(row) == {"step", *required_keys(moe)}
        for key in required_keys(moe):
            if is_hist_key(key):
                assert decode_hist(row[key]).n == 200
            else:
                assert type(row[key]) is float


def test_values_are_written_as_given(tmp_path: Path) -> None:
    lr = torch.tensor([0.0, 1e-3, -2e-3])
    with jsonl_logger(tmp_path) as log:
        log.log(
            7, {"ess/lag": torch.tensor(0.75), "sync/resyncs": 2, "ratio/lag/hist": lr, "loss/policy": 1 / 3}
        )
    (row,) = lines(tmp_path)
    assert row == {
        "step": 7,
        "ess/lag": 0.75,
        "sync/resyncs": 2.0,
        "ratio/lag/hist": encode_hist(lr),
        "loss/policy": 1 / 3,
    }


def test_non_finite_scalars_are_null_and_lines_are_strict_json(tmp_path: Path) -> None:
    with jsonl_logger(tmp_path) as log:
        log.log(0, {"ratio/lag/mean": torch.tensor(float("nan")), "grad_norm": float("inf")})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert lines(tmp_path)[0] == {"step": 0, "ratio/lag/mean": None, "grad_norm": None}


def test_many_values_under_a_scalar_key_are_refused(tmp_path: Path) -> None:
    with jsonl_logger(tmp_path) as log, pytest.raises(ValueError, match="ess/total"):
        log.log(0, {"ess/total": torch.ones(3)})


def test_each_line_is_on_disk_before_log_returns(tmp_path: Path) -> None:
    log = jsonl_logger(tmp_path)
    log.log(0, {"grad_norm": 1.0})
    assert lines(tmp_path) == [{"step": 0, "grad_norm": 1.0}]
    log.close()


def test_steps_must_increase_even_across_reopening(tmp_path: Path) -> None:
    with jsonl_logger(tmp_path) as log:
        log.log(0, {"grad_norm": 1.0})
        log.log(1, {"grad_norm": 1.0})
        with pytest.raises(ValueError, match="not after the last logged step 1"):
            log.log(1, {"grad_norm": 2.0})
    with jsonl_logger(tmp_path) as log, pytest.raises(ValueError, match="last logged step 1"):
        log.log(0, {"grad_norm": 3.0})


def test_reopening_without_resume_appends(tmp_path: Path) -> None:
    with jsonl_logger(tmp_path) as log:
        log.log(0, {"grad_norm": 1.0})
    with jsonl_logger(tmp_path) as log:
        log.log(1, {"grad_norm": 2.0})
    assert [r["grad_norm"] for r in lines(tmp_path)] == [1.0, 2.0]


def test_resume_truncates_the_steps_it_will_rerun(tmp_path: Path) -> None:
    with jsonl_logger(tmp_path) as log:
        for step in range(5):
            log.log(step, {"grad_norm": float(step)})
    with jsonl_logger(tmp_path, resume_from_step=3) as log:
        assert [r["step"] for r in lines(tmp_path)] == [0, 1, 2]
        for step in (3, 4):
            log.log(step, {"grad_norm": 10.0 + step})
    assert [(r["step"], r["grad_norm"]) for r in lines(tmp_path)] == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 13.0),
        (4, 14.0),
    ]


def test_a_line_cut_by_a_kill_is_dropped_on_reopen(tmp_path: Path) -> None:
    with jsonl_logger(tmp_path) as log:
        log.log(0, {"grad_norm": 1.0})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 1, "grad_no')
    with jsonl_logger(tmp_path) as log:
        log.log(1, {"grad_norm": 2.0})
    assert lines(tmp_path) == [{"step": 0, "grad_norm": 1.0}, {"step": 1, "grad_norm": 2.0}]


def test_bad_wandb_mode_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="wandb_mode='cloud' is not allowed"):
        RunLogger(tmp_path, wandb_mode="cloud")
