"""The compiled log-softmax's speed at a real vocabulary, one thread, in ns an element.

    OMP_NUM_THREADS=1 .venv/bin/python bench/softmax_speed.py [--vocab 151936] [--reps 30]
    OMP_NUM_THREADS=1 .venv/bin/python bench/softmax_speed.py --rev HEAD~1

For 7 rows (the 4 MiB blocks the engines hand it) and 64 rows (a whole decode step at once): a row max alone
(``torch.amax``, a floor: one read of the rows), the kernel's statistics (``softmax_stats``: max, then the sum
of exponentials), the written log-softmax (``log_softmax_into``), ``token_logp``, and torch's own
``_log_softmax`` for comparison. Each figure is the median of ``--reps`` timed calls after one warm-up, with
freed memory kept (as the engines run), so no call pays for fresh pages.

``--rev``: also builds ``kernels/csrc`` as it is at that git revision (``linear_ab.build_at``) and times its
three functions alternated call by call with this checkout's (the torch rows are timed once). The two need
not give the same bits: this measures speed, ``bench/softmax_builds.py`` and the tests pin the bits.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import machine  # noqa: E402
from linear_ab import build_at  # noqa: E402
from paired import alternated_medians  # noqa: E402

from rlfw.distributed.cluster import keep_freed_memory  # noqa: E402
from rlfw.kernels import cpu_native  # noqa: E402


def timings(builds: dict[str, Any], rows: int, vocab: int, reps: int) -> dict[str, float]:
    """ns an element of each call, the kernels' on every build (``name@build``), alternated."""
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 3
    out = torch.empty_like(x)
    ids = torch.arange(rows) * 7 % vocab
    calls: dict[str, Callable[[], object]] = {
        "amax (one read)": lambda: torch.amax(x, -1),
        "torch _log_softmax": lambda: torch._log_softmax(x, -1, False),
    }
    for label, mod in builds.items():
        calls[f"softmax_stats@{label}"] = partial(mod.softmax_stats, x)
        calls[f"log_softmax_into@{label}"] = partial(mod.log_softmax_into, x, out)
        calls[f"token_logp@{label}"] = partial(mod.token_logp, x, ids)
    seconds = alternated_medians(list(calls.values()), reps)
    return {name: round(s / (rows * vocab) * 1e9, 3) for name, s in zip(calls, seconds, strict=True)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rev", help="also time kernels/csrc as it is at this git revision")
    a = ap.parse_args()
    kept = keep_freed_memory()
    torch.set_num_threads(1)
    result: dict[str, object] = {"machine": machine.describe(), "freed_memory_kept": kept, "vocab": a.vocab}
    with tempfile.TemporaryDirectory() as tmp:
        builds: dict[str, Any] = {"here": cpu_native.module()}
        if a.rev:
            builds[a.rev] = build_at(a.rev, Path(tmp))
        for rows in (7, 64):
            result[f"{rows} rows, ns an element"] = timings(builds, rows, a.vocab, a.reps)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
