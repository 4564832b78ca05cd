"""The run folder: resolved config, resumable checkpoints written atomically, and the resume point."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

STATE_FILE = "run_state.json"


@dataclass
class RunState:
    """Where a run stands after a completed step; written only once that step's checkpoint is complete."""

    step: int  # last completed step
    version: int  # the trainer's weight version after that step
    tag: str  # trainer checkpoint tag under checkpoints/
    resyncs: int  # weight pushes so far
    # Async mode only (None in sync mode, where the engines always hold `version`):
    engine_version: int | None = None  # the version the engines hold after that step's resync
    pending_version: int | None = None  # the version the next step's generation was submitted at
    steps_since_sync: int = 0  # optimizer steps since the last push


def make_run_dir(root: str, name: str | None, resume: bool) -> Path:
    """``root/name`` (a timestamp when no name); refuses to reuse a run folder unless resuming."""
    folder = Path(root) / (name or time.strftime("%Y%m%d-%H%M%S"))
    if resume:
        if not (folder / STATE_FILE).is_file():
            raise FileNotFoundError(
                f"resume=true but {folder / STATE_FILE} does not exist; pass the logger.run_name of a run "
                "that saved a checkpoint"
            )
    elif (folder / STATE_FILE).is_file():
        raise FileExistsError(
            f"{folder} already holds a run; pass resume=true to continue it or pick another name"
        )
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_state(folder: Path, state: RunState) -> None:
    """Write ``run_state.json`` atomically (write, fsync, rename)."""
    tmp = folder / f".{STATE_FILE}.tmp"
    with tmp.open("w") as f:
        json.dump(asdict(state), f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(folder / STATE_FILE)


def read_state(folder: Path) -> RunState:
    return RunState(**json.loads((folder / STATE_FILE).read_text()))
