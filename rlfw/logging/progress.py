"""Progress bars for the long phases of a step (generation, training), on stderr.

A thin wrapper on tqdm (installed with transformers and wandb). Bars are shown only on an
interactive terminal: in a log file or under Ray's captured output they would be carriage-return
noise, so they switch off when stderr is not a TTY, and `RLFW_PROGRESS=0` switches them off anywhere.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")

ENV_SWITCH = "RLFW_PROGRESS"


def progress_enabled() -> bool:
    """Whether bars are drawn: stderr is a terminal and `RLFW_PROGRESS` is not `0`."""
    return os.environ.get(ENV_SWITCH, "1") != "0" and sys.stderr.isatty()


def progress(iterable: Iterable[T] | None = None, *, total: int | None = None, desc: str = "") -> tqdm[Any]:
    """A tqdm bar over `iterable` (or a manual one, advanced with `.update(n)`), off when not enabled.

    Used as `for batch in progress(batches, desc="generate"): ...` or
    `with progress(total=n_tokens, desc="train") as bar: bar.update(k)`.
    """
    return tqdm(
        iterable, total=total, desc=desc, disable=not progress_enabled(), file=sys.stderr, leave=False
    )
