"""`metrics.jsonl`: one JSON object per training step, the local record every report is drawn from.

Schema of a line: `{"step": <int>, "<key>": <float | null | histogram>, ...}` with keys from
`rlfw.logging.metrics`. Scalars are floats; a non-finite scalar (NaN when a ratio counted no token)
is written as `null`, so every line is strict JSON that any reader (jq, pandas) accepts. Histograms
use the form of `rlfw.logging.histogram`. Steps strictly increase down the file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlfw.logging.histogram import encode_hist, is_encoded_hist, to_numpy
from rlfw.logging.metrics import is_hist_key

METRICS_FILE = "metrics.jsonl"


class MetricsFileError(ValueError):
    """metrics.jsonl is missing or unreadable; the message names the file, the line and the fix."""


def encode_value(key: str, value: Any) -> float | None | dict[str, Any]:
    """The JSON value of one metric: a histogram for `*/hist` keys, else a float (None if not finite)."""
    if is_encoded_hist(value):
        return dict(value)
    if is_hist_key(key):
        return encode_hist(value)
    data = to_numpy(value)
    if data.size != 1:
        raise ValueError(f"metric {key!r} has {data.size} values; only `*/hist` keys take many")
    scalar = float(data[0])
    return scalar if math.isfinite(scalar) else None


def encode_row(step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON object of one step: `step` first, then every metric encoded."""
    if "step" in metrics:
        raise ValueError("metric key 'step' is reserved for the step number")
    return {"step": int(step)} | {key: encode_value(key, value) for key, value in metrics.items()}


def dump_row(row: dict[str, Any]) -> str:
    """One line of metrics.jsonl (without its newline); strict JSON, so NaN is refused."""
    return json.dumps(row, allow_nan=False)


def parse_line(path: Path, number: int, line: str) -> dict[str, Any]:
    """One line of metrics.jsonl (1-based `number`), or a MetricsFileError naming it."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise MetricsFileError(
            f"{path}: line {number} is not valid JSON ({err.msg}); delete or repair that line"
        ) from err
    if not isinstance(row, dict) or not isinstance(row.get("step"), int):
        raise MetricsFileError(f'{path}: line {number} is not an object with an integer "step"; repair it')
    return row


def read_rows(path: Path, drop_unterminated_tail: bool = False) -> list[dict[str, Any]]:
    """Every step of `path` in order.

    A last line without its newline is a step that a kill interrupted mid-write; with
    `drop_unterminated_tail` it is dropped (what the logger does before appending), otherwise it must
    parse like any other line.
    """
    if not path.is_file():
        raise MetricsFileError(f"{path} not found; run `rlfw train` to write it, or pass the run folder")
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    tail = lines.pop()  # "" when the file ends with its newline
    if tail and not drop_unterminated_tail:
        lines.append(tail)
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        row = parse_line(path, i + 1, line)
        if rows and row["step"] <= rows[-1]["step"]:
            raise MetricsFileError(
                f"{path}: line {i + 1} has step {row['step']} after step {rows[-1]['step']}; steps must "
                "increase (resume with RunLogger(..., resume_from_step=N) to rewrite from step N)"
            )
        rows.append(row)
    return rows


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace `path` with `rows` atomically (write a sibling, then rename), so a kill keeps the old file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.writelines(dump_row(row) + "\n" for row in rows)
    tmp.replace(path)
