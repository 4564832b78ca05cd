"""W&B stays offline and quiet in these tests; nothing here touches the network."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
