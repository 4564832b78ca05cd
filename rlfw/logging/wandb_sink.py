"""The W&B side of a run: one W&B run per run folder, offline unless the user asked for online.

Resume (the choice): the W&B run id is kept in `RUN_DIR/wandb_run_id`; reopening the run folder calls
`wandb.init(id=<same id>, resume="allow")`. Offline, W&B writes each opening as a new segment
`RUN_DIR/wandb/offline-run-*-<id>*/run-<id>.wandb`; `rlfw.logging.wandb_reader` merges the segments
in start order, a later segment replacing the steps it logs again (the same rule as the JSONL
truncation). Online, W&B continues the same run; the server ignores steps at or below the last step
it already holds, so a rewound resume shows only the new steps past that point there, while
metrics.jsonl and the offline segments keep the rewound history.
"""

from __future__ import annotations

import math
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Literal

from rlfw.logging.histogram import is_encoded_hist
from rlfw.logging.wandb_reader import has_exit_record

RUN_ID_FILE = "wandb_run_id"
FINISH_TIMEOUT_S = 30.0
WandbMode = Literal["offline", "online", "disabled"]
WANDB_MODES: tuple[WandbMode, ...] = ("offline", "online", "disabled")


def check_mode(mode: str) -> WandbMode:
    """`mode` as a W&B mode, or a ValueError naming the allowed ones."""
    for allowed in WANDB_MODES:
        if mode == allowed:
            return allowed
    raise ValueError(f"wandb_mode={mode!r} is not allowed; allowed: {', '.join(WANDB_MODES)}")


def run_id(run_dir: Path) -> str:
    """The W&B run id of `run_dir`, created on first use so every reopening resumes the same run."""
    path = run_dir / RUN_ID_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8").strip()
    new_id = uuid.uuid4().hex[:12]
    path.write_text(new_id + "\n", encoding="utf-8")
    return new_id


def to_wandb(row: dict[str, Any]) -> dict[str, Any]:
    """A JSONL row as W&B values: histograms as `wandb.Histogram`, null scalars as NaN, no `step`."""
    import wandb

    out: dict[str, Any] = {}
    for key, value in row.items():
        if key == "step":
            continue
        if is_encoded_hist(value):
            out[key] = wandb.Histogram(np_histogram=(value["counts"], value["edges"]))
        else:
            out[key] = math.nan if value is None else value
    return out


def wait_for_exit_record(path: Path, timeout_s: float) -> None:
    """Poll `path` until it holds its `exit` record; warn (not fail) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not has_exit_record(path):
        if time.monotonic() > deadline:
            warnings.warn(f"{path}: W&B did not finish writing within {timeout_s:.0f} s", stacklevel=2)
            return
        time.sleep(0.05)


class WandbSink:
    """A started W&B run (`wandb.sdk.wandb_run.Run`) logging each step at its own step number."""

    def __init__(self, run: Any, offline: bool):
        self._run = run
        self._offline = offline

    def log(self, row: dict[str, Any]) -> None:
        self._run.log(to_wandb(row), step=int(row["step"]))

    def close(self) -> None:
        """Finish the run and wait until its transaction log is complete on disk.

        `wandb.finish()` can return while W&B's writer still flushes the last block of the `.wandb`
        file (about half a second later, seen with wandb 0.31), so a reader right after `close`
        would miss the last steps; offline, we wait for the `exit` record, which W&B writes last.
        """
        sync_file = Path(self._run.settings.sync_file)
        self._run.finish()
        if self._offline:
            wait_for_exit_record(sync_file, FINISH_TIMEOUT_S)


def start_wandb(
    run_dir: Path,
    mode: WandbMode,
    project: str,
    name: str | None,
    config: dict[str, Any],
    group: str | None = None,
) -> WandbSink:
    """Start (or resume, same id) the W&B run of `run_dir`; `group` joins the runs of one sweep."""
    import wandb

    # console="off": stdout stays the caller's (Ray and pytest capture it); metrics.jsonl is the log.
    run = wandb.init(
        dir=str(run_dir),
        mode=mode,
        project=project,
        name=name,
        group=group,
        config=config,
        id=run_id(run_dir),
        resume="allow",
        settings=wandb.Settings(console="off", silent=True),
    )
    return WandbSink(run, offline=mode == "offline")
