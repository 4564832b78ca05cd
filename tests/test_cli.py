"""The `rlfw` entry point: verbs exist, config errors are reported, unfinished verbs say so and fail."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlfw.cli import main


def test_python_dash_m_rlfw_shows_the_verbs() -> None:
    out = subprocess.run([sys.executable, "-m", "rlfw", "--help"], capture_output=True, text=True, check=True)
    for verb in ("train", "audit", "report"):
        assert verb in out.stdout


def test_bad_override_is_a_named_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "sync.policy=sometimes"]) == 2
    assert "sync.policy='sometimes' is not allowed" in capsys.readouterr().err


def test_unknown_verb_fails() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["fly"])
    assert exc.value.code != 0


def test_cfg_job_prints_the_composed_config_and_runs_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "recipe=example_dataset", "algo.kl_coef=0.25", "--cfg", "job"]) == 0
    out = capsys.readouterr().out
    assert (
        "kl_coef: 0.25" in out
        and "name: dataset" in out
        and "reward: examples/double/reward.py:reward" in out
    )
    assert main(["train", "--cfg", "hydra"]) == 2


@pytest.mark.parametrize(
    ("override", "use"),
    [
        ("hydra.run.dir=/tmp/x", "logger.run_root"),
        ("hydra.sweep.dir=/tmp/x", "logger.run_root"),
        ("+hydra.foo=1", "the logger.* keys"),
    ],
)
def test_hydra_settings_are_refused_with_the_rlfw_key(
    override: str, use: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Accepted and ignored would be worse than refused: the run would go somewhere else silently."""
    assert main(["train", override]) == 2
    err = capsys.readouterr().err
    assert "is not read by rlfw; use " + use in err and len(err.strip().splitlines()) == 1
