"""Steps with nothing to train on: each is logged as skipped, with why, and too many in a row stop the run.

If one of these breaks, a run whose reward function fails on every sample skips every step, logs nothing
and exits 0, as if it had trained.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlfw.compose import load_config
from rlfw.train.phases import StalledRun, skip_step
from tests.train._run import bare_driver


def test_skipped_steps_are_logged_and_k_in_a_row_stop_the_run(tmp_path: Path) -> None:
    d = bare_driver(tmp_path, "trainer.max_skipped_steps=3")
    skip_step(d, 0, 16, 16, 0)
    skip_step(d, 1, 16, 10, 6)
    d.skipped_in_a_row = 0  # a step trained in between (train_on resets the count)
    skip_step(d, 3, 16, 16, 0)
    skip_step(d, 4, 16, 16, 0)
    with pytest.raises(StalledRun, match=r"3 steps in a row skipped \(last: 16 of 16 rewards failed"):
        skip_step(d, 5, 16, 16, 0)
    d.logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 3, 4, 5]
    assert all(r["train/skipped"] == 1.0 for r in rows)
    assert rows[1]["reward/failed"] == 10.0 and rows[1]["sync/dropped_stale"] == 6.0


def test_the_limit_is_a_config_field_with_a_range() -> None:
    assert load_config([]).trainer.max_skipped_steps == 3
    with pytest.raises(Exception, match=r"trainer\.max_skipped_steps=0 is out of range"):
        load_config(["trainer.max_skipped_steps=0"])
