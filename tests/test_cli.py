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
