"""Progress bars show on a terminal only, and `RLFW_PROGRESS=0` turns them off."""

from __future__ import annotations

import sys

import pytest

from rlfw.logging.progress import progress


@pytest.mark.parametrize(
    ("tty", "env", "shown"),
    [(True, None, True), (True, "1", True), (True, "0", False), (False, None, False)],
)
def test_bars_show_only_when_enabled(
    monkeypatch: pytest.MonkeyPatch, tty: bool, env: str | None, shown: bool
) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    if env is None:
        monkeypatch.delenv("RLFW_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("RLFW_PROGRESS", env)
    bar = progress(range(3), desc="generate")
    assert bar.disable is not shown
    assert list(bar) == [0, 1, 2]


def test_manual_bar_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLFW_PROGRESS", "1")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with progress(total=10, desc="train") as bar:
        bar.update(4)
        bar.update(6)
        assert bar.n == 10
