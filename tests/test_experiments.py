"""The experiments of docs/findings.md, quick variants, as smoke tests: each sweep completes and its
comparison page renders with one group per cell. (The conclusions come from the full variants, see
docs/findings.md; a few seeds and steps cannot check them.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlfw.compose import available_recipes
from rlfw.sweep import SWEEP_FILE
from tests.train._run import env

QUICK = {  # experiment -> (jobs, groups on the comparison page)
    "discrepancy_lag_quick": (8, 8),
    "resync_quick": (6, 3),
    "router_replay_quick": (3, 3),
    "stale_kv_quick": (2, 2),
}


def test_every_experiment_has_a_quick_variant() -> None:
    full = [r for r in available_recipes() if r.startswith("experiments/") and not r.endswith("_quick")]
    assert sorted(f"{r.removeprefix('experiments/')}_quick" for r in full) == sorted(QUICK)


@pytest.mark.slow
@pytest.mark.parametrize("experiment", sorted(QUICK))
def test_the_quick_variant_completes_and_its_report_renders(experiment: str, tmp_path: Path) -> None:
    rlfw = str(Path(sys.executable).with_name("rlfw"))
    train = [rlfw, "train", "-m", f"recipe=experiments/{experiment}", f"logger.run_root={tmp_path}"]
    out = subprocess.run(
        train, env=env(), capture_output=True, text=True, timeout=1500, start_new_session=True
    )
    folder = tmp_path / experiment
    logs = "".join(log.read_text()[-1500:] for log in sorted(folder.glob("*.log")))  # launcher.parallel > 1
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:] + logs
    jobs, groups = QUICK[experiment]
    record = json.loads((folder / SWEEP_FILE).read_text())
    assert len(record["jobs"]) == jobs and all(j["exit_code"] == 0 for j in record["jobs"])
    report = subprocess.run([rlfw, "report", str(folder)], env=env(), capture_output=True, text=True)
    assert report.returncode == 0, report.stderr[-2000:]
    page = (folder / "compare.html").read_text()
    table = page.split('<table id="summary">', 1)[1].split("</table>", 1)[0]
    assert table.count("<tr>") == groups + 1  # a header and one row per group
