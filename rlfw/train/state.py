"""The run folder: resolved config, resumable checkpoints written atomically, and the resume point."""

from __future__ import annotations

import itertools
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


@dataclass
class RunDir:
    """The run folder and how this start uses it."""

    path: Path
    resuming: bool  # continue from run_state.json
    created: bool  # this start made the folder (so a failed setup may remove it)


def make_run_dir(root: str, name: str | None, resume: bool) -> RunDir:
    """The run folder under ``root``, claimed atomically.

    * No name: a timestamp, with ``-1``, ``-2``, ... when a run started in the same second holds it
      (``mkdir`` without ``exist_ok`` is the lock: two runs never share a folder).
    * A name and no ``resume``: the folder must not exist.
    * ``resume=true``: continue from the folder's last checkpoint; a named run that died before its first
      checkpoint starts afresh in its folder (there is nothing to continue, and nothing is lost).
    """
    base = Path(root)
    if name is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for i in itertools.count():
            folder = base / (stamp if i == 0 else f"{stamp}-{i}")
            try:
                _mkdir(folder, root)
            except FileExistsError:
                continue
            return RunDir(folder, resuming=False, created=True)
    folder = base / str(name)
    if resume:
        if (folder / STATE_FILE).is_file():
            return RunDir(folder, resuming=True, created=False)
        created = not folder.exists()
        _mkdir(folder, root, exist_ok=True)
        return RunDir(folder, resuming=False, created=created)
    try:
        _mkdir(folder, root)
    except FileExistsError:
        saved = (
            "its last checkpoint" if (folder / STATE_FILE).is_file() else "the start (it saved no checkpoint)"
        )
        raise FileExistsError(
            f"{folder} already exists: pass resume=true to continue that run from {saved}, "
            "or pick another logger.run_name"
        ) from None
    return RunDir(folder, resuming=False, created=True)


def _mkdir(folder: Path, root: str, exist_ok: bool = False) -> None:
    """``folder.mkdir(parents=True)``; a run root that cannot hold it (not writable, a file in the way, a
    full disk) is the config's problem, named by its key."""
    from rlfw.config import ConfigError

    try:
        folder.mkdir(parents=True, exist_ok=exist_ok)
    except FileExistsError:
        raise
    except OSError as err:
        raise ConfigError(
            f"logger.run_root={root}: cannot create the run folder {folder} ({err.strerror}); "
            "pass a folder you can write to"
        ) from None


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
