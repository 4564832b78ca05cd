"""`rlfw report SWEEP_DIR` / `rlfw report RUN RUN ...`: runs grouped by what differs, seeds pooled with
Student-t intervals, one offline page that a real browser renders without errors."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from rlfw.cli import main
from rlfw.logging import metrics as m
from rlfw.logging.compare import FINAL_WINDOW, collect, group_runs, mean_ci, summary
from rlfw.logging.jsonl import METRICS_FILE
from rlfw.logging.logger import RunLogger
from rlfw.sweep import SWEEP_FILE
from tests.logging._builders import full_metrics

REWARD_BY_JOB = {  # (correction, seed) -> the reward every step logs
    ("none", 0): 0.2,
    ("none", 1): 0.4,
    ("tis", 0): 0.5,
    ("tis", 1): 0.7,
}
STEPS = 12


def write_run(folder: Path, correction: str, seed: int, reward: float, steps: int = STEPS) -> None:
    with RunLogger(folder, wandb_enabled=False) as log:
        for step in range(steps):
            log.log(step, full_metrics(step) | {m.REWARD_MEAN: reward})
    (folder / "config.yaml").write_text(
        f"seed: {seed}\ncorrection:\n  name: {correction}\nlogger:\n  run_name: {folder.name}\n"
    )


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2x2 sweep folder as `rlfw train -m correction=none,tis seed=0,1` leaves it (one job shorter)."""
    folder = tmp_path_factory.mktemp("sweep")
    jobs = []
    for i, ((correction, seed), reward) in enumerate(REWARD_BY_JOB.items()):
        name = f"{i:02d}-correction={correction},seed={seed}"
        write_run(folder / name, correction, seed, reward, steps=STEPS if i != 3 else STEPS - 4)
        jobs.append({"name": name, "params": {"correction": correction, "seed": str(seed)}, "exit_code": 0})
    record = {"name": folder.name, "swept": {"correction": ["none", "tis"], "seed": ["0", "1"]}, "jobs": jobs}
    (folder / SWEEP_FILE).write_text(json.dumps(record))
    return folder


@pytest.fixture(scope="module")
def page(sweep: Path) -> Path:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["report", str(sweep)]) == 0
    return Path(out.getvalue().strip())


def test_mean_ci_is_the_student_t_interval() -> None:
    mean, half = mean_ci([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.303 * 1.0 / math.sqrt(3))
    assert math.isnan(mean_ci([5.0])[1]) and mean_ci([5.0, math.nan])[0] == 5.0


def test_a_sweep_is_grouped_by_its_swept_keys_with_seeds_pooled(sweep: Path) -> None:
    groups = group_runs(collect([sweep]))
    assert [(g.label, len(g.runs)) for g in groups] == [("correction=none", 2), ("correction=tis", 2)]
    rows = summary(groups)
    none, tis = rows
    assert none["final reward"] == pytest.approx((0.3, 12.706 * 0.1 / 1), rel=1e-6)
    assert tis["final reward"][0] == pytest.approx(0.6)
    # the shortest run ends at step 7: rewards at equal steps are read there
    assert f"reward at step {STEPS - 5}" in tis and FINAL_WINDOW == 10


def test_loose_run_folders_are_grouped_by_the_config_keys_that_differ(sweep: Path) -> None:
    folders = sorted(p for p in sweep.iterdir() if p.is_dir())
    groups = group_runs(collect(folders))
    assert [g.label for g in groups] == ['correction.name="none"', 'correction.name="tis"']


def test_several_sweeps_read_as_one_experiment(sweep: Path, tmp_path: Path) -> None:
    """An experiment run as two sweeps (say, one arm first, the rest later): their jobs are grouped
    together by the config keys that differ, as loose run folders are."""
    first, second = tmp_path / "first", tmp_path / "second"
    for folder, correction in ((first, "none"), (second, "tis")):
        folder.mkdir()
        jobs = []
        for seed in (0, 1):
            name = f"{seed:02d}-seed={seed}"
            shutil.copytree(
                sweep / next(p.name for p in sweep.glob(f"*correction={correction},seed={seed}")),
                folder / name,
            )
            jobs.append({"name": name, "params": {"seed": str(seed)}, "exit_code": 0})
        started = folder / "02-seed=2"  # a job that has started but not logged a step: left out
        started.mkdir()
        (started / "config.yaml").write_text(f"seed: 2\ncorrection:\n  name: {correction}\n")
        (started / METRICS_FILE).write_text("")
        jobs.append({"name": started.name, "params": {"seed": "2"}, "exit_code": None})
        (folder / SWEEP_FILE).write_text(
            json.dumps({"name": folder.name, "swept": {"seed": ["0", "1", "2"]}, "jobs": jobs})
        )
    groups = group_runs(collect([first, second]))
    assert sorted(g.label for g in groups) == ['correction.name="none"', 'correction.name="tis"']
    assert all(len(g.runs) == 2 for g in groups)


def test_the_page_is_one_offline_file_with_a_panel_per_logged_key(page: Path, sweep: Path) -> None:
    text = page.read_text()
    assert page == sweep / "compare.html"
    assert not re.search(r"<script[^>]* src=", text)  # plotly.js is inlined: nothing to fetch
    assert 'id="panel-reward/mean"' in text and 'id="panel-ratio/total/max_abs_log"' in text
    assert "correction=none (n=2)" in text and "0.3 ± 1.3" in text


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["report", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert "not found" in err.getvalue() and err.getvalue().count("\n") == 1


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def test_a_headless_browser_renders_every_panel_without_console_errors(page: Path, tmp_path: Path) -> None:
    browser = chromium()
    assert browser, "headless Chromium is needed (scripts/env.sh installs it: apt-get install chromium)"
    panels = len(re.findall(r'<div class="panel">', page.read_text()))
    out = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path}",
         "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    console = [line for line in out.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert console == [], console
    # plotly marks a div it has drawn into with js-plotly-plot and gives it an SVG
    assert panels > 20 and out.stdout.count("js-plotly-plot") >= panels
    assert out.stdout.count('class="main-svg"') >= panels
