"""`RunLogger`: every training step goes to `RUN_DIR/metrics.jsonl` and, unless disabled, to W&B.

The JSONL file is the record of truth (a report needs nothing else): each step is one line, written
and flushed before `log` returns, so killing the process loses at most the step being written (the OS
keeps what was flushed; we do not fsync every step). W&B is a second sink fed the same encoded row,
so both always agree on what a step held.

Resume: opening an existing run folder appends to it. With `resume_from_step=N` (restarting from the
checkpoint of step N) the lines of steps >= N are dropped first, atomically, so the rerun steps are
not duplicated; W&B resumes the same run id (see `rlfw.logging.wandb_sink`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from rlfw.logging.jsonl import METRICS_FILE, dump_row, encode_row, read_rows, write_rows
from rlfw.logging.wandb_sink import WandbSink, check_mode, start_wandb


def prepare_metrics_file(path: Path, resume_from_step: int | None) -> int | None:
    """Rewrite `path` to the steps a reopened run keeps; returns the last kept step (None if none).

    An unterminated last line (a kill mid-write) is always dropped; with `resume_from_step`, so is
    every step >= it. The file is rewritten only when something is dropped.
    """
    if not path.is_file():
        return None
    rows = read_rows(path, drop_unterminated_tail=True)
    kept = rows if resume_from_step is None else [r for r in rows if r["step"] < resume_from_step]
    data = path.read_bytes()
    if len(kept) != len(rows) or (data and not data.endswith(b"\n")):
        write_rows(path, kept)
    return kept[-1]["step"] if kept else None


class RunLogger:
    """Logs training steps of one run folder to metrics.jsonl and W&B (offline by default)."""

    def __init__(
        self,
        run_dir: str | Path,
        wandb_enabled: bool = True,
        wandb_mode: str = "offline",
        project: str = "rlfw",
        run_name: str | None = None,
        config_dict: dict[str, Any] | None = None,
        resume_from_step: int | None = None,
        group: str | None = None,
    ):
        mode = check_mode(wandb_mode)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.last_step = prepare_metrics_file(self.path, resume_from_step)
        self._wandb: WandbSink | None = None
        if wandb_enabled and mode != "disabled":  # first, so a failing W&B start leaves nothing open
            self._wandb = start_wandb(self.run_dir, mode, project, run_name, config_dict or {}, group)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Write one step; returns the JSON object written. Steps must increase."""
        if self._file is None:
            raise RuntimeError(f"RunLogger for {self.run_dir} is closed")
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(f"step {step} is not after the last logged step {self.last_step} in {self.path}")
        row = encode_row(step, metrics)
        self._file.write(dump_row(row) + "\n")
        self._file.flush()
        self.last_step = step
        if self._wandb is not None:
            self._wandb.log(row)
        return row

    def close(self) -> None:
        """Close the JSONL file and finish the W&B run; calling it twice is harmless."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
